"""The speed policy at load (ace_mw/decide/load.py): bands of requests in flight per pool, the arms
labelled at their pools' bands, samples recorded at the band they ran in, and a request placed by
the arms' speeds at the load now."""

from __future__ import annotations

import json

import pytest
from support.clock import Clock

from ace_mw import AceConfig, AceController, RequestView
from ace_mw.decide.load import BANDS, InFlight, Peaks, at_load, band, base_arm

POOLS = {"baseline": "http://b", "ngram": "http://n"}
NGRAM = "ngram/k4@ngram"


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


def answer(controller: AceController, decision, rate: float, acceptance: float | None = None) -> None:
    """A non-streaming vLLM answer of 33 tokens decoded at `rate` tokens/s (with its drafts'
    `acceptance`, where it drafted)."""
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    body = {"usage": {"completion_tokens": 33}, "metrics": {"generation_time_ms": 32 / rate * 1000}}
    if acceptance is not None:
        drafted = 40
        body["metrics"]["speculative_decoding"] = {
            "num_draft_tokens": drafted,
            "num_accepted_tokens": round(drafted * acceptance),
            "num_spec_steps": 10,
            "draft_acceptance_rate": round(drafted * acceptance) / drafted,
        }
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


def teach(ace: AceController, pools: str | tuple[str, ...], phases) -> None:
    """For each (others, rates): with `others` requests in flight on each of `pools`, 16 requests
    answered at their arm's rate, through the real path (decide, observe)."""
    pools = (pools,) if isinstance(pools, str) else pools
    for others, rates in phases:
        held = {pool: busy(ace, pool, others) for pool in pools}
        for i in range(16):
            decision = ace.decide(view(i))
            answer(ace, decision, rates[decision.arm])
        for pool, tokens in held.items():
            idle(ace, pool, tokens)


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


def test_on_shared_cores_a_request_joins_a_busy_pool_rather_than_start_a_second_batch():
    """(issue 39) Pools on one core each step their own batch: a request sent to an idle pool
    while another pool runs halves that pool's step rate. So with the others on the baseline
    pool, a request joins it (reason `joined`, a speed sample of plain at that load) though
    prompt lookup is faster at that load; alone, or with the others on both pools, the faster arm
    runs it. Pools on hardware of their own (`load_scope = "pool"`) never join."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 150.0}), (1, {"plain": 50.0, NGRAM: 70.0})))
    alone = ace.decide(view(100))
    assert alone.arm == NGRAM
    answer(ace, alone, 150.0)
    busy(ace, "baseline", 2)
    joined = ace.decide(view(101))
    assert (joined.arm, joined.arm_at_load, joined.reason, joined.outcome) == (
        "plain",
        "plain|load 2-3",
        "joined",
        "gated",
    )
    assert joined.learns_speed
    own = controller(load_scope="pool")
    teach(own, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 150.0}),))
    busy(own, "baseline", 2)
    assert own.decide(view(101)).arm == NGRAM


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


def test_a_request_does_not_join_a_busy_pool_at_under_half_the_best_arms_speed():
    """Splitting the cores halves the step rate of both batches; joining a pool estimated at under
    half the best arm's speed at that load costs more, so the request goes to the best arm."""
    ace = controller(load_scope="shared")
    rates = {"plain": 30.0, NGRAM: 70.0}  # at two in flight
    teach(ace, "baseline", ((0, {"plain": 100.0, NGRAM: 150.0}), (2, rates)))  # these join plain
    teach(ace, ("baseline", "ngram"), ((1, rates),))
    busy(ace, "baseline", 2)
    decision = ace.decide(view(101))
    assert (decision.arm, decision.reason) == (NGRAM, "ok")


