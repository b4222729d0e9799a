"""The speed policy: estimator decay, exploration bounds, stickiness, bounded memory, arms that never
report, garbage timing, and following a flip of the fastest arm. Unit level, with an injected clock;
through the controller in test_speed_loop.py, the black-box loop through AceSpecDec in
test_asgi_speed_loop.py."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.speed import GATE, sample

from ace_mw import GateConfig, InMemoryStateStore
from ace_mw.acceptance import AcceptanceFigures
from ace_mw.decide.samples import SpeedSample, StreamTiming, checked_sample, response_sample
from ace_mw.decide.speed import EXPLORE, OK, PRIOR, SLOWER, ArmEstimate, Prior, choose_arm
from ace_mw.state import TenantState

ARMS = ("plain", "eagle_2/k5", "ngram/k5")
GRID = [(i + 0.5) / 4096 / 4096 for i in range(4096)]  # buckets whose exploration draws cover [0, 1) evenly


def measured(rates: dict[str, float], n: int = 5, now: float = 0.0) -> dict[str, ArmEstimate]:
    arms = {}
    for label, rate in rates.items():
        arms[label] = ArmEstimate()
        for _ in range(n):
            arms[label].add(sample(rate), GATE, now)
    return arms


def share(arms, gate=GATE, now=0.0, labels=ARMS) -> dict[tuple[int, str], float]:
    """How the grid of buckets splits over (arm, reason)."""
    counts: dict[tuple[int, str], float] = {}
    for bucket in GRID:
        choice = choose_arm(arms, labels, gate, now, bucket)
        counts[choice.arm, choice.reason] = counts.get((choice.arm, choice.reason), 0) + 1 / len(GRID)
    return counts


def explored_share(split: dict[tuple[int, str], float]) -> float:
    return sum(v for (_, reason), v in split.items() if reason == EXPLORE)


# -- the estimate -------------------------------------------------------------------------------


def test_estimate_is_aggregate_tokens_per_second():
    arm = ArmEstimate()
    arm.add(SpeedSample(100, 1.0, "engine"), GateConfig(speed_half_life=1e9), 0.0)
    arm.add(SpeedSample(300, 1.0, "engine"), GateConfig(speed_half_life=1e9), 0.0)
    assert arm.rate == pytest.approx(200.0)  # 400 tokens in 2 s, not the mean of rates


def test_estimate_follows_a_change_with_the_sample_half_life():
    arm = ArmEstimate()
    for _ in range(200):
        arm.add(sample(100.0), GATE, 0.0)
    for _ in range(int(GATE.speed_half_life)):
        arm.add(sample(50.0), GATE, 0.0)
    # One half-life of new samples: old and new evidence weigh the same (time sums included).
    old_weight = new_weight = 0.5
    expected = (old_weight * 100 + new_weight * 100) / (old_weight * 1.0 + new_weight * 2.0)
    assert arm.rate == pytest.approx(expected, rel=0.02)


def test_evidence_decays_with_time_and_a_stale_arm_is_explored_again():
    arms = measured({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 120.0}, n=4)
    assert arms["plain"].evidence(GATE, 0.0) == pytest.approx(4 * 0.84, rel=0.2)
    fresh = explored_share(share(arms, now=0.0))
    assert 0 < fresh <= GATE.explore_fraction + 0.002
    # Two half-lives later every estimate rests on a quarter of its samples: the posteriors are
    # wide, so the other arms are explored far more (capped by the unmeasured share), and the
    # best one still gets the rest.
    stale = share(arms, now=2 * GATE.speed_half_life_s)
    assert 4 * fresh < explored_share(stale) <= GATE.explore_fraction_unmeasured + 0.002
    assert stale[1, OK] >= 1 - GATE.explore_fraction_unmeasured - 0.002


def test_old_evidence_weighs_less_than_new_after_a_pause():
    arm = ArmEstimate()
    for _ in range(10):
        arm.add(sample(100.0), GATE, 0.0)
    arm.add(sample(10.0, tokens=100.0), GATE, 10 * GATE.speed_half_life_s)  # ~1000x less old weight
    assert arm.rate < 20.0


# -- choosing -----------------------------------------------------------------------------------


def test_new_tenant_speculates_with_its_first_candidate_and_does_not_explore():
    assert share({}) == {(1, OK): pytest.approx(1.0)}


def test_once_the_default_is_measured_unmeasured_arms_are_explored_more():
    arms = measured({"eagle_2/k5": 150.0})
    split = share(arms)
    assert split[0, EXPLORE] == pytest.approx(GATE.explore_fraction_unmeasured / 2, abs=0.002)
    assert split[2, EXPLORE] == pytest.approx(GATE.explore_fraction_unmeasured / 2, abs=0.002)
    assert split[1, OK] == pytest.approx(1 - GATE.explore_fraction_unmeasured, abs=0.002)


@pytest.mark.parametrize(
    ("rates", "best", "reason"),
    [
        ({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 120.0}, 1, OK),
        ({"plain": 100.0, "eagle_2/k5": 80.0, "ngram/k5": 120.0}, 2, OK),
        ({"plain": 100.0, "eagle_2/k5": 60.0, "ngram/k5": 90.0}, 0, SLOWER),
        ({"plain": 100.0, "eagle_2/k5": 101.0, "ngram/k5": 90.0}, 0, SLOWER),  # within the 2 % margin
    ],
)
def test_the_fastest_arm_gets_all_but_a_bounded_exploration_share(rates, best, reason):
    split = share(measured(rates))
    assert split[best, reason] >= 1 - GATE.explore_fraction - 0.002
    explored = {arm: v for (arm, why), v in split.items() if why == EXPLORE}
    assert set(explored) <= {0, 1, 2} - {best}
    assert sum(explored.values()) <= GATE.explore_fraction + 0.002


def test_exploration_goes_where_the_arm_may_beat_the_best_not_to_clear_losers():
    """Probability matching: a close second is explored, an arm measured at 0.6x of plain barely."""
    gate = dataclasses.replace(GATE, explore_fraction=0.5)
    split = share(measured({"plain": 100.0, "eagle_2/k5": 60.0, "ngram/k5": 99.0}, n=2), gate=gate)
    close, loser = split.get((2, EXPLORE), 0.0), split.get((1, EXPLORE), 0.0)
    assert close > 0.2  # ngram at 0.99x of plain: about as likely to be the faster one
    assert loser < 0.01 and loser < close / 20


def test_exploration_shrinks_as_the_evidence_grows():
    gate = dataclasses.replace(GATE, explore_fraction=0.5, speed_half_life=1e9)
    shares = [
        explored_share(share(measured({"plain": 100.0, "ngram/k5": 90.0}, n=n), gate=gate, labels=ARMS[::2]))
        for n in (3, 10, 40)
    ]
    assert shares[0] > shares[1] > shares[2]


def test_an_arm_whose_speed_swings_is_explored_until_its_difference_is_known():
    """Prompt lookup measured five times on prompts it suits unevenly (55-130 tok/s, 0.89x plain
    on the geometric mean) may yet be the faster arm: it keeps exploring by its upside (about
    P(faster) / 2 here), beyond `explore_fraction`, until its difference from plain is known to
    +-10 %. Measured as often at one steady speed, 0.89x is a loser and takes at most
    `explore_fraction`."""
    gate = dataclasses.replace(GATE, speed_half_life=1e9)
    swinging, steady = measured({"plain": 88.0}, n=17), measured({"plain": 88.0}, n=17)
    swinging["ngram/k5"], steady["ngram/k5"] = ArmEstimate(), ArmEstimate()
    rates = (60.0, 130.0, 55.0, 110.0, 70.0)
    for rate in rates:
        swinging["ngram/k5"].add(sample(rate), gate, 0.0)
        steady["ngram/k5"].add(sample(math.prod(rates) ** (1 / len(rates))), gate, 0.0)
    assert explored_share(share(swinging, gate=gate, labels=ARMS[::2])) > 1.2 * gate.explore_fraction
    assert explored_share(share(steady, gate=gate, labels=ARMS[::2])) <= gate.explore_fraction + 1 / len(GRID)
    for _ in range(60):  # measured at length, its swings average out: a loser again
        for rate in rates:
            swinging["ngram/k5"].add(sample(rate), gate, 0.0)
    assert explored_share(share(swinging, gate=gate, labels=ARMS[::2])) <= gate.explore_fraction + 1 / len(GRID)


def test_a_chosen_arm_short_of_samples_keeps_an_explored_arms_share_under_a_cap_of_one():
    """Priors say plain wins; a tenant with nothing of its own, exploring with a cap of 1, still
    runs plain on a share of its requests, or its candidates would never get a ratio to it."""
    gate = dataclasses.replace(GATE, explore_fraction_unmeasured=1.0)
    priors = {"eagle_2/k5": Prior(math.log(0.9), 0.5, 3, 15.0), "ngram/k5": Prior(math.log(0.95), 0.5, 3, 15.0)}
    counts: dict[tuple[int, str], float] = {}
    for bucket in GRID:
        choice = choose_arm({}, ARMS, gate, 0.0, bucket, priors)
        counts[choice.arm, choice.reason] = counts.get((choice.arm, choice.reason), 0) + 1 / len(GRID)
    explored = [counts[1, EXPLORE], counts[2, EXPLORE]]
    assert counts[0, PRIOR] == pytest.approx(1 - sum(explored), abs=0.002)
    assert counts[0, PRIOR] >= max(explored) - 0.002 and min(explored) > 0.25


@settings(max_examples=20, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1))
def test_exploration_never_exceeds_its_configured_share(explore, unmeasured):
    gate = GateConfig(explore_fraction=explore, explore_fraction_unmeasured=unmeasured, speed_min_samples=3)
    for arms in (measured({"plain": 100.0, "eagle_2/k5": 150.0}), measured({"eagle_2/k5": 150.0})):
        shares = share(arms, gate=gate, labels=ARMS[:2])
        explored = sum(v for (_, reason), v in shares.items() if reason == EXPLORE)
        assert explored <= max(explore, unmeasured) + 1 / len(GRID)


def test_the_same_conversation_gets_the_same_arm_while_nothing_changes():
    arms = measured({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 140.0})  # a near tie: explored
    for bucket in GRID[::97]:
        assert len({choose_arm(arms, ARMS, GATE, 0.0, bucket) for _ in range(5)}) == 1


def test_exploration_is_independent_of_the_canary_split():
    """The canary admits buckets below its percentage; exploration must not favour them."""
    arms = measured({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 145.0})  # a close second: explored
    everywhere = explored_share(share(arms))
    canary = [b for b in (i / 20000 for i in range(20000)) if b < 0.05]  # a 5 % canary's buckets
    explored = sum(choose_arm(arms, ARMS, GATE, 0.0, b).reason == EXPLORE for b in canary) / len(canary)
    assert everywhere == pytest.approx(GATE.explore_fraction, abs=0.005)
    assert explored == pytest.approx(everywhere, abs=0.02)


def test_speedup_is_the_chosen_arm_over_plain():
    arms = measured({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 140.0})  # a near tie: explored
    not_exploring = 0.99 / 4096  # its exploration draw is 0.99
    choice = choose_arm(arms, ARMS, GATE, 0.0, not_exploring)
    assert (choice.arm, choice.speedup) == (1, pytest.approx(1.5))
    assert choose_arm(measured({"eagle_2/k5": 150.0}), ARMS, GATE, 0.0, not_exploring).speedup is None


def test_an_arm_that_never_reports_stops_claiming_extra_exploration():
    arms = measured({"eagle_2/k5": 150.0})
    arms["plain"] = ArmEstimate()
    for _ in range(GATE.speed_max_misses):
        arms["plain"].miss()
    split = share(arms, labels=ARMS[:2])
    assert split[0, EXPLORE] == pytest.approx(GATE.explore_fraction, abs=0.002)


def test_a_default_arm_that_never_reports_still_lets_the_others_be_measured():
    arms = {"eagle_2/k5": ArmEstimate()}
    for _ in range(GATE.speed_max_misses):
        arms["eagle_2/k5"].miss()
    split = share(arms, labels=ARMS[:2])
    assert split[0, EXPLORE] == pytest.approx(GATE.explore_fraction_unmeasured, abs=0.002)


def test_the_choice_follows_a_flip_of_the_fastest_arm_within_a_bounded_number_of_requests():
    """Plain at 100 tok/s and eagle at 150; then eagle drops to 60. Every response feeds the arm
    that served it. The tenant must be back on plain within 30 requests, and back on eagle within
    a bounded number once it recovers (it is only seen through exploration then)."""
    gate = GateConfig(speed_min_samples=3, speed_half_life=4, explore_fraction=0.2)
    tenant, now = TenantState(), 0.0
    speed = {"plain": 100.0, "eagle_2/k5": 150.0}
    labels = ARMS[:2]

    def serve(n: int) -> list[int]:
        nonlocal now
        chosen = []
        for i in range(n):
            now += 1.0
            admission = tenant.admit(labels, gate, now, ((i * 0.6180339887) % 1.0) / 4096)
            tenant.record_speed(labels[admission.arm], sample(speed[labels[admission.arm]]), gate, now)
            chosen.append(admission.arm)
        return chosen

    assert serve(60)[-20:].count(1) >= 14  # settled on eagle (exploring plain 20 %)
    speed["eagle_2/k5"] = 60.0
    after = serve(60)
    first_plain_run = next(i for i in range(len(after)) if after[i : i + 5].count(0) >= 4)
    assert first_plain_run <= 30
    assert after[-20:].count(0) >= 14
    speed["eagle_2/k5"] = 150.0
    recovered = serve(150)
    assert recovered[-20:].count(1) >= 14


# -- samples and garbage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "seconds"),
    [(10, -1.0), (10, 0.0), (10, math.nan), (10, math.inf), (math.nan, 1.0), (0, 1.0), (10**9, 1e-3), (10, 1e9)],
)
def test_unusable_figures_give_no_sample(tokens, seconds):
    assert checked_sample(tokens, seconds, "engine") is None


def test_engine_decode_time_wins_and_counts_tokens_after_the_first():
    figures = AcceptanceFigures(output_tokens=41, decode_seconds=0.5)
    timing = StreamTiming()
    timing.tick(0.0)
    timing.tick(9.0)
    assert response_sample(figures, timing) == (SpeedSample(40, 0.5, "engine"), False)


def test_garbage_engine_time_is_flagged_and_the_stream_timing_used_instead():
    timing = StreamTiming()
    for t in (1.0, 1.5, 2.0):
        timing.tick(t)
    sample, garbage = response_sample(AcceptanceFigures(output_tokens=11, decode_seconds=math.nan), timing)
    assert garbage and sample == SpeedSample(10, 1.0, "stream")


def test_stream_timing_counts_chunks_when_no_usage_was_reported():
    timing = StreamTiming()
    for t in (0.0, 0.1, 0.2, 0.3):
        timing.tick(t)
    assert response_sample(None, timing) == (SpeedSample(3, pytest.approx(0.3), "stream"), False)


def test_one_chunk_or_one_token_teaches_nothing():
    timing = StreamTiming()
    timing.tick(1.0)
    assert response_sample(None, timing) == (None, False)
    assert response_sample(AcceptanceFigures(output_tokens=1, decode_seconds=0.0), None) == (None, False)


def request_sample(prompt: int, wait: float = 0.0, prefill_per_token: float = 0.0004) -> SpeedSample:
    """A whole request of 64 tokens on an engine whose prefill costs 4 ms and `prefill_per_token`
    a prompt token after `wait` for a busy engine's step, and whose decode 10 ms a token."""
    first = wait + 0.004 + prefill_per_token * prompt
    figures = AcceptanceFigures(output_tokens=64, decode_seconds=0.63, first_token_seconds=first, prompt_tokens=prompt)
    return response_sample(figures, None, "request")[0]


