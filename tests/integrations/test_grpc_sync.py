"""AceSpecDecInterceptor on a real grpc.server, driven by a real stub over loopback."""

from __future__ import annotations

import json

import grpc
import pytest
from support.grpc_services import CHUNKS, GENERATE, GENERATE_STREAM, Behaviour, SyncGeneration
from support.servers import serve_grpc, wait_for
from support.tenants import tenant

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDecInterceptor, MessageFields, generation_pb2_grpc
from ace_mw.integrations import generation_pb2 as pb
from ace_mw.state import InMemoryStateStore

CONFIG = {"mode": "prod", "paths": [GENERATE, GENERATE_STREAM]}
KEY = "sk-grpc"
AUTH = (("authorization", f"Bearer {KEY}"),)
TENANT = tenant(KEY)


@pytest.fixture(scope="module")
def behaviour():
    return Behaviour()


@pytest.fixture(scope="module")
def interceptor():
    return AceSpecDecInterceptor(config=CONFIG)


@pytest.fixture(scope="module")
def stub(behaviour, interceptor):
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            yield generation_pb2_grpc.GenerationStub(channel)


def request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(**{"model": "m", "prompt": "hi", "temperature": 0.0, **fields})


def servicer_saw(response: pb.GenerateResponse) -> dict:
    return json.loads(response.text)


def test_applied_directive_is_set_on_the_request_message(stub):
    saw = servicer_saw(stub.Generate(request(), metadata=AUTH))
    assert (saw["use"], saw["k"], saw["algorithm"]) == (True, 5, "eagle_2")


def test_servicer_sees_the_decision_through_the_contextvar(stub):
    saw = servicer_saw(stub.Generate(request(), metadata=AUTH))
    assert (saw["outcome"], saw["enabled"]) == ("applied", True)


def test_decision_is_sent_in_trailing_metadata(stub):
    _, call = stub.Generate.with_call(request(), metadata=AUTH)
    trailing = dict(call.trailing_metadata())
    assert (trailing["x-ace-speculative-decoding"], trailing["x-ace-speculative-decoding-reason"]) == ("applied", "ok")


def test_high_temperature_is_gated(stub):
    saw = servicer_saw(stub.Generate(request(temperature=1.5), metadata=AUTH))
    assert (saw["outcome"], saw["use"]) == ("gated", False)


def test_unset_temperature_means_the_api_default_and_is_gated(stub):
    saw = servicer_saw(stub.Generate(pb.GenerateRequest(model="m", prompt="hi"), metadata=AUTH))
    assert saw["outcome"] == "gated"


def test_nan_temperature_passes_through_ungated(stub):
    response, call = stub.Generate.with_call(request(temperature=float("nan")), metadata=AUTH)
    assert (servicer_saw(response)["outcome"], servicer_saw(response)["use"]) == ("off", False)
    assert dict(call.trailing_metadata())["x-ace-speculative-decoding-reason"] == "bad_temperature"


def test_override_metadata_off_leaves_the_message_untouched(stub):
    saw = servicer_saw(stub.Generate(request(), metadata=AUTH + (("x-ace-skill-speculative-decoding", "off"),)))
    assert (saw["outcome"], saw["use"], saw["k"], saw["algorithm"]) == ("off", False, 0, "")


def test_invalid_override_metadata_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request(), metadata=AUTH + (("x-ace-skill-speculative-decoding", "warp-9"),))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "warp-9" in caught.value.details() and "X-ACE-Skill-Speculative-Decoding" in caught.value.details()


def test_invalid_override_on_a_stream_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(request(), metadata=(("x-ace-skill-speculative-decoding", ""),)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_authorization_metadata_sent_twice_differently_is_invalid_argument(stub):
    twice = AUTH + (("authorization", "Bearer sk-someone-else"),)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request(), metadata=twice)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "authorization" in caught.value.details() and "more than once" in caught.value.details()
    assert stub.Generate(request(), metadata=AUTH + AUTH)  # the same value twice is one identity


def test_metadata_garbage_is_ignored(stub):
    garbage = (
        ("authorization", "Basic !!not-a-bearer!!"),
        ("x-api-key-bin", b"\xff\x00\xfe"),
        ("x-ace-conversation-id", ""),
        ("x-request-id", "~~ odd {value} ~~"),
        ("x-ace-skill-speculative-decoding-bin", b"\x00prod"),
    )
    saw = servicer_saw(stub.Generate(request(), metadata=garbage))
    assert saw["outcome"] == "applied"


def test_stream_yields_every_message_in_order(stub):
    responses = list(stub.GenerateStream(request(), metadata=AUTH))
    assert [r.text for r in responses[1:]] == list(CHUNKS)
    assert servicer_saw(responses[0])["use"] is True


@pytest.mark.parametrize("adapter", ["ace", "vllm", "sglang", "trtllm", "llamacpp"])
def test_streamed_figures_reach_the_breaker(behaviour, adapter):
    """The figures message is the integration's own contract: learned whatever the adapter."""
    controller = AceController(AceConfig.from_dict({**CONFIG, "adapter": adapter}))
    with serve_grpc(SyncGeneration(behaviour), [AceSpecDecInterceptor(controller=controller)]) as target:
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            list(stub.GenerateStream(request(), metadata=AUTH))
            stub.Generate(request(), metadata=AUTH)
    view = controller.store.view((TENANT, "m"))
    assert (view.samples, view.rolling_alpha) == (2, pytest.approx(0.8))


