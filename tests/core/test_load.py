"""The speed policy at load (ace_mw/decide/load.py): bands of requests in flight per pool, the arms
labelled at their pools' bands, samples recorded at the band they ran in, and a request placed by
the arms' speeds at the load now."""

from __future__ import annotations

import pytest
from support.clock import Clock
from support.load import NGRAM, POOLS, VIEW, answer, busy, controller, idle, row, teach, tenant, view

from ace_mw import AceConfig, AceController, RequestView
from ace_mw.decide.load import BANDS, InFlight, Peaks, at_load, band, base_arm


def test_bands_double_in_width():
    assert [band(n) for n in (0, 1, 2, 3, 4, 7, 8, 100)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert [BANDS[band(n)] for n in (0, 1, 3, 5, 9)] == ["0", "1", "2-3", "4-7", "8+"]


def test_labels_at_load_keep_an_idle_arms_label_and_their_identity():
    # arms no other test labels: `at_load` caches by value, and returns the first tuple it was given
    ngram = f"{NGRAM}-labels-test"
    arms = ("plain", ngram)
    assert at_load(arms, (0, 0)) is arms
    busy = at_load(arms, (0, 2))
    assert busy == ("plain", f"{ngram}|load 2-3") and at_load(arms, (0, 2)) is busy
    assert base_arm(busy[1]) == (ngram, "2-3") and base_arm("plain") == ("plain", "0")


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


def test_pools_on_shared_cores_share_one_load():
    """With load_scope "shared" every arm is at the band of all the pools' requests together."""
    flight = InFlight(Clock(0.0))
    for token in range(3):
        flight.start("ngram", token)
    flight.start("baseline", "b")
    assert flight.bands(("baseline", "ngram"), "pool") == (1, 2)
    assert flight.bands(("baseline", "ngram"), "shared") == (3, 3)


def test_a_candidate_at_a_load_is_compared_with_plain_at_that_load():
    """Pools on shared cores: with two others in flight (one on each pool) every arm is slower.
    Prompt lookup at that load (70 tok/s) beats plain at that load (50), though not plain alone
    (100): it is chosen."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 90.0}), (1, {"plain": 50.0, NGRAM: 70.0})))
    assert ace.decide(view(100)).arm == "plain"  # alone: plain is faster
    busy(ace, "baseline", 1), busy(ace, "ngram", 1)
    crowded = ace.decide(view(101))
    assert (crowded.arm, crowded.arm_at_load, crowded.reason) == (NGRAM, f"{NGRAM}|load 2-3", "ok")
    priors = {p["arm"]: p for p in ace.status()["priors"]}
    assert "plain|load 2-3" not in priors  # plain is what priors are ratios to, at every load


def test_prompt_lookup_is_judged_by_its_speed_not_held_back_by_the_breaker():
    """(issue 39) On real vLLM pools prompt lookup accepts about 0.45 of its drafts while decoding
    1.2-1.5x faster than plain: the breaker (alpha_floor 0.55) tripped on it and ran plain on 21
    of 48 requests. Under the speed policy its acceptance does not feed the breaker; a model
    drafter's collapse still trips it, and then holds back that drafter, not prompt lookup."""
    candidates = [
        {"algorithm": "ngram", "num_speculative_tokens": 4, "pool": "ngram"},
        {"algorithm": "eagle_3", "num_speculative_tokens": 4, "pool": "eagle3"},
    ]
    gate = {"speed_min_samples": 2, "explore_fraction": 0.0, "max_measured_per_s": 1000, "min_samples": 4}
    pools = {**POOLS, "eagle3": "http://e"}
    config = {"mode": "prod", "adapter": "vllm", "pools": pools, "candidates": candidates, "gate": gate}
    ace = AceController(AceConfig.from_dict(config), clock=Clock(100.0))
    eagle = "eagle_3/k4@eagle3"
    rates = {"plain": 100.0, NGRAM: 140.0, eagle: 60.0}
    acceptance = {NGRAM: 0.45, eagle: 0.1}
    seen = []
    for i in range(40):
        decision = ace.decide(view(i))
        seen.append((decision.arm, decision.reason))
        answer(ace, decision, rates[decision.arm], acceptance.get(decision.arm))
    on_ngram = [reason for arm, reason in seen[20:] if arm == NGRAM]
    assert len(on_ngram) >= 18  # prompt lookup, the fastest, runs on its own acceptance of 0.45
    breaker = row(ace)["breaker"]
    assert breaker["trips"] == 0 or all(reason != "breaker_open" for _, reason in seen[20:])
    # EAGLE-3's collapse, taught directly (as its own traffic would): the breaker trips and holds
    # EAGLE-3 back, while prompt lookup, not judged by it, keeps running where it is fastest
    tenant_key = (tenant(), "m")
    for _ in range(8):
        ace.store.record(tenant_key, 0.1, probe=False, gate=ace.config.gate, now=100.0)
    assert row(ace)["breaker"]["state"] == "open"
    after = [ace.decide(view(100 + i)) for i in range(20)]
    assert all(d.arm != eagle or d.reason == "probe" for d in after)
    assert sum(d.arm == NGRAM for d in after) >= 15


def test_a_request_decided_alone_that_a_burst_joins_teaches_the_loaded_estimate():
    """A request decided with nothing in flight, then joined by a burst, ran loaded: its sample
    goes under its arm at the load it ended with, not under the idle estimate (on real vLLM pools
    the first request of each warm-up burst had taught a tenant that prompt lookup runs at 0.7x
    plain alone, and it ran plain for the rest of the run)."""
    ace = controller()
    first = ace.decide(VIEW)
    assert first.arm_at_load == first.arm  # decided alone
    others = busy(ace, first.pool, 3)
    answer(ace, first, 40.0)
    arms = {a["arm"]: a for a in row(ace)["arms"]}
    assert f"{first.arm}|load 2-3" in arms and arms[f"{first.arm}|load 2-3"]["tokens_per_s"] == pytest.approx(40.0)
    assert first.arm not in arms or arms[first.arm]["tokens_per_s"] is None
    idle(ace, first.pool, others)
    alone = ace.decide(VIEW)
    answer(ace, alone, 100.0)  # and one that stays alone teaches the idle estimate
    arms = {a["arm"]: a for a in row(ace)["arms"]}
    assert arms[alone.arm_at_load]["tokens_per_s"] == pytest.approx(100.0) and alone.arm_at_load == alone.arm


def test_a_request_cut_in_two_by_one_that_left_before_it_teaches_the_loaded_estimate():
    """A request decided alone, beside which a hot request ran and ended first, ran loaded for
    part of its life: its sample goes under the most others it had beside it, not under the idle
    estimate (on real vLLM pools such samples had taught a tenant that prompt lookup runs at 0.7x
    plain alone, and it ran plain and the draft model at one client, 0.84x its best pool)."""
    ace = controller(load_scope="shared")
    first = ace.decide(view(600))
    assert first.arm_at_load == first.arm  # decided alone
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    answer(ace, ace.decide(hot), 100.0)  # came and went while `first` ran
    answer(ace, first, 40.0)
    arms = {a["arm"]: a for a in row(ace)["arms"]}
    assert arms[f"{first.arm}|load 1"]["tokens_per_s"] == pytest.approx(40.0)
    assert first.arm not in arms or arms[first.arm]["tokens_per_s"] is None


def test_peaks_hold_the_most_in_flight_since_each_start():
    peaks = Peaks()
    counts = [1, 2, 3, 2, 1, 2, 1]  # after starts 1..7
    for number, count in enumerate(counts, start=1):
        peaks.rise(number, count)
    assert [peaks.since(n) for n in range(1, 9)] == [3, 3, 3, 2, 2, 2, 1, 0]
    assert len(peaks.counts) <= max(counts)