def test_a_request_sample_keeps_its_prefill_apart_and_lumps_it_where_the_prompt_is_unknown():
    figures = AcceptanceFigures(output_tokens=64, decode_seconds=0.63, first_token_seconds=0.1)
    assert response_sample(figures, None, "request") == (SpeedSample(64, pytest.approx(0.73), "engine"), False)
    apart = request_sample(100)
    assert apart == SpeedSample(63, 0.63, "engine", pytest.approx(0.044), 100)
    unusable = dataclasses.replace(figures, first_token_seconds=math.nan, prompt_tokens=9)
    assert response_sample(unusable, None, "request")[0] == SpeedSample(63, 0.63, "engine")  # the decode alone


def test_a_request_sample_is_learnt_at_the_tenants_usual_prompt_whatever_prompt_it_drew():
    """Two arms of one speed, one that drew the tenant's longest prompts and one its shortest, read
    the same: the time the tenant's usual request takes (each sample at the usual of its time).
    Read as they came, the first reads 20 % slower. A busy engine's wait before the prefill is
    not scaled with the prompt."""
    tenant = TenantState()
    for prompt in (20, 600) * 3:  # the tenant's traffic: prompts of 20 and 600 tokens
        tenant.record_speed("plain", request_sample(prompt), GATE, 0.0)
    for _ in range(3):
        tenant.record_speed("eagle_2/k5", request_sample(600), GATE, 0.0)
        tenant.record_speed("ngram/k5", request_sample(20), GATE, 0.0)
    usual = tenant.shape.prompt / tenant.shape.weight
    assert tenant.shape.slope == pytest.approx(0.0004)
    expected = 64 / (0.004 + 0.0004 * usual + 0.63)
    for arm in ("plain", "eagle_2/k5", "ngram/k5"):
        assert tenant.arms[arm].rate == pytest.approx(expected, rel=0.03), arm  # the usual moved a little
    as_they_came = [64 / (0.004 + 0.0004 * prompt + 0.63) for prompt in (600, 20)]
    assert as_they_came[0] < 0.8 * as_they_came[1]
    usual = tenant.shape.prompt / tenant.shape.weight
    waited = tenant.record_speed("draft_model/k5", request_sample(20, wait=0.1), GATE, 0.0)
    assert waited.seconds == pytest.approx(0.1 + 0.004 + 0.0004 * usual + 0.63)