def test_method_not_in_config_paths_passes_through(behaviour):
    interceptor = AceSpecDecInterceptor(config={"mode": "prod", "paths": [GENERATE_STREAM]})
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            response, call = generation_pb2_grpc.GenerationStub(channel).Generate.with_call(request())
    assert (servicer_saw(response)["outcome"], servicer_saw(response)["use"]) == (None, False)
    assert "x-ace-speculative-decoding" not in dict(call.trailing_metadata())


def test_response_headers_off_sends_no_decision_metadata(behaviour):
    interceptor = AceSpecDecInterceptor(config={**CONFIG, "response_headers": False})
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            response, call = generation_pb2_grpc.GenerationStub(channel).Generate.with_call(request(), metadata=AUTH)
    assert (servicer_saw(response)["outcome"], servicer_saw(response)["use"]) == ("applied", True)
    assert not [key for key, _ in call.trailing_metadata() if key.startswith("x-ace-")]


def test_client_cancel_mid_stream_frees_the_probe_slot():
    behaviour = Behaviour()
    behaviour.figures = (10, 1, 10)
    config = {**CONFIG, "gate": {"min_samples": 1, "probe_fraction": 1.0, "cooldown_s": 60}}
    controller = AceController(AceConfig.from_dict(config))
    with serve_grpc(SyncGeneration(behaviour), [AceSpecDecInterceptor(controller=controller)]) as target:
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stub.Generate(request(), metadata=AUTH)  # alpha 0.1 trips the breaker
            assert controller.store.view((TENANT, "m")).state == "open"
            behaviour.hold_after = 2
            call = stub.GenerateStream(request(), metadata=AUTH)
            assert servicer_saw(next(call))["outcome"] == "applied"
            assert controller.store.view((TENANT, "m")).probes == 1
            call.cancel()
            behaviour.release.set()
            wait_for(lambda: controller.store.view((TENANT, "m")).probes == 0, what="the probe slot")


class BrokenController(AceController):
    def begin(self, request, write=None):
        raise RuntimeError("begin broke")


def test_internal_error_fails_open_and_is_counted(behaviour):
    interceptor = AceSpecDecInterceptor(controller=BrokenController(AceConfig.from_dict(CONFIG)))
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            response = generation_pb2_grpc.GenerationStub(channel).Generate(request())
    assert (servicer_saw(response)["outcome"], servicer_saw(response)["use"]) == (None, False)
    assert interceptor.failures.counts == {"begin": 1}


class BrokenStore(InMemoryStateStore):
    def admit(self, *args, **kwargs):
        raise RuntimeError("admit broke")


def test_a_fault_inside_the_controller_is_an_off_decision_for_the_servicer(behaviour):
    controller = AceController(AceConfig.from_dict(CONFIG), store=BrokenStore())
    interceptor = AceSpecDecInterceptor(controller=controller)
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            response = generation_pb2_grpc.GenerationStub(channel).Generate(request(), metadata=AUTH)
    assert (servicer_saw(response)["outcome"], servicer_saw(response)["use"]) == ("off", False)
    assert controller.status()["decisions"] == {"off": {"internal_error": 1}, "error": {"decide": 1}}
    assert interceptor.failures.counts == {"decide": 1}  # the same one tally, counted once


def test_field_mapping_chooses_where_facts_are_read_and_directives_written(behaviour):
    controller = AceController(AceConfig.from_dict(CONFIG))
    fields = MessageFields(body={"model": "prompt", "temperature": "temperature"})
    interceptor = AceSpecDecInterceptor(controller=controller, fields=fields)
    with serve_grpc(SyncGeneration(behaviour), [interceptor]) as target:
        with grpc.insecure_channel(target) as channel:
            response = generation_pb2_grpc.GenerationStub(channel).Generate(
                request(prompt="model-in-prompt"), metadata=AUTH
            )
    assert controller.store.view((TENANT, "model-in-prompt")) is not None
    saw = servicer_saw(response)
    assert (saw["outcome"], saw["use"]) == ("applied", False)  # unmapped: only the contextvar says so


def test_streamed_messages_are_timed_for_the_speed_policy(behaviour):
    controller = AceController(AceConfig.from_dict(CONFIG))
    with serve_grpc(SyncGeneration(behaviour), [AceSpecDecInterceptor(controller=controller)]) as target:
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            list(stub.GenerateStream(request(), metadata=AUTH))
            stub.Generate(request(), metadata=AUTH)  # one message: nothing to time, a miss
    arms = controller.store.arm_views((TENANT, "m"), controller.config.gate, 0.0)
    (arm,) = arms.values()
    assert arm.samples == pytest.approx(1.0) and arm.tokens_per_s > 0 and arm.misses == 1


def test_the_figures_message_reads_zeros_as_nothing_drafted_and_contradictions_as_absurd():
    from ace_mw.integrations.grpc import message_figures

    unset = message_figures({"num_draft_tokens": 0, "num_accepted_draft_tokens": 0, "num_spec_steps": 0})
    assert unset is not None and unset.drafted_nothing and unset.alpha is None
    counted = message_figures(
        {"num_draft_tokens": 40, "num_accepted_draft_tokens": 30, "num_spec_steps": 12, "output_tokens": 42}
    )
    assert counted is not None and (counted.alpha, counted.output_tokens) == (0.75, 42)
    more_accepted_than_drafted = message_figures({"num_draft_tokens": 4, "num_accepted_draft_tokens": 9})
    assert more_accepted_than_drafted is not None and more_accepted_than_drafted.absurd