def test_a_request_does_not_join_a_pool_that_only_serves_an_exploration():
    """An exploration (or a breaker probe) tries an arm on the side; had the requests after it
    joined its pool, one exploring request at the start of a burst would have sent the whole
    burst to a slow arm (as EAGLE-3 took five of six requests at two clients on real vLLM pools)."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 150.0}), (1, {"plain": 50.0, NGRAM: 70.0})))
    side = object()
    ace._in_flight.start("baseline", side, leads=False)  # plain explored on the side
    ace._in_flight.start("baseline", object(), leads=False)
    decision = ace.decide(view(101))
    assert (decision.arm, decision.reason) == (NGRAM, "ok")  # the best arm, as if nothing were busy
    ace._in_flight.end("baseline", side)
    assert ace._in_flight.count("baseline") == 1


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


EAGLE = "eagle_3/k4@eagle3"


def tripped(candidates: list[dict]) -> AceController:
    """Pools on shared cores, EAGLE-3 taught the fastest arm alone, then its acceptance collapsed:
    the breaker is open and would probe EAGLE-3 with every request (probe_fraction 1)."""
    gate = {"speed_min_samples": 2, "explore_fraction": 0.0, "max_measured_per_s": 1000, "probe_fraction": 1.0}
    config = {
        "mode": "prod",
        "adapter": "vllm",
        "pools": {**POOLS, "eagle3": "http://e"},
        "candidates": candidates,
        "gate": gate,
        "upstream": {"load_scope": "shared"},
    }
    ace = AceController(AceConfig.from_dict(config), clock=Clock(100.0))
    rates = {"plain": 100.0, NGRAM: 150.0, EAGLE: 200.0}
    for i in range(40):
        decision = ace.decide(view(i))
        answer(ace, decision, rates[decision.arm], None if decision.arm == "plain" else 0.6)
    for _ in range(8):
        ace.store.record((tenant(), "m"), 0.1, probe=False, gate=ace.config.gate, now=100.0)
    assert row(ace)["breaker"]["state"] == "open"
    return ace


@pytest.mark.parametrize("with_ngram", [False, True], ids=["eagle3", "ngram+eagle3"])
def test_on_shared_cores_a_breaker_probe_waits_for_the_pools_to_idle(with_ngram):
    """(issue 39) A probe tries an arm on the side, as an exploration does: sent to EAGLE-3's idle
    pool while the plain pool runs a batch, it would start a second batch on the shared core and
    slow every request in flight (on real vLLM pools, three of adaptive's 180 requests under
    bursts were probes). So while another pool is busy the request joins it, holding no probe slot (and with
    prompt lookup allowed by the breaker, it still joins plain rather than start prompt lookup's
    batch); once the pools are idle, the probe goes."""
    eagle = {"algorithm": "eagle_3", "num_speculative_tokens": 4, "pool": "eagle3"}
    ngram = {"algorithm": "ngram", "num_speculative_tokens": 4, "pool": "ngram"}
    ace = tripped([ngram, eagle] if with_ngram else [eagle])
    held = busy(ace, "baseline", 2)
    loaded = ace.decide(view(500))
    assert (loaded.arm, loaded.reason, loaded.probe, loaded.pool) == ("plain", "breaker_open", False, "baseline")
    assert row(ace)["breaker"]["probes_in_flight"] == 0
    idle(ace, "baseline", held)
    answer(ace, loaded, 100.0)
    alone = ace.decide(view(501))
    assert (alone.arm, alone.reason, alone.probe, alone.pool) == (EAGLE, "probe", True, "eagle3")
    assert row(ace)["breaker"]["probes_in_flight"] == 1


def test_at_idle_a_probe_waits_where_pinned_requests_keep_cutting_in():
    """(issue 39) A probe that opens the idle shared cores and a hot request cut in two start a
    second batch beside it, as any opener would (on real vLLM pools, a draft-model probe opened a
    burst of eight and the plain pool's batch ran beside it). Where pinned requests keep cutting
    in, the request opens on their pool instead, holding no probe slot (prompt lookup, which the
    breaker allows, is not worth the cut either); where they come less often, the probe goes."""
    eagle = {"algorithm": "eagle_3", "num_speculative_tokens": 4, "pool": "eagle3"}
    ngram = {"algorithm": "ngram", "num_speculative_tokens": 4, "pool": "ngram"}
    ace = tripped([ngram, eagle])
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    opener = ace.decide(view(600))
    assert (opener.arm, opener.reason, opener.probe) == (EAGLE, "probe", True)
    cut = ace.decide(hot)
    answer(ace, cut, 100.0), answer(ace, opener, 100.0, 0.6)
    assert ace._in_flight.cut_share == pytest.approx(0.5)
    held = ace.decide(view(601))
    assert (held.arm, held.reason, held.probe, held.pool) == ("plain", "breaker_open", False, "baseline")
    assert row(ace)["breaker"]["probes_in_flight"] == 0
    answer(ace, held, 100.0)  # nothing cut in: the share halves
    assert ace._in_flight.cut_share == pytest.approx(0.25)
    again = ace.decide(view(602))
    assert (again.arm, again.reason, again.probe) == (EAGLE, "probe", True)


def test_on_shared_cores_a_request_joins_the_batch_the_temperature_gate_pins():
    """(issue 39) A request at temperature 1.0 is held to plain decoding and cannot join prompt
    lookup's batch (a sampled request in it changes the greedy answers beside it on vLLM 0.32,
    docs/adapters.md). While it runs on the plain pool, a greedy request joins it there though
    prompt lookup's pool is busy too: that batch runs as long as hot requests come, and prompt
    lookup's drains, one batch on the shared core instead of two. Once it ends, prompt lookup's
    batch is the one to join again."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 150.0}), (1, {"plain": 50.0, NGRAM: 70.0})))
    hot = {"model": "m", "temperature": 1.0, "user": "hot"}
    held = busy(ace, "ngram", 3)
    before = ace.decide(view(300))
    assert (before.arm, before.pool) == (NGRAM, "ngram")  # the busy pool serves the best arm
    pinned = ace.decide(RequestView("POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, hot))
    assert (pinned.outcome, pinned.reason, pinned.pool) == ("gated", "temperature", "baseline")
    joined = ace.decide(view(301))
    assert (joined.arm, joined.reason, joined.pool) == ("plain", "joined", "baseline")
    answer(ace, pinned, 100.0)
    after = ace.decide(view(302))
    assert (after.arm, after.pool) == (NGRAM, "ngram")
    for decision in (before, joined, after):
        answer(ace, decision, 100.0)
    idle(ace, "ngram", held)


def test_on_shared_cores_an_idle_request_opens_where_pinned_requests_keep_cutting_in():
    """(issue 39) A burst of mixed traffic opens on prompt lookup's pool, faster alone, and its
    first hot request, held to plain decoding, starts a second batch beside it: both run at half
    their step rate (on real vLLM pools, five of eight bursts of 4 and 8 clients, each 7-30 %
    slower than the plain pool's). Where pinned requests keep coming while the cores' opener
    runs, an idle request opens on their pool once prompt lookup's gain no longer pays for the
    chance of that cut (reason `joined`); where they stop coming, prompt lookup opens again."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 130.0}), (1, {"plain": 90.0, NGRAM: 100.0})))
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    opener = ace.decide(view(400))
    assert (opener.arm, opener.reason, opener.pool) == (NGRAM, "ok", "ngram")
    cut = ace.decide(hot)  # a hot request while it runs: a second batch on the plain pool
    assert (cut.reason, cut.pool) == ("temperature", "baseline")
    answer(ace, opener, 130.0), answer(ace, cut, 100.0)
    assert ace._in_flight.cut_share == pytest.approx(0.5)
    places = []
    for i in range(6):  # each opening cut in by a hot request, wherever it runs
        decision = ace.decide(view(401 + i))
        places.append((decision.arm, decision.reason, decision.pool))
        pinned = ace.decide(hot)
        answer(ace, decision, 100.0), answer(ace, pinned, 100.0)
    assert places == [("plain", "joined", "baseline")] * 6
    alone = []
    for i in range(6):  # then lone requests: none cut in
        decision = ace.decide(view(410 + i))
        alone.append(decision.arm)
        answer(ace, decision, 100.0 if decision.arm == "plain" else 130.0)
    assert alone[0] == "plain" and alone[-1] == NGRAM
    load = ace.status()["load"]
    assert load["cut_share"] < 0.1 and load["in_flight"] == {"baseline": 0, "ngram": 0}


def test_a_hot_request_that_cuts_the_batch_after_its_opener_left_counts_as_a_cut():
    """(issue 39) A burst of two on real vLLM pools: the opener and a greedy request that joined it
    start together on prompt lookup, the opener ends, and the other client's hot request, sent
    right after, starts plain's batch beside the one still running. The cores were cut in two as
    surely as if the opener were still there: a cut of the time they were busy, not of the opener."""
    ace = controller(load_scope="shared")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 130.0}), (1, {"plain": 90.0, NGRAM: 100.0})))
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    opener, joined = ace.decide(view(700)), ace.decide(view(701))
    assert (opener.pool, joined.pool) == ("ngram", "ngram")
    answer(ace, opener, 130.0)
    assert ace._in_flight.cut_share == 0.0  # the cores are still busy: nothing to say yet
    cut = ace.decide(hot)
    assert cut.pool == "baseline"
    answer(ace, joined, 100.0), answer(ace, cut, 100.0)
    assert ace._in_flight.cut_share == pytest.approx(0.5)
    after = ace.decide(view(702))
    assert (after.arm, after.reason, after.pool) == ("plain", "joined", "baseline")


def test_a_pool_on_its_own_hardware_never_opens_for_the_pinned_requests():
    """With `load_scope = "pool"` pinned requests cut into nothing: an idle request runs its best arm."""
    ace = controller(load_scope="pool")
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 130.0}),))
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    for i in range(4):
        decision = ace.decide(view(400 + i))
        assert decision.arm == NGRAM
        pinned = ace.decide(hot)
        answer(ace, decision, 130.0), answer(ace, pinned, 100.0)


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