def test_a_tenant_whose_prompts_are_all_alike_learns_its_requests_as_they_came():
    tenant = TenantState()
    for wait in (0.0, 0.1, 0.0):
        learnt = tenant.record_speed("plain", request_sample(50, wait), GATE, 0.0)
    assert tenant.shape.slope == 0.0
    assert learnt.seconds == pytest.approx(0.004 + 0.0004 * 50 + 0.63) and learnt.tokens == pytest.approx(64)


# -- memory -------------------------------------------------------------------------------------


def test_speed_state_is_bounded_like_breakers():
    gate = GateConfig(max_tracked_tenants=50)
    store = InMemoryStateStore()
    for i in range(1000):
        store.record_speed((f"t{i}", "m"), "plain", sample(100.0), gate, float(i))
    assert len(store) == 50
    assert store.arm_views(("t0", "m"), gate, 1000.0) == {}
    assert store.arm_views(("t999", "m"), gate, 1000.0)["plain"].tokens_per_s == pytest.approx(100.0)


# -- the per-tenant plan ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "sample", "miss", "wait", "reconfigure"]),
            st.integers(0, 2),  # which arm a sample or miss is for
            st.floats(20.0, 400.0),  # its rate, or the wait in seconds
            st.floats(0.0, 1.0, exclude_max=True),  # the request's bucket
        ),
        max_size=80,
    )
)
def test_a_tenants_cached_plan_chooses_what_the_estimates_say_now(steps):
    """TenantState reuses one plan across requests until a sample, a miss, a config change or an
    arm's evidence running out makes it stale: every admission equals choosing afresh."""
    # Every response read: an exploring request past the read budget is redirected (tested below).
    tenant, now, gate, labels = TenantState(), 0.0, dataclasses.replace(GATE, max_measured_per_s=math.inf), ARMS
    for op, arm, value, bucket in steps:
        if op == "sample":
            tenant.record_speed(labels[arm], sample(value), gate, now)
        elif op == "miss":
            tenant.record_speed(labels[arm], None, gate, now)
        elif op == "wait":
            now += value
        elif op == "reconfigure":  # a reload: equal settings, new objects
            gate, labels = dataclasses.replace(gate), (*labels,)
        else:
            expected = choose_arm(tenant.arms, labels, gate, now, bucket)
            admission = tenant.admit(labels, gate, now, bucket)
            assert (admission.arm, admission.reason, admission.speedup) == expected


