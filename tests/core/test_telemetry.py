"""OpenTelemetry output, checked with the SDK's in-memory span exporter and metric reader."""

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.tenants import tenant
from support.views import view as request_view

from ace_mw import AceConfig, AceController, InvalidOverrideHeader
from ace_mw.state import InMemoryStateStore

RAW_KEY = "sk-very-secret-key"


@pytest.fixture
def otel():
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    return tracer_provider, exporter, MeterProvider(metric_readers=[reader]), reader


def controller_for(otel, store=None, **config):
    tracer_provider, _, meter_provider, _ = otel
    return AceController(
        AceConfig.from_dict({"mode": "prod", "gate": {"policy": "acceptance"}, **config}),
        store=store,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )


def view(temperature=0.2, headers=None):
    return request_view({"model": "m", "temperature": temperature, "stream": True, "messages": []}, headers, RAW_KEY)


def serve(controller, decision, alpha=0.8):
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    observer.feed(
        json.dumps(
            {
                # the prefill's token, then 10 steps of one token plus their accepted drafts
                "usage": {"completion_tokens": 11 + round(alpha * 50)},
                "metrics": {
                    "speculative_decoding": {
                        "num_draft_tokens": 50,
                        "num_accepted_draft_tokens": round(alpha * 50),
                        "num_spec_steps": 10,
                    }
                },
            }
        ).encode(),
        more_body=False,
    )
    observer.finish()


