"""AceController end to end over the real adapters and response observer: outcomes and reasons,
shadow, canary, gates, breaker learning, config swaps, fail-open."""

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import Clock
from support.views import view

from ace_mw import AceConfig, AceController, InvalidOverrideHeader, Mode, RequestView, register_adapter
from ace_mw.adapters import NO_INJECTION
from ace_mw.adapters.vllm import VLLMAdapter
from ace_mw.decide.gate import CLOSED, OPEN
from ace_mw.state import InMemoryStateStore

HEADER = "x-ace-skill-speculative-decoding"
PATH = "/v1/chat/completions"
FAST_GATE = {"min_samples": 3, "min_probe_samples": 1, "cooldown_s": 10, "probe_fraction": 0.0, "ema_half_life": 1e9}


def config(**overrides):
    """A prod config; the gate runs the acceptance policy (always the first candidate) unless a test
    asks for the speed policy, whose own tests are in test_speed_gate.py."""
    gate = {"policy": "acceptance", **overrides.pop("gate", {})}
    return AceConfig.from_dict({"mode": "prod", "gate": gate, **overrides})


def respond(controller, decision, alpha=None):
    """Serve one JSON response through the decision's observer, reporting `alpha` (or no figures)."""
    observer = controller.observe(decision)
    payload = {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 40}}
    if alpha is not None:
        payload["metrics"] = {
            "speculative_decoding": {
                "num_draft_tokens": 100,
                "num_accepted_draft_tokens": round(alpha * 100),
                "num_spec_steps": 20,
            }
        }
    observer.start(200, "application/json")
    observer.feed(json.dumps(payload).encode(), more_body=False)
    return observer.finish()


# -- outcomes -------------------------------------------------------------------------------------------


def test_prod_low_temperature_request_is_applied():
    decision = AceController(config()).decide(view())
    assert (decision.outcome, decision.reason, decision.mode_source) == ("applied", "ok", "org")
    assert decision.directive.enabled and decision.directive.pool == "speculative"


def test_applied_decision_injects_the_speculative_fields():
    controller = AceController(config(speculative={"algorithm": "eagle", "num_speculative_tokens": 3}))
    body = view().body
    _, new, injection = controller.inject(controller.decide(view()), body)
    assert (new["use_speculative_decoding"], new["speculative_algorithm"], new["num_speculative_tokens"]) == (
        True,
        "eagle",
        3,
    )
    assert injection.pool == "speculative"
    assert "use_speculative_decoding" not in body  # the input is never mutated


def test_missing_temperature_is_gated_by_default():
    decision = AceController(config()).decide(view({"model": "m", "messages": []}))
    assert (decision.outcome, decision.reason, decision.temperature) == ("gated", "temperature", 1.0)


def test_missing_temperature_uses_the_configured_default():
    decision = AceController(config(gate={"default_temperature": 0.0})).decide(view({"model": "m"}))
    assert decision.outcome == "applied"


def test_temperature_at_the_threshold_is_applied():
    assert AceController(config()).decide(view({"model": "m", "temperature": 0.7})).outcome == "applied"


def test_temperature_above_the_threshold_is_gated():
    assert AceController(config()).decide(view({"model": "m", "temperature": 0.71})).reason == "temperature"


def test_gated_decision_switches_speculation_off_in_the_body():
    controller = AceController(config())
    _, new, injection = controller.inject(controller.decide(view({"model": "m"})), {"model": "m"})
    assert new["use_speculative_decoding"] is False and injection.pool == "baseline"


@pytest.mark.parametrize("temperature", ["hot", True, float("nan"), -1])
def test_bad_temperature_passes_through_untouched(temperature):
    body = {"model": "m", "temperature": temperature}
    controller = AceController(config())
    decision = controller.decide(view(body))
    assert (decision.outcome, decision.reason, decision.temperature) == ("off", "bad_temperature", None)
    assert controller.inject(decision, body).body is body


def test_mode_off_leaves_the_body_untouched():
    controller = AceController(config(mode="off"))
    decision = controller.decide(view())
    body = view().body
    assert (decision.outcome, decision.reason) == ("off", "mode_off")
    assert controller.inject(decision, body).body is body


def test_unreadable_body_is_off_with_its_cause():
    decision = AceController(config()).decide(view(body=None, body_error="not_json"))
    assert (decision.outcome, decision.reason) == ("off", "body_unreadable:not_json")


def test_route_not_configured_is_off():
    decision = AceController(config()).decide(view(path="/v1/embeddings"))
    assert (decision.outcome, decision.reason) == ("off", "route_not_handled")


def test_invalid_override_header_is_the_only_error_raised():
    with pytest.raises(InvalidOverrideHeader):
        AceController(config()).decide(view(headers={HEADER: "turbo"}))


