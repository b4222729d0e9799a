"""The speed policy through the controller: each arm's speed learned from streamed responses,
what teaches nothing (shadow, hot, aborted), each temperature band on its own arm, and breaker
probes that correct a stale estimate. An injected clock; the black-box loop through AceSpecDec is
in test_asgi_speed_loop.py."""

import json
import math

import pytest
from support.clock import Clock
from support.speed import GATE, sample

from ace_mw import AceConfig, AceController, InMemoryStateStore, RequestView

# -- through the controller ---------------------------------------------------------------------


def decide(controller, conversation, temperature=0.0):
    body = {"model": "m", "temperature": temperature, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"authorization": "Bearer sk-a", "x-ace-conversation-id": conversation}
    return controller.decide(RequestView("POST", "/v1/chat/completions", headers, body))


def stream_through(controller, decision, clock, seconds, tokens=21, decode_time=None):
    """One streamed response: `tokens` one-token chunks over `seconds`, then the usage chunk."""
    observer = controller.observe(decision)
    observer.start(200, "text/event-stream")
    for i in range(tokens):
        clock.now += seconds / (tokens - 1) if i else 0.0
        event = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
        observer.feed(b"data: " + json.dumps(event).encode() + b"\n\n")
    stats = {"num_draft_tokens": 10, "num_accepted_draft_tokens": 9, "num_spec_steps": 5}
    if decode_time is not None:
        stats["decode_time_s"] = decode_time
    usage = {"choices": [], "usage": {"completion_tokens": tokens}, "metrics": {"speculative_decoding": stats}}
    observer.feed(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n", more_body=False)
    observer.finish()


def test_controller_learns_each_arms_speed_and_moves_a_slow_tenant_to_plain():
    clock = Clock(0.0)
    controller = AceController(AceConfig.from_dict({"mode": "prod"}), clock=clock)
    seconds = {"plain": 1.0, "eagle_2/k5": 2.0}  # speculation is twice as slow here
    decisions = []
    for i in range(60):
        decision = decide(controller, f"c{i}")
        stream_through(controller, decision, clock, seconds[decision.arm])
        decisions.append(decision)
    assert decisions[0].outcome == "applied" and decisions[0].reason == "ok"
    late = decisions[-20:]
    assert sum(d.reason == "slower" and d.outcome == "gated" for d in late) >= 16
    slower = next(d for d in late if d.reason == "slower")
    assert not slower.directive.enabled and slower.directive.measure and slower.arm == "plain"
    assert slower.speedup == pytest.approx(1.0)
    arms = controller.store.arm_views((slower.tenant, "m"), controller.config.gate, clock.now)
    assert arms["plain"].tokens_per_s == pytest.approx(20.0, rel=0.05)
    assert arms["eagle_2/k5"].tokens_per_s == pytest.approx(10.0, rel=0.05)


def test_engine_reported_decode_time_is_preferred_over_the_stream_timing():
    clock = Clock(0.0)
    controller = AceController(AceConfig.from_dict({"mode": "prod"}), clock=clock)
    decision = decide(controller, "c")
    stream_through(controller, decision, clock, seconds=4.0, decode_time=0.5)
    arms = controller.store.arm_views((decision.tenant, "m"), controller.config.gate, clock.now)
    assert arms[decision.arm].tokens_per_s == pytest.approx(20 / 0.5)


@pytest.mark.parametrize(("mode", "temperature"), [("shadow", 0.0), ("prod", 1.0)])
def test_shadow_and_temperature_gated_traffic_teach_no_speed(mode, temperature):
    clock = Clock(0.0)
    controller = AceController(AceConfig.from_dict({"mode": mode}), clock=clock)
    decision = decide(controller, "c", temperature)
    assert not decision.learns_speed
    stream_through(controller, decision, clock, seconds=1.0)
    assert controller.store.arm_views((decision.tenant, "m"), controller.config.gate, clock.now) == {}


def test_aborted_responses_teach_no_speed():
    clock = Clock(0.0)
    controller = AceController(AceConfig.from_dict({"mode": "prod"}), clock=clock)
    decision = decide(controller, "c")
    observer = controller.observe(decision)
    observer.start(200, "text/event-stream")
    for _ in range(5):
        clock.now += 0.1
        observer.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    observer.finish(error="client_disconnect")
    assert controller.store.arm_views((decision.tenant, "m"), controller.config.gate, clock.now) == {}


def test_token_bearing_chunks_are_timed_and_others_are_not():
    clock = Clock(0.0)
    controller = AceController(AceConfig.from_dict({"mode": "prod"}), clock=clock)
    observer = controller.observe(decide(controller, "c"))
    observer.start(200, "text/event-stream")
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    for chunk, at in [(role, 1.0), (b'data: {"choices":[{"delta":{"content": "a"}}]}\n\n', 5.0)]:
        clock.now = at
        observer.feed(chunk)
    clock.now = 6.0
    observer.feed(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n')
    clock.now = 30.0
    observer.feed(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n')
    observer.feed(b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n', more_body=False)
    timing = observer.timing
    assert (timing.first, timing.last, timing.chunks, timing.usage_tokens) == (5.0, 6.0, 2, 2)


def test_snapshot_lists_the_most_recent_tenants_first_with_their_arms():
    store = InMemoryStateStore()
    for i in range(5):
        store.record_speed((f"t{i}", "m"), "plain", sample(100.0 + i), GATE, float(i))
    store.record((("t1", "m")), 0.9, probe=False, gate=GATE, now=5.0)
    views = store.snapshot(GATE, 10.0, limit=3)
    assert [v.key for v in views] == [("t1", "m"), ("t4", "m"), ("t3", "m")]
    assert views[0].breaker.rolling_alpha == pytest.approx(0.9)
    assert views[1].arms["plain"].tokens_per_s == pytest.approx(104.0)
    assert store.health() == {"backend": "memory", "tracked": 5}


# -- temperature bands ----------------------------------------------------------------------------


def serve_by_temperature(controller, clock, seconds, temperatures, start=0):
    """One streamed response per temperature, each arm taking `seconds[(arm, hot)]`."""
    decisions = []
    for i, temperature in enumerate(temperatures, start):
        decision = decide(controller, f"c{i}", temperature)
        stream_through(controller, decision, clock, seconds[decision.arm, temperature > 0.5])
        decisions.append(decision)
    return decisions


# prompt lookup at twice plain's speed on greedy requests, at half of it at T = 0.7
TURNING = {("plain", False): 1.0, ("plain", True): 1.0, ("ngram/k5", False): 0.5, ("ngram/k5", True): 2.0}


def ngram_controller(clock, bands):
    config = {"mode": "prod", "speculative": {"algorithm": "ngram"}, "gate": {"temperature_bands": bands}}
    return AceController(AceConfig.from_dict(config), clock=clock)


def test_each_temperature_band_learns_its_own_fastest_arm():
    """Greedy and hot requests of one tenant, interleaved: with the default band at 0.5 the greedy
    ones settle on prompt lookup and the hot ones on plain; with one state for both, the mix
    decides for both and one of them runs its slower arm."""
    clock = Clock(0.0)
    controller = ngram_controller(clock, [0.5])
    late = serve_by_temperature(controller, clock, TURNING, [0.0, 0.7] * 40)[-40:]
    assert sum(d.arm == "ngram/k5" for d in late if d.temperature == 0.0) >= 18
    assert sum(d.arm == "plain" for d in late if d.temperature == 0.7) >= 18
    assert {d.key for d in late} == {(late[0].tenant, "m"), (late[0].tenant, "m|T>0.5")}
    gate = controller.config.gate
    hot = controller.store.arm_views((late[0].tenant, "m|T>0.5"), gate, clock.now)
    assert hot["ngram/k5"].tokens_per_s < hot["plain"].tokens_per_s

    clock = Clock(0.0)
    one = serve_by_temperature(ngram_controller(clock, []), clock, TURNING, [0.0, 0.7] * 40)[-40:]
    assert {d.key[1] for d in one} == {"m"}
    right = sum(d.arm == ("ngram/k5" if d.temperature == 0.0 else "plain") for d in one)
    assert right <= 24  # about half: one arm for both


def test_a_tenant_that_turns_hot_and_back_is_on_its_bands_arm_at_once():
    """Greedy, then hot, then greedy again (the demo's flaky tenant): once each band is learnt, the
    turn back finds the greedy estimates where they were, and the first greedy requests after it
    speculate again."""
    clock = Clock(0.0)
    controller = ngram_controller(clock, [0.5])
    serve_by_temperature(controller, clock, TURNING, [0.0] * 20)
    hot = serve_by_temperature(controller, clock, TURNING, [0.7] * 20, 20)
    assert sum(d.arm == "plain" for d in hot[-10:]) >= 9
    back = serve_by_temperature(controller, clock, TURNING, [0.0] * 10, 40)
    assert sum(d.arm == "ngram/k5" for d in back[:5]) >= 4


# -- breaker probes ------------------------------------------------------------------------------


def answer(controller, decision, clock, rate, alpha):
    """One non-streamed response of 21 tokens decoded at `rate` tokens/s with acceptance `alpha`."""
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    clock.now += 21 / rate
    stats = {"num_draft_tokens": 40, "num_accepted_draft_tokens": round(40 * alpha), "num_spec_steps": 10}
    body = {"choices": [{"index": 0, "message": {"content": "x"}}], "usage": {"completion_tokens": 21}}
    body["metrics"] = {"speculative_decoding": {**stats, "decode_time_s": 20 / rate}}
    observer.feed(json.dumps(body).encode(), more_body=False)
    observer.finish()


DRAFT, NGRAM = "draft_model/k4/d", "ngram/k4"


def tripped_on_the_draft_model(clock, measured, **gate):
    """A tenant of a controller over the draft model and prompt lookup, its arms taught `measured`
    (per arm, the rates of its samples of 20 tokens, as `answer`'s) at time 0, then the draft
    model's acceptance collapsed: (controller, gate, the tenant's key), its breaker open."""
    candidates = [
        {"algorithm": "draft_model", "num_speculative_tokens": 4, "draft_model": "d"},
        {"algorithm": "ngram", "num_speculative_tokens": 4},
    ]
    config = {
        "mode": "prod",
        "candidates": candidates,
        "gate": {"min_samples": 4, "max_measured_per_s": math.inf, **gate},
    }
    controller = AceController(AceConfig.from_dict(config), clock=clock)
    found, key = controller.config.gate, (decide(controller, "warm").tenant, "m")
    for arm, rates in measured.items():
        for rate in rates:
            controller.store.record_speed(key, arm, sample(rate, tokens=20), found, 0.0)
    for _ in range(4):
        controller.store.record(key, 0.1, probe=False, gate=found, now=0.0)  # its acceptance collapsed
    assert controller.store.view(key).state == "open"
    return controller, found, key


def test_probes_of_an_arm_the_breaker_holds_back_correct_its_stale_estimate():
    """(issue 39, on real vLLM pools) The draft model was measured fast, then its acceptance fell
    and the breaker opened. Under the speed policy a probe runs it only where the plan would, and
    the plan, from the old estimate, still thinks it fastest. The probes' own speed must reach that
    estimate: otherwise nothing else runs the arm, and every probe runs at the draft model's real
    speed, below prompt lookup's, for as long as the breaker stays open."""
    clock = Clock(0.0)
    measured = {arm: (rate,) * 8 for arm, rate in (("plain", 100.0), (DRAFT, 200.0), (NGRAM, 130.0))}
    controller, gate, key = tripped_on_the_draft_model(clock, measured, probe_fraction=1.0, cooldown_s=1.0)
    true_rate = {"plain": 100.0, DRAFT: 90.0, NGRAM: 130.0}
    arms = []
    for i in range(40):
        clock.now += 2.0
        decision = decide(controller, f"c{i}")
        answer(controller, decision, clock, true_rate[decision.arm], 0.1 if decision.arm.startswith("draft") else 0.5)
        arms.append((decision.arm, decision.reason))
    assert arms[0] == ("draft_model/k4/d", "probe")  # the plan, from the old estimate, still chose it
    # The probes' speed reaches the estimate (at the speed half-life's pace, 20 responses here):
    # the plan turns to prompt lookup, and the probes stop.
    assert arms[-10:] == [("ngram/k4", "ok")] * 10
    views = controller.store.arm_views(key, gate, clock.now)
    assert views["draft_model/k4/d"].tokens_per_s < views["ngram/k4"].tokens_per_s


def test_requests_the_breaker_holds_keep_measuring_the_arms_it_allows():
    """(issue 39, on real vLLM pools) Code's breaker tripped on the draft model's acceptance (0.16)
    while prompt lookup's estimate read 86 tok/s on four samples, below plain's 93: it runs about
    110. The requests the breaker held ran plain, the best allowed arm by that estimate, and only
    exploited, so nothing measured prompt lookup again and the tenant ran at 0.90x its best pool.
    Held requests choose among the arms the breaker allows as any request does, exploration
    included: the stale estimate is measured again and the tenant moves to prompt lookup."""
    clock = Clock(0.0)
    measured = {  # per-request speeds vary with the prompt as much as with the arm
        "plain": (80.0, 120.0, 90.0, 110.0, 100.0, 95.0, 105.0, 100.0),
        DRAFT: (110.0, 150.0, 120.0, 140.0, 130.0, 125.0, 135.0, 130.0),
        NGRAM: (70.0, 110.0, 75.0, 89.0),  # 86 on four samples: it runs 120
    }
    controller, gate, key = tripped_on_the_draft_model(
        clock, measured, probe_fraction=0.0, cooldown_s=3600.0, max_cooldown_s=3600.0
    )
    true_rate = {"plain": 100.0, NGRAM: 120.0}
    clock.now = 2 * gate.speed_half_life_s  # the estimates have aged, as a run's warm-up's had
    arms = []
    for i in range(60):
        clock.now += 2.0
        decision = decide(controller, f"c{i}")
        answer(controller, decision, clock, true_rate[decision.arm], 0.5)
        arms.append(decision.arm)
    assert arms[0] == "plain"  # the stale estimate: plain first
    assert arms[-10:].count("ngram/k4") >= 9  # prompt lookup measured again, and chosen
    assert controller.store.view(key).state == "open"  # the breaker held the draft model throughout