def test_a_plan_is_reused_until_it_goes_stale_with_time():
    tenant = TenantState()
    for _ in range(5):
        tenant.record_speed("plain", sample(100.0), GATE, 0.0)
        tenant.record_speed("eagle_2/k5", sample(50.0), GATE, 0.0)
    not_exploring = 0.999 / 4096
    assert tenant.admit(ARMS, GATE, 0.0, not_exploring).reason == SLOWER
    plan = tenant.plan
    assert plan is not None and tenant.admit(ARMS, GATE, 1.0, not_exploring).reason == SLOWER
    assert tenant.plan is plan  # reused
    # evidence decays with time, and the posteriors with it: the plan is made afresh
    assert plan.valid_until == pytest.approx(GATE.speed_half_life_s / 16)
    tenant.admit(ARMS, GATE, plan.valid_until, not_exploring)
    assert tenant.plan is not plan


# -- how many responses are read ----------------------------------------------------------------


def test_reads_burst_one_second_deep_then_spread_evenly():
    tenant = TenantState()
    assert [tenant.take_read(4.0, 0.0) for _ in range(5)] == [True] * 4 + [False]
    # Steady traffic every 1/16 s refills a quarter read per request: every fourth is read, evenly.
    times = [i / 16 for i in range(1, 161)]
    reads = [t for t in times if tenant.take_read(4.0, t)]
    assert len(reads) == 40 and {b - a for a, b in zip(reads, reads[1:], strict=False)} == {0.25}