def test_header_not_permitted_is_noted_in_the_decision():
    controller = AceController(config(mode="off", allow_header_override=False))
    decision = controller.decide(view(headers={HEADER: "prod"}))
    assert (decision.outcome, decision.notes) == ("off", ("override_not_permitted",))


def test_response_headers_name_outcome_and_reason():
    decision = AceController(config()).decide(view({"model": "m"}))
    assert decision.response_headers() == [
        (b"x-ace-speculative-decoding", b"gated"),
        (b"x-ace-speculative-decoding-reason", b"temperature"),
    ]


def test_key_settings_choose_the_speculative_parameters():
    controller = AceController(config(keys={"sk-a": {"speculative": {"num_speculative_tokens": 2}}}))
    assert controller.decide(view()).directive.num_speculative_tokens == 2
    assert controller.decide(view(key="sk-b")).directive.num_speculative_tokens == 5


# -- shadow -----------------------------------------------------------------------------------------------


def test_shadow_records_what_prod_would_do_and_leaves_the_body_untouched():
    controller = AceController(config(mode="shadow"))
    decision = controller.decide(view())
    body = view().body
    assert (decision.outcome, decision.reason, decision.directive.enabled) == ("shadow", "ok", False)
    assert controller.inject(decision, body).body is body


def test_shadow_reports_a_would_be_gate():
    decision = AceController(config(mode="shadow")).decide(view({"model": "m", "temperature": 1.5}))
    assert (decision.outcome, decision.reason) == ("shadow", "temperature")


def test_shadow_learns_from_reported_acceptance():
    controller = AceController(config(mode="shadow", gate=FAST_GATE))
    for _ in range(3):
        respond(controller, controller.decide(view()), alpha=0.1)
    decision = controller.decide(view())
    assert (decision.outcome, decision.reason, decision.breaker_state) == ("shadow", "breaker_open", OPEN)


# -- canary -----------------------------------------------------------------------------------------------


def test_canary_zero_percent_excludes_prod_traffic():
    decision = AceController(config(canary_percent=0)).decide(view())
    assert (decision.outcome, decision.reason, decision.canary) == ("off", "canary_excluded", False)


def test_full_rollout_is_not_marked_canary():
    assert AceController(config()).decide(view()).canary is False


def test_canary_is_sticky_per_conversation():
    controller = AceController(config(canary_percent=50))
    for conversation in map(str, range(30)):
        outcomes = {
            controller.decide(view(headers={"x-ace-conversation-id": conversation}, request_id=str(i))).outcome
            for i in range(5)
        }
        assert len(outcomes) == 1


def test_canary_splits_conversations():
    controller = AceController(config(canary_percent=50))
    decisions = [controller.decide(view({"model": "m", "temperature": 0, "user": f"u{i}"})) for i in range(40)]
    assert {d.outcome for d in decisions} == {"applied", "off"}
    assert all(d.canary == (d.outcome == "applied") for d in decisions)


def test_key_canary_percent_overrides_the_org_percent():
    controller = AceController(config(canary_percent=0, keys={"sk-a": {"canary_percent": 100}}))
    assert controller.decide(view()).outcome == "applied"


def test_header_override_bypasses_the_canary():
    decision = AceController(config(canary_percent=0)).decide(view(headers={HEADER: "prod"}))
    assert (decision.outcome, decision.mode_source) == ("applied", "header")


# -- breaker ----------------------------------------------------------------------------------------------


def test_low_acceptance_trips_the_breaker_for_that_tenant_and_model():
    controller = AceController(config(gate=FAST_GATE), clock=Clock(0.0))
    for _ in range(3):
        respond(controller, controller.decide(view()), alpha=0.2)
    assert (controller.decide(view()).outcome, controller.decide(view()).reason) == ("gated", "breaker_open")
    assert controller.decide(view(key="sk-b")).outcome == "applied"
    assert controller.decide(view({"model": "other", "temperature": 0})).outcome == "applied"


def test_high_acceptance_keeps_the_breaker_closed():
    controller = AceController(config(gate=FAST_GATE))
    for _ in range(10):
        respond(controller, controller.decide(view()), alpha=0.9)
    assert controller.decide(view()).breaker_state == CLOSED


def test_breaker_recovers_through_a_probe_after_the_cooldown():
    clock = Clock(0.0)
    controller = AceController(config(gate=FAST_GATE), clock=clock)
    for _ in range(3):
        respond(controller, controller.decide(view()), alpha=0.2)
    clock.now = 10.0
    probe = controller.decide(view())
    assert (probe.outcome, probe.reason, probe.probe) == ("applied", "probe", True)
    respond(controller, probe, alpha=0.9)
    assert controller.decide(view()).reason == "ok"