def points(reader, name):
    data = reader.get_metrics_data()
    return [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def test_without_a_current_span_a_chat_span_is_started_and_ended_with_the_response(otel):
    controller = controller_for(otel)
    decision = controller.decide(view())
    assert otel[1].get_finished_spans() == ()
    serve(controller, decision)
    (span,) = otel[1].get_finished_spans()
    assert span.name == "chat m"
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "m"
    assert attributes["gen_ai.request.temperature"] == 0.2
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["ace.spec_decode.mode"] == "prod"
    assert attributes["ace.spec_decode.mode_source"] == "org"
    assert attributes["ace.spec_decode.decision"] == "applied"
    assert attributes["ace.spec_decode.reason"] == "ok"
    assert attributes["ace.spec_decode.algorithm"] == "eagle_2"
    assert attributes["ace.spec_decode.num_speculative_tokens"] == 5
    assert attributes["ace.spec_decode.breaker_state"] == "closed"
    assert attributes["ace.spec_decode.canary"] is False
    assert attributes["ace.spec_decode.acceptance_rate"] == 0.8
    assert attributes["ace.spec_decode.accepted_per_step"] == 5.0
    assert attributes["ace.spec_decode.rolling_alpha"] == 0.8
    assert attributes["gen_ai.usage.output_tokens"] == 51
    assert attributes["ace.tenant.hash"] == decision.tenant


def test_an_unread_response_still_ends_a_recording_span_with_the_response(otel):
    """Past `gate.max_measured_per_s` a response is not read; with no span recording it gets no
    observer at all, but a recording span must still end with the response, not at the decision."""
    controller = controller_for(otel, gate={"policy": "acceptance", "max_measured_per_s": 0.01})
    serve(controller, controller.decide(view()))  # the first one takes the bucket's read
    unread = controller.decide(view())
    assert not unread.measured
    observer = controller.observe(unread)
    assert observer is not None
    assert len(otel[1].get_finished_spans()) == 1  # the first response's span only
    observer.start(200, "text/event-stream")
    observer.feed(b"data: [DONE]\n\n", more_body=False)
    observer.finish()
    span = otel[1].get_finished_spans()[-1]
    assert span.attributes["ace.spec_decode.response"] == "unmeasured"
    assert "ace.spec_decode.acceptance_rate" not in span.attributes
    no_sdk = AceController(AceConfig.from_dict({"mode": "prod", "gate": {"max_measured_per_s": 0.01}}))
    no_sdk.observe(no_sdk.decide(view())).finish()
    assert no_sdk.observe(no_sdk.decide(view())) is None


def test_current_span_receives_the_attributes_and_no_span_is_added(otel):
    controller = controller_for(otel)
    with otel[0].get_tracer("app").start_as_current_span("POST /v1/chat/completions"):
        serve(controller, controller.decide(view()))
    (span,) = otel[1].get_finished_spans()
    assert span.name == "POST /v1/chat/completions"
    assert span.attributes["ace.spec_decode.decision"] == "applied"
    assert span.attributes["ace.spec_decode.acceptance_rate"] == 0.8


def test_begin_leaves_the_decisions_attributes_to_the_responses_end(otel):
    """The path the integrations take (`begin`) sets no attribute while the request waits: the
    decision's go on the span with the response's, in one call when the response ends. The
    public `decide` sets them at once."""
    controller = controller_for(otel)
    with otel[0].get_tracer("app").start_as_current_span("POST /v1/chat/completions") as span:
        decision, observer = controller.begin(view())
        assert observer is not None and "ace.spec_decode.decision" not in span.attributes
        observer.start(200, "text/event-stream")
        observer.feed(b"data: [DONE]\n\n", more_body=False)
        observer.finish()
        assert span.attributes["ace.spec_decode.decision"] == "applied"
        assert span.attributes["ace.tenant.hash"] == decision.tenant
        assert span.attributes["ace.spec_decode.response"] == "no_figures"
    with otel[0].get_tracer("app").start_as_current_span("POST /v1/chat/completions") as span:
        controller.decide(view())
        assert span.attributes["ace.spec_decode.decision"] == "applied"


def test_gated_decision_has_no_algorithm_attributes(otel):
    controller = controller_for(otel)
    serve(controller, controller.decide(view(temperature=1.2)))
    (span,) = otel[1].get_finished_spans()
    assert span.attributes["ace.spec_decode.reason"] == "temperature"
    assert "ace.spec_decode.algorithm" not in span.attributes


def test_raw_key_never_appears_in_telemetry(otel):
    controller = controller_for(otel)
    serve(controller, controller.decide(view()))
    (span,) = otel[1].get_finished_spans()
    assert not any(RAW_KEY in str(value) for value in span.attributes.values())
    assert not any(RAW_KEY in str(point.attributes) for point in points(otel[3], "ace.spec_decode.decisions"))


def test_decisions_are_counted_by_outcome_and_reason(otel):
    controller = controller_for(otel)
    for temperature in (0.1, 0.2, 1.5):
        controller.decide(view(temperature))
    counts = {
        (p.attributes["ace.spec_decode.decision"], p.attributes["ace.spec_decode.reason"]): p.value
        for p in points(otel[3], "ace.spec_decode.decisions")
    }
    assert counts == {("applied", "ok"): 2, ("gated", "temperature"): 1}


def test_acceptance_rate_histogram_records_each_response(otel):
    controller = controller_for(otel)
    for alpha in (0.6, 1.0):
        serve(controller, controller.decide(view()), alpha)
    (point,) = points(otel[3], "ace.spec_decode.acceptance_rate")
    assert (point.count, point.sum) == (2, pytest.approx(1.6))


class BrokenStore(InMemoryStateStore):
    def admit(self, *args, **kwargs):
        raise RuntimeError("store down")


def test_internal_errors_are_counted_by_stage(otel):
    controller_for(otel, store=BrokenStore()).decide(view())
    (point,) = points(otel[3], "ace.spec_decode.errors")
    assert (point.attributes["ace.stage"], point.value) == ("decide", 1)


def test_rejected_override_header_ends_our_span_with_an_error_type(otel):
    with pytest.raises(InvalidOverrideHeader):
        controller_for(otel).decide(view(headers={"x-ace-skill-speculative-decoding": "bogus"}))
    (span,) = otel[1].get_finished_spans()
    assert span.attributes["error.type"] == "InvalidOverrideHeader"


NO_SDK_UNTIL_INSTALLED = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ace_mw import AceConfig, AceController, RequestView
from ace_mw.operate import telemetry

now = [100.0]
telemetry.time.monotonic = lambda: now[0]  # this process's clock, moved by hand
view = RequestView("POST", "/v1/chat/completions", {}, {"model": "m", "temperature": 0.2, "messages": []})
controller = AceController(AceConfig.from_dict({"mode": "prod"}))  # the global (proxy) tracer
assert controller.decide(view).span is None  # no SDK: no span of ours, not even a no-op one
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
now[0] += telemetry.NOOP_TRACER_RECHECK_S / 2
assert controller.decide(view).span is None  # the no-op verdict still holds...
now[0] += telemetry.NOOP_TRACER_RECHECK_S
decision = controller.decide(view)  # ...and is asked again once it is older than the recheck time
assert decision.owns_span and decision.span.is_recording()
controller.observe(decision).finish()
assert [span.name for span in exporter.get_finished_spans()] == ["chat m"]
print("ok")
"""


def test_without_an_sdk_no_span_is_started_until_one_is_installed():
    """The API's no-op tracer is noticed by the span it returns (INVALID_SPAN) and believed for
    NOOP_TRACER_RECHECK_S: requests in between start no span at all; an SDK installed later
    gets our spans after that (run in a subprocess: the global provider can be set only once)."""
    done = subprocess.run([sys.executable, "-c", NO_SDK_UNTIL_INSTALLED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_rejected_override_header_is_counted_without_an_sdk():
    controller = AceController(AceConfig.from_dict({"mode": "prod"}))
    with pytest.raises(InvalidOverrideHeader):
        controller.decide(view(headers={"x-ace-skill-speculative-decoding": "bogus"}))
    assert controller.status()["decisions"]["rejected"] == {"InvalidOverrideHeader": 1}


# -- what operators alert on ---------------------------------------------------------------------------


def test_breaker_state_and_trips_per_tenant_and_model_are_observed_with_the_key_name(otel):
    from ace_mw.config import hash_key

    named = {hash_key(RAW_KEY): {"name": "team-a"}}
    controller = controller_for(otel, keys=named, gate={"policy": "acceptance", "min_samples": 2})
    for _ in range(2):
        serve(controller, controller.decide(view()), alpha=0.1)  # below the 0.55 floor: trips
    (state,) = points(otel[3], "ace.spec_decode.breaker_state")
    assert state.attributes == {"ace.tenant": "team-a", "gen_ai.request.model": "m"} and state.value == 2
    (trips,) = points(otel[3], "ace.spec_decode.breaker_trips")
    assert trips.value == 1
    controller.decide(request_view({"model": "m", "temperature": 0.2}, None, "sk-unnamed"))  # shows as its hash
    labels = {p.attributes["ace.tenant"] for p in points(otel[3], "ace.spec_decode.breaker_state")}
    assert labels == {"team-a", tenant("sk-unnamed")}


def test_decisions_carry_the_key_name_and_never_an_unnamed_keys_hash(otel):
    from ace_mw.config import hash_key

    controller = controller_for(otel, keys={hash_key(RAW_KEY): {"name": "team-a"}})
    controller.decide(view())
    controller.decide(request_view({"model": "m", "temperature": 0.2}, None, "sk-unnamed"))
    tenants = [p.attributes.get("ace.tenant") for p in points(otel[3], "ace.spec_decode.decisions")]
    assert sorted(tenants, key=str) == sorted(["team-a", None], key=str)
    decision = controller.decide(view())
    controller.observe(decision).finish()
    (span, *_) = [s for s in otel[1].get_finished_spans() if s.attributes.get("ace.tenant.name")]
    assert span.attributes["ace.tenant.name"] == "team-a"


def test_config_version_and_store_health_are_observed(otel):
    controller = controller_for(otel)
    (version,) = points(otel[3], "ace.config.version")
    assert version.value == 1
    controller.update(AceConfig.from_dict({"mode": "shadow"}))
    (version,) = points(otel[3], "ace.config.version")
    assert version.value == 2
    (health,) = points(otel[3], "ace.state.healthy")
    assert (health.value, health.attributes) == (1, {"ace.state.backend": "memory"})


def test_decode_speed_is_a_histogram_per_model_and_arm(otel):
    controller = controller_for(otel, gate={"policy": "speed"})
    decision = controller.decide(view())
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    figures = {"num_draft_tokens": 50, "num_accepted_draft_tokens": 40, "num_spec_steps": 10, "decode_time_s": 0.5}
    body = {"usage": {"completion_tokens": 31}, "metrics": {"speculative_decoding": figures}}
    observer.feed(json.dumps(body).encode(), more_body=False)
    observer.finish()
    (point,) = points(otel[3], "ace.spec_decode.decode_speed")
    assert point.attributes == {"gen_ai.request.model": "m", "ace.spec_decode.arm": decision.arm}
    assert point.count == 1 and point.sum == pytest.approx(60.0)
