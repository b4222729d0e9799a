"""The speed policy at load (ace_mw/decide/load.py): bands of requests in flight per pool, the arms
labelled at their pools' bands, samples recorded at the band they ran in, and a request placed by
the arms' speeds at the load now."""

from __future__ import annotations

import json

import pytest
from support.clock import Clock

from ace_mw import AceConfig, AceController, RequestView
from ace_mw.decide.load import BANDS, InFlight, at_load, band, base_arm

POOLS = {"baseline": "http://b", "ngram": "http://n"}
NGRAM = "ngram/k4@ngram"


def test_bands_double_in_width():
    assert [band(n) for n in (0, 1, 2, 3, 4, 7, 8, 100)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert [BANDS[band(n)] for n in (0, 1, 3, 5, 9)] == ["0", "1", "2-3", "4-7", "8+"]


def test_labels_at_load_keep_an_idle_arms_label_and_their_identity():
    arms = ("plain", NGRAM)
    assert at_load(arms, (0, 0)) is arms
    busy = at_load(arms, (0, 2))
    assert busy == ("plain", f"{NGRAM}|load 2-3") and at_load(arms, (0, 2)) is busy
    assert base_arm(busy[1]) == (NGRAM, "2-3") and base_arm("plain") == ("plain", "0")


def test_in_flight_counts_per_pool_and_forgets_a_lost_request():
    clock = Clock(0.0)
    flight = InFlight(clock)
    first, second = object(), object()
    flight.start("ngram", first)
    flight.start("ngram", second)
    assert flight.count("ngram") == 2 and flight.bands(("baseline", "ngram")) == (0, 2)
    flight.end("ngram", first)
    flight.end("ngram", first)  # twice is once
    assert flight.count("ngram") == 1
    clock.now += 10_000  # `second` never ended: presumed lost once a newer request arrives
    flight.start("ngram", object())
    assert flight.count("ngram") == 1


def controller(load_aware: bool = True, load_scope: str = "pool") -> AceController:
    candidates = [{"algorithm": "ngram", "num_speculative_tokens": 4, "pool": "ngram"}]
    gate = {"speed_min_samples": 2, "explore_fraction": 0.0, "max_measured_per_s": 1000}
    config = {
        "mode": "prod",
        "adapter": "vllm",
        "pools": POOLS,
        "candidates": candidates,
        "gate": gate,
        "upstream": {"load_aware": load_aware, "load_scope": load_scope},
    }
    return AceController(AceConfig.from_dict(config), clock=Clock(100.0))


VIEW = RequestView(
    "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 0, "user": "u"}
)


def view(i: int) -> RequestView:
    """A request of conversation `i`: its sticky bucket (exploration's draw) is fixed by it."""
    body = {"model": "m", "temperature": 0, "user": f"conversation-{i}"}
    return RequestView("POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, body)


def answer(controller: AceController, decision, rate: float) -> None:
    """A non-streaming vLLM answer of 33 tokens decoded at `rate` tokens/s."""
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    body = {"usage": {"completion_tokens": 33}, "metrics": {"generation_time_ms": 32 / rate * 1000}}
    observer.feed(json.dumps(body).encode(), more_body=False)
    observer.finish()


def busy(ace: AceController, pool: str, requests: int) -> list[object]:
    """`requests` other requests in flight on `pool` (as if decided and not yet answered)."""
    tokens = [object() for _ in range(requests)]
    for token in tokens:
        ace._in_flight.start(pool, token)
    return tokens


def idle(ace: AceController, pool: str, tokens: list[object]) -> None:
    for token in tokens:
        ace._in_flight.end(pool, token)


def teach(ace: AceController, pool: str, phases) -> None:
    """For each (others, rates): with `others` requests in flight on `pool`, 16 requests answered
    at their arm's rate, through the real path (decide, observe)."""
    for others, rates in phases:
        held = busy(ace, pool, others)
        for i in range(16):
            decision = ace.decide(view(i))
            answer(ace, decision, rates[decision.arm])
        idle(ace, pool, held)


def test_samples_are_kept_per_arm_and_load_and_the_choice_follows_the_load():
    """Prompt lookup beats plain for a lone request and loses to it with two others in flight on
    its pool: taught both through the real path, the policy runs it alone and runs plain when its
    pool is busy, and the status page shows both estimates."""
    ace = controller()
    teach(ace, "ngram", ((0, {"plain": 100.0, NGRAM: 150.0}), (2, {"plain": 100.0, NGRAM: 60.0})))
    arms = {a["arm"]: a for a in row(ace)["arms"]}
    assert arms[NGRAM]["tokens_per_s"] == pytest.approx(150.0)
    loaded = arms[f"{NGRAM}|load 2-3"]
    assert loaded["tokens_per_s"] == pytest.approx(60.0) and loaded["load"] == "2-3" and loaded["current"]
    alone = ace.decide(VIEW)
    assert (alone.arm, alone.arm_at_load, alone.reason) == (NGRAM, NGRAM, "ok")
    answer(ace, alone, 150.0)
    held = busy(ace, "ngram", 2)
    crowded = ace.decide(VIEW)
    assert (crowded.arm, crowded.reason) == ("plain", "slower")
    answer(ace, crowded, 100.0)
    idle(ace, "ngram", held)


def test_a_decided_request_counts_on_its_pool_until_its_answer_ends():
    ace = controller()
    decision = ace.decide(VIEW)
    assert ace._in_flight.count(decision.pool) == 1
    answer(ace, decision, 100.0)
    assert ace._in_flight.count(decision.pool) == 0


def test_without_load_awareness_one_estimate_per_arm():
    ace = controller(load_aware=False)
    held = busy(ace, "ngram", 3)
    decision = ace.decide(VIEW)
    assert decision.arm_at_load == decision.arm and "|load" not in decision.arm_at_load
    idle(ace, "ngram", held)


def tenant() -> str:
    from ace_mw import hash_key

    return hash_key("sk-load")[len("sha256:") :][:16]


def row(ace: AceController) -> dict:
    return next(t for t in ace.status()["tenants"] if t["tenant"] == tenant())


def test_pools_on_shared_cores_share_one_load():
    """With load_scope "shared" every arm is at the band of all the pools' requests together."""
    flight = InFlight(Clock(0.0))
    for token in range(3):
        flight.start("ngram", token)
    flight.start("baseline", "b")
    assert flight.bands(("baseline", "ngram"), "pool") == (1, 2)
    assert flight.bands(("baseline", "ngram"), "shared") == (3, 3)


def test_a_candidate_at_a_load_is_compared_with_plain_at_that_load():
    """Pools on shared cores: with two others in flight every arm is slower. Prompt lookup at that
    load (70 tok/s) beats plain at that load (50), though not plain alone (100): it is chosen."""
    ace = controller(load_scope="shared")
    teach(ace, "baseline", ((0, {"plain": 100.0, NGRAM: 90.0}), (2, {"plain": 50.0, NGRAM: 70.0})))
    assert ace.decide(view(100)).arm == "plain"  # alone: plain is faster
    held = busy(ace, "baseline", 2)
    crowded = ace.decide(view(101))
    assert (crowded.arm, crowded.arm_at_load, crowded.reason) == (NGRAM, f"{NGRAM}|load 2-3", "ok")
    idle(ace, "baseline", held)
    priors = {p["arm"]: p for p in ace.status()["priors"]}
    assert "plain|load 2-3" not in priors  # plain is what priors are ratios to, at every load