def test_probe_without_figures_releases_its_slot():
    clock = Clock(0.0)
    controller = AceController(config(gate={**FAST_GATE, "max_concurrent_probes": 1}), clock=clock)
    for _ in range(3):
        respond(controller, controller.decide(view()), alpha=0.2)
    clock.now = 10.0
    respond(controller, controller.decide(view()), alpha=None)
    assert controller.decide(view()).probe is True


def test_gated_responses_do_not_feed_the_breaker():
    controller = AceController(config(gate=FAST_GATE))
    for _ in range(5):
        respond(controller, controller.decide(view({"model": "m", "temperature": 1.5})), alpha=0.0)
    assert controller.decide(view()).outcome == "applied"


# -- how many responses are read -------------------------------------------------------------------------


def test_responses_past_the_read_rate_keep_the_decision_but_are_neither_forced_nor_read():
    clock = Clock(0.0)
    controller = AceController(config(gate={**FAST_GATE, "max_measured_per_s": 1.0}), clock=clock)
    stream = {"model": "m", "temperature": 0.2, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    read, unread = controller.decide(view(stream)), controller.decide(view(stream))
    assert [(d.outcome, d.reason, d.directive.enabled) for d in (read, unread)] == [("applied", "ok", True)] * 2
    assert (read.measured, unread.measured) == (True, False)
    assert read.response_headers() == unread.response_headers()
    _, read_body, read_forced = controller.inject(read, stream)
    _, unread_body, unread_forced = controller.inject(unread, stream)
    assert read_body["stream_options"] == {"include_usage": True} and read_forced.forced
    assert "stream_options" not in unread_body and not unread_forced.forced
    assert unread_body["use_speculative_decoding"] is True  # speculation is switched all the same
    assert controller.observe(unread) is None  # nothing to read, force out, record or end: no observer
    assert respond(controller, read, alpha=0.2).alpha == 0.2
    assert controller.store.view((read.tenant, "m")).samples == 1
    clock.now = 1.0  # the bucket refilled
    assert controller.decide(view(stream)).measured


def test_probes_are_read_past_the_read_rate():
    clock = Clock(0.0)
    controller = AceController(config(gate={**FAST_GATE, "max_measured_per_s": 0.01}), clock=clock)
    for _ in range(3):  # a read every 100 s trips the breaker in three
        respond(controller, controller.decide(view()), alpha=0.2)
        clock.now += 100.0
    # HALF_OPEN: two probe slots, both read without taking the one read the bucket holds
    decisions = [controller.decide(view()) for _ in range(4)]
    assert [(d.reason, d.measured) for d in decisions] == [
        ("probe", True),
        ("probe", True),
        ("breaker_open", True),
        ("breaker_open", False),
    ]


# -- config swaps -----------------------------------------------------------------------------------------


def test_update_swaps_the_config_for_new_requests_only():
    controller = AceController(config())
    before = controller.decide(view())
    controller.update(config(mode="off"))
    after = controller.decide(view())
    assert (before.config.mode, after.config.mode) == (Mode.PROD, Mode.OFF)
    assert after.outcome == "off"
    new = controller.inject(before, view().body).body
    assert new["use_speculative_decoding"] is True  # the in-flight request keeps its snapshot


def test_in_flight_responses_are_judged_by_their_own_config():
    controller = AceController(config(gate=FAST_GATE))
    decisions = [controller.decide(view()) for _ in range(3)]
    controller.update(config(gate={**FAST_GATE, "min_samples": 100}))
    for decision in decisions:
        respond(controller, decision, alpha=0.1)
    assert controller.decide(view()).reason == "breaker_open"


def test_update_rejects_anything_but_an_ace_config():
    with pytest.raises(TypeError):
        AceController(config()).update({"mode": "prod"})


def test_a_decision_uses_one_config_even_when_it_is_swapped_mid_decision():
    """Deterministic: the request swaps the controller's config (to a new one each time) whenever
    the controller reads any of its fields, i.e. between every two steps of `decide`. A decision
    that read `controller.config` twice would mix two configs. (A thread flipping configs beside
    decide caught such a re-read in only 2 of 20 runs.)"""
    controller = AceController(config())
    swaps = []

    class SwappingView(RequestView):
        def __getattribute__(self, name):
            if name in RequestView.__slots__:  # the fields, the derived ones too
                swaps.append(config(speculative={"num_speculative_tokens": len(swaps) % 32 + 1}))
                controller.update(swaps[-1])
            return super().__getattribute__(name)

    for _ in range(20):
        plain = view()
        request = SwappingView(plain.method, plain.path, plain.headers, plain.body)  # (swaps as it is built)
        before = controller.config
        decision = controller.decide(request)
        assert decision.config is before  # the snapshot taken when decide started
        assert any(decision.directive is directive for directive in before.org.directives.values())
        assert decision.directive.num_speculative_tokens == before.speculative.num_speculative_tokens
    assert len(swaps) > 20 * 5  # the request was read, and the config swapped, many times per decision


# -- fail open --------------------------------------------------------------------------------------------


class BrokenStore(InMemoryStateStore):
    def admit(self, *args, **kwargs):
        raise RuntimeError("store down")


class ForgetfulStore(InMemoryStateStore):
    def record(self, *args, **kwargs):
        raise RuntimeError("store down")


class ExplodingAdapter(VLLMAdapter):
    name = "exploding"

    def inject(self, body, directive):
        raise RuntimeError("boom")


def test_internal_fault_fails_open_with_a_logged_off_decision(caplog):
    controller = AceController(config(), store=BrokenStore())
    with caplog.at_level(logging.ERROR, logger="ace_mw"):
        decision = controller.decide(view())
    assert (decision.outcome, decision.reason, decision.directive.enabled) == ("off", "internal_error", False)
    assert "internal error in decide" in caplog.text


def test_fault_while_recording_acceptance_is_swallowed(caplog):
    controller = AceController(config(), store=ForgetfulStore())
    decision = controller.decide(view())
    with caplog.at_level(logging.ERROR, logger="ace_mw"):
        assert respond(controller, decision, alpha=0.5).alpha == 0.5
    assert "internal error in observe" in caplog.text


@pytest.mark.usefixtures("adapter_registry")
def test_adapter_fault_leaves_the_body_untouched(caplog):
    register_adapter(ExplodingAdapter())
    controller = AceController(config(adapter="exploding"))
    body = view().body
    with caplog.at_level(logging.ERROR, logger="ace_mw"):
        decision = controller.decide(view())
        assert decision.outcome == "applied"
        carried_out, forwarded, injection = controller.inject(decision, body)
    assert (forwarded, injection) == (body, NO_INJECTION)
    # (issue 40) the public path is `begin`'s: what reaches the engine is the client's body, so the
    # decision says "off", as `begin` says it
    assert (carried_out.outcome, carried_out.reason, carried_out.arm) == ("off", "internal_error", "")
    assert controller.begin(view()).decision.reason == "internal_error"
    assert "internal error in inject" in caplog.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    body=st.none() | st.dictionaries(st.sampled_from(["model", "temperature", "stream", "user", "x"]), json_values),
    headers=st.dictionaries(
        st.sampled_from([HEADER, "authorization", "x-api-key", "x-ace-conversation-id"]), st.text(max_size=12)
    ),
    mode=st.sampled_from(["off", "shadow", "prod"]),
)
def test_decide_raises_nothing_but_invalid_override_header(body, headers, mode):
    controller = AceController(config(mode=mode, canary_percent=50))
    request = RequestView("POST", PATH, headers, body, None if body is not None else "not_json")
    try:
        decision = controller.decide(request)
    except InvalidOverrideHeader:
        assert headers[HEADER].strip().lower() not in ("off", "shadow", "prod")
        return
    assert decision.outcome in ("applied", "gated", "shadow", "off")
    assert decision.reason != "internal_error"
    if body is not None:
        new = controller.inject(decision, body).body
        assert isinstance(new, dict)