def test_a_rate_below_one_per_second_still_reads_one_and_infinity_reads_all():
    tenant = TenantState()
    assert [tenant.take_read(0.5, t) for t in (0.0, 1.0, 2.0, 2.0)] == [True, False, True, False]
    assert all(TenantState().take_read(math.inf, 0.0) for _ in range(1000))


def test_exploration_past_the_read_rate_runs_the_chosen_arm_unread():
    """Exploring without reading would run a slower arm for nothing."""
    gate = dataclasses.replace(GATE, max_measured_per_s=1.0)
    arms = measured({"plain": 100.0, "eagle_2/k5": 150.0, "ngram/k5": 140.0})  # a near tie: explored
    exploring = [b for b in GRID if choose_arm(arms, ARMS, gate, 0.0, b).reason == EXPLORE][:3]
    tenant = TenantState()
    tenant.arms = arms
    first, second, third = (tenant.admit(ARMS, gate, 0.0, bucket) for bucket in exploring)
    assert (first.reason, first.measured) == (EXPLORE, True) and first.arm != 1
    assert [(a.arm, a.reason, a.measured) for a in (second, third)] == [(1, OK, False)] * 2
    assert second.speedup == pytest.approx(1.5)
    assert tenant.decisions == {EXPLORE: 1, OK: 2}
    assert tenant.admit(ARMS, gate, 1.0, exploring[1]).reason == EXPLORE  # a read refilled


