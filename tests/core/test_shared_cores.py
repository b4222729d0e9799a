"""The speed policy on pools that share their cores (`upstream.load_scope = "shared"`,
ace_mw/decide/load.py): a request joins the batch that runs rather than start a second one, and an
idle request opens where the temperature gate's requests would otherwise cut the cores in two."""

from __future__ import annotations

import pytest
from support.clock import Clock
from support.load import NGRAM, POOLS, answer, busy, controller, idle, row, teach, tenant, view

from ace_mw import AceConfig, AceController, RequestView


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


@pytest.mark.parametrize(("plain", "expected"), [(25.0, ("plain", "joined")), (15.0, (NGRAM, "ok"))])
def test_a_request_joins_a_busy_pool_unless_a_second_batch_pays_for_every_request_it_slows(plain, expected):
    """Splitting the cores halves the step rate of both batches: the request's own on the best
    arm, and that of the k requests in the busy one. With two in flight, joining plain decoding at
    25 tok/s beats prompt lookup's 70 halved (35) less what the two lose (25 each, halved);
    plain at 15, under 1 / (2 + 2) of prompt lookup's speed, does not. (Counting the request's
    own speed alone, as before, sent it to prompt lookup at 25 tok/s: on real vLLM pools, one or
    two such requests in a burst of four cost it 18-36 % against the plain pool.)"""
    ace = controller(load_scope="shared")
    rates = {"plain": plain, NGRAM: 70.0}  # at two in flight
    teach(ace, "baseline", ((0, {"plain": 100.0, NGRAM: 150.0}), (2, rates)))  # these join plain
    teach(ace, ("baseline", "ngram"), ((1, rates),))
    busy(ace, "baseline", 2)
    decision = ace.decide(view(101))
    assert (decision.arm, decision.reason) == expected


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


def test_a_lone_clients_next_requests_are_priced_by_follow_ups_not_by_the_bursts_before():
    """(issue 39) After bursts of mixed traffic the cut share is high, and a request that opens
    the idle cores runs where the hot requests go. A lone client that sends its next request as
    soon as its answer arrives cuts into nothing, however many bursts came before: its follow-ups
    are priced by the share of such openings (`follow_share`), and its first request alone by the
    bursts'. Its clean follow-ups leave the bursts' share standing, so a burst that comes after a
    pause still opens where the hot requests run (on real vLLM pools, a lone client's three requests after
    bursts ran 0.85-0.92x of prompt lookup's pool, and the bursts of two after it opened on prompt
    lookup, 0.80-0.92x)."""
    clock = Clock(100.0)
    ace = controller(load_scope="shared", clock=clock)
    teach(ace, ("baseline", "ngram"), ((0, {"plain": 100.0, NGRAM: 130.0}), (1, {"plain": 90.0, NGRAM: 100.0})))
    hot = RequestView(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 1.0}
    )
    for i in range(4):  # bursts after pauses, each cut in by a hot request
        clock.now += 5.0
        opener, pinned = ace.decide(view(400 + i)), ace.decide(hot)
        clock.now += 1.0
        answer(ace, opener, 100.0), answer(ace, pinned, 100.0)
    assert ace._in_flight.cut_share > 0.9
    places = []
    clock.now += 5.0
    for i in range(4):  # a lone client: each request sent 5 ms after the answer before it
        decision = ace.decide(view(410 + i))
        places.append((decision.arm, decision.reason))
        clock.now += 0.6
        answer(ace, decision, 100.0 if decision.arm == "plain" else 130.0)
        clock.now += 0.005
    assert places == [("plain", "joined")] + [(NGRAM, "ok")] * 3
    load = ace.status()["load"]
    assert load["follow_share"] == 0.0 and load["cut_share"] > 0.4
    clock.now += 5.0
    burst = ace.decide(view(420))
    assert (burst.arm, burst.reason) == ("plain", "joined")


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