def test_lone_surrogates_in_key_and_user_do_not_fault():
    request = view({"model": "m", "temperature": 0, "user": "\ud800"}, key="sk-\udc00")
    assert AceController(config()).decide(request).reason == "ok"


def test_begin_with_a_failing_write_is_off_and_frees_the_probe_slot():
    """The breaker is open and the request was admitted as a probe; putting the injected body on
    the request fails: the request goes out untouched, so the decision is off and the slot is free."""
    clock = Clock(0.0)
    controller = AceController(config(gate={**FAST_GATE, "probe_fraction": 1.0}), clock=clock)
    for _ in range(3):
        first = controller.decide(view())
        respond(controller, first, alpha=0.1)
    key = (first.tenant, "m")
    assert controller.store.view(key).state == OPEN and controller.store.view(key).probes == 0
    clock.now += 11  # past the cooldown: half-open, every request a probe

    def write(new_body):
        raise TypeError("cannot encode")

    decision, observer = controller.begin(view(), write)
    assert (decision.outcome, decision.reason, decision.probe, decision.arm) == ("off", "internal_error", False, "")
    assert not decision.directive.enabled and decision.pool == "baseline"
    assert controller.store.view(key).probes == 0
    probe, _ = controller.begin(view(), lambda new_body: None)
    assert (probe.outcome, probe.reason, probe.probe) == ("applied", "probe", True)
    assert controller.store.view(key).probes == 1