def test_an_arm_short_of_samples_does_not_raise_what_the_measured_ones_may_explore():
    """(issue 39) On real vLLM pools EAGLE-3, a clear loser, stayed short of samples (it is rarely
    explored, and its samples decay), and that let the measured runner-up claim the unmeasured cap:
    a quarter of one client's requests explored. Each short arm takes its own share of
    `explore_fraction_unmeasured`; the measured ones together at most `explore_fraction`."""
    arms = measured({"plain": 100.0, "ngram/k5": 140.0, "draft/k4": 125.0}, n=6)
    arms["eagle_3/k4"] = ArmEstimate()
    arms["eagle_3/k4"].add(sample(50.0), GATE, 0.0)  # one sample at half plain's speed
    labels = ("plain", "ngram/k5", "draft/k4", "eagle_3/k4")
    gate = dataclasses.replace(GATE, explore_fraction=0.05, explore_fraction_unmeasured=0.5)
    split = share(arms, gate=gate, labels=labels)
    measured_share = split.get((0, EXPLORE), 0.0) + split.get((2, EXPLORE), 0.0)
    assert 0.0 < measured_share <= gate.explore_fraction + 1 / 4096  # the runner-up, within its cap
    assert split.get((3, EXPLORE), 0.0) < 0.05  # the short loser: a sliver of the unmeasured cap
    assert split.get((1, OK), 0.0) > 0.9
