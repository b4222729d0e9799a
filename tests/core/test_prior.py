"""The pooled prior per (model, arm): robust pooling, bounded tenant weight, a tenant never its own
prior, ageing, eviction, and what it does to a tenant's decisions, through the real in-memory store
with an injected clock (the black-box loop through AceSpecDec is test_asgi_prior.py)."""

import math

import pytest

from ace_mw import GateConfig, InMemoryStateStore
from ace_mw.decide.prior import SPREAD_FEW, SPREAD_MIN, Contribution, pooled, weighted_median
from ace_mw.decide.samples import SpeedSample
from ace_mw.decide.speed import EXPLORE, PRIOR, ArmEstimate, Prior, beliefs

GATE = GateConfig(speed_min_samples=3, speed_half_life=8, max_measured_per_s=math.inf)  # every response read
ARMS = ("plain", "eagle_2/k5")
EXPLOIT = 0.999 / 4096  # a bucket whose exploration draw is 0.999: never explores


def feed(store, tenant, rates, n=6, now=0.0, model="m"):
    """n samples of each arm at `rates` (tokens/s), as responses would teach them."""
    for _ in range(n):
        for arm, rate in rates.items():
            store.record_speed((tenant, model), arm, SpeedSample(100.0, 100.0 / rate, "stream"), GATE, now)


def prior_of(store, arm="eagle_2/k5", now=0.0):
    return {(p.model, p.arm): p for p in store.priors(GATE, now)}.get(("m", arm))


def test_the_lower_weighted_median_leans_to_the_cautious_side():
    assert weighted_median([(1.0, 1.0), (3.0, 1.0)]) == 1.0
    assert weighted_median([(1.0, 1.0), (2.0, 1.0), (9.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 1.0), (2.0, 5.0)]) == 2.0


def test_spread_is_robust_and_floored():
    few = pooled({"a": Contribution(-0.7, 5, 0.0), "b": Contribution(-0.6, 5, 0.0)}, GATE, 0.0)
    assert few is not None and few.spread == SPREAD_FEW and few.tenants == 2
    agree = pooled({t: Contribution(-0.7, 5, 0.0) for t in "abcd"}, GATE, 0.0)
    assert agree is not None and agree.spread == SPREAD_MIN  # no prior tighter than the floor
    spread = pooled({t: Contribution(v, 5, 0.0) for t, v in zip("abcde", (-2, -1, 0, 1, 2), strict=True)}, GATE, 0.0)
    assert spread is not None and spread.mean == 0 and spread.spread == pytest.approx(1.4826)


def test_a_new_tenant_decides_from_its_first_request_on_what_others_measured():
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 50.0})
    prior = prior_of(store)
    assert prior is not None and prior.speedup == pytest.approx(0.5) and prior.tenants == 3
    first = store.admit(("new", "m"), ARMS, GATE, 0.0, EXPLOIT)
    assert (first.arm, first.reason) == (0, PRIOR)
    # and it barely explores EAGLE-2: at 0.5x the chance that it beats plain is tiny
    explored = [store.admit(("new", "m"), ARMS, GATE, 0.0, (i + 0.5) / 4096 / 4096).arm for i in range(4096)]
    assert sum(explored) / len(explored) < 0.01


def test_a_tenant_is_never_its_own_prior():
    store = InMemoryStateStore()
    feed(store, "alone", {"plain": 100.0, "eagle_2/k5": 50.0}, n=1)  # one sample of each: uncertain
    assert prior_of(store).tenants == 1
    mine = store.admit(("alone", "m"), ARMS, GATE, 0.0, EXPLOIT)
    other = store.admit(("other", "m"), ARMS, GATE, 0.0, EXPLOIT)
    assert other.reason == PRIOR
    assert mine.reason != PRIOR  # its own single sample decides, not an echo of it


def test_a_flood_of_absurd_figures_from_one_tenant_moves_no_one_elses_prior():
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 50.0})
    before = prior_of(store)
    # well-formed and absurd: EAGLE-2 at 100,000 tokens/s against plain at 1, a thousand times over
    feed(store, "liar", {"plain": 1.0, "eagle_2/k5": 1e5}, n=1000)
    after = prior_of(store)
    assert after.tenants == 4 and after.samples <= before.samples + GATE.prior_tenant_weight
    assert after.speedup == pytest.approx(before.speedup)  # the median did not move
    assert after.spread < 1.0
    first = store.admit(("new", "m"), ARMS, GATE, 0.0, EXPLOIT)
    assert (first.arm, first.reason) == (0, PRIOR)


def test_a_tenant_whose_traffic_differs_leaves_the_prior_in_a_few_requests():
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c", "d"):
        feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 50.0})
    feed(store, "fast", {"plain": 100.0, "eagle_2/k5": 200.0}, n=2)  # 2x where the others see 0.5x
    choice = store.admit(("fast", "m"), ARMS, GATE, 0.0, EXPLOIT)
    assert (choice.arm, choice.reason) == (1, "ok")
    assert choice.speedup > 1.0  # two samples of its own outweigh the prior of four tenants


def test_contributions_age_out_and_leave_with_an_evicted_tenant():
    store = InMemoryStateStore()
    feed(store, "a", {"plain": 100.0, "eagle_2/k5": 50.0})
    feed(store, "b", {"plain": 100.0, "eagle_2/k5": 50.0})
    assert prior_of(store).tenants == 2
    assert prior_of(store, now=20 * GATE.speed_half_life_s) is None  # stale evidence pools nothing
    small = GateConfig(max_tracked_tenants=2)
    store.admit(("c", "m"), ARMS, small, 0.0, EXPLOIT)  # evicts "a", the least recently used
    assert prior_of(store).tenants == 1


def test_a_zero_tenant_weight_turns_the_pooling_off():
    store, gate = InMemoryStateStore(), GateConfig(prior_tenant_weight=0)
    for veteran in ("a", "b"):
        for _ in range(5):
            for arm, rate in {"plain": 100.0, "eagle_2/k5": 50.0}.items():
                store.record_speed((veteran, "m"), arm, SpeedSample(100.0, 100.0 / rate, "stream"), gate, 0.0)
    assert store.priors(gate, 0.0) == []
    assert store.admit(("new", "m"), ARMS, gate, 0.0, EXPLOIT).arm == 1  # learns alone: first candidate


def test_priors_are_per_model():
    store = InMemoryStateStore()
    feed(store, "a", {"plain": 100.0, "eagle_2/k5": 50.0}, model="small")
    assert store.admit(("new", "big"), ARMS, GATE, 0.0, EXPLOIT).arm == 1  # nothing known of "big"
    assert store.admit(("new", "small"), ARMS, GATE, 0.0, EXPLOIT).arm == 0


def test_a_cached_plan_follows_a_prior_that_appears_later():
    store = InMemoryStateStore()
    assert store.admit(("new", "m"), ARMS, GATE, 0.0, EXPLOIT).arm == 1  # nothing known yet
    feed(store, "a", {"plain": 100.0, "eagle_2/k5": 50.0})
    assert store.admit(("new", "m"), ARMS, GATE, 0.0, EXPLOIT).arm == 0  # no sample of its own needed


def test_exploration_under_a_prior_stays_within_the_unmeasured_share():
    store = InMemoryStateStore()
    gate = GateConfig(speed_min_samples=3, explore_fraction_unmeasured=0.1, max_measured_per_s=math.inf)
    for veteran in ("a", "b", "c"):
        for _ in range(5):
            for arm, rate in {"plain": 100.0, "eagle_2/k5": 99.0}.items():  # a near tie: worth exploring
                store.record_speed((veteran, "m"), arm, SpeedSample(100.0, 100.0 / rate, "stream"), gate, 0.0)
    reasons = [store.admit(("new", "m"), ARMS, gate, 0.0, (i + 0.5) / 4096 / 4096).reason for i in range(4096)]
    assert 0.05 < reasons.count(EXPLORE) / len(reasons) <= 0.1 + 1 / 4096
    assert not math.isnan(prior_of(store).speedup)


def test_an_arm_without_a_prior_of_its_own_takes_its_familys():
    store = InMemoryStateStore()
    feed(store, "a", {"plain": 100.0, "eagle_2/k5": 50.0})
    views = {(p.model, p.arm) for p in store.priors(GATE, 0.0)}
    assert views == {("m", "eagle_2/k5"), ("m", "eagle_2/*")}
    six = ("plain", "eagle_2/k6")
    assert store.admit(("new", "m"), six, GATE, 0.0, EXPLOIT)[1:3] == (0, PRIOR)  # EAGLE-2 with 6 tokens: plain
    other_pool = ("plain", "eagle_2/k5@gpu")
    assert store.admit(("new", "m"), other_pool, GATE, 0.0, EXPLOIT).arm == 1  # another server: nothing known


def explored_share(store, tenant, gate=GATE, now=0.0, arms=ARMS):
    draws = [store.admit((tenant, "m"), arms, gate, now, (i + 0.5) / 4096 / 4096) for i in range(4096)]
    return sum(d.reason == EXPLORE for d in draws) / len(draws)


def test_a_tight_prior_that_says_slower_still_owes_the_tenant_one_sample_of_its_own():
    """(issue 40) Probability matching alone gives EAGLE-2 at 0.4x nothing: a tenant for whom it
    runs at 2.7x would never find out. After its first (plain) sample, the candidate it has never
    measured takes the unmeasured share; once measured, a sample that agrees with the prior ends
    the exploring, and one that disagrees moves the tenant over."""
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 40.0})
    assert store.admit(("new", "m"), ARMS, GATE, 0.0, EXPLOIT).reason == PRIOR  # its first: plain, the prior
    feed(store, "new", {"plain": 100.0}, n=1)
    assert explored_share(store, "new") == pytest.approx(GATE.explore_fraction_unmeasured, abs=0.01)
    for tenant, rate in (("like-the-others", 40.0), ("differs", 270.0)):
        feed(store, tenant, {"plain": 100.0}, n=1)
        feed(store, tenant, {"eagle_2/k5": rate}, n=1)  # the owed sample
    assert explored_share(store, "like-the-others") < 0.01  # paid one request, back to plain
    assert explored_share(store, "differs") > 0.1  # near a tie now: measured again within a few requests
    feed(store, "differs", {"plain": 100.0, "eagle_2/k5": 270.0}, n=1)
    moved = store.admit(("differs", "m"), ARMS, GATE, 0.0, EXPLOIT)
    assert (moved.arm, moved.reason) == (1, "ok")


def test_pools_that_share_cores_do_not_explore_while_requests_are_in_flight():
    from ace_mw.decide.load import at_load, exploiting

    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 99.0})  # a near tie: worth exploring
    feed(store, "new", {"plain": 100.0}, n=1)
    assert explored_share(store, "new") > 0.2
    quiet = exploiting(GATE)
    assert quiet is exploiting(GATE) and (quiet.explore_fraction, quiet.explore_fraction_unmeasured) == (0, 0)
    assert explored_share(store, "new", gate=quiet, arms=at_load(ARMS, (2, 2))) == 0.0


def test_a_candidate_whose_speed_swings_with_the_prompt_weighs_its_lucky_samples_less():
    """(issue 39) Three samples of the draft model that swing 3x with the prompt say less than three
    of a steady arm at the same aggregate speed: the prior of the pool keeps more of its say, so a
    lucky run of a noisy arm does not outrank the arm that everyone measured faster."""
    plain, steady, swinging = ArmEstimate(), ArmEstimate(), ArmEstimate()
    for rate in (100.0, 98.0, 102.0, 100.0):
        plain.add(SpeedSample(100.0, 100.0 / rate, "stream"), GATE, 0.0)
    for rate in (150.0, 150.0, 150.0):
        steady.add(SpeedSample(100.0, 100.0 / rate, "stream"), GATE, 0.0)
    for tokens, seconds in ((100.0, 1.0), (100.0, 0.4), (100.0, 0.6)):  # 100, 250, 167 tok/s
        swinging.add(SpeedSample(tokens, seconds, "stream"), GATE, 0.0)
    assert swinging.rate == pytest.approx(steady.rate, rel=0.05) and swinging.noise > 5 * steady.noise
    arms = {"plain": plain, "steady": steady, "swinging": swinging}
    prior = Prior(math.log(1.08), SPREAD_MIN, 4, 20.0)  # the others measured this arm at 1.08x plain
    held, swayed = (beliefs(arms, ("plain", label), GATE, 0.0, {label: prior}) for label in ("steady", "swinging"))
    assert held is not None and swayed is not None
    assert math.exp(held.mean(1)) > 1.4  # a steady arm's own samples outweigh the prior
    assert math.exp(swayed.mean(1)) < 1.3  # a swinging one's keep the prior's say: half-way there


def test_under_the_speed_policy_a_probe_runs_only_where_the_plan_would_run_its_drafter():
    """An open breaker probes the drafters it judges; under the speed policy, when prompt lookup
    (not judged by it) or plain decoding is faster, a probe of EAGLE-2 pays for an answer nobody
    acts on: the request runs where the plan says, and the probe slot is released."""
    store = InMemoryStateStore()
    arms = ("plain", "eagle_2/k5", "ngram/k5")
    gate = GateConfig(speed_min_samples=3, min_samples=4, explore_fraction=0.0, max_measured_per_s=math.inf)
    key = ("t", "m")
    later = 10_000.0  # half-open: every request of the sticky probe share may probe
    for _ in range(6):
        for arm, rate in {"plain": 100.0, "eagle_2/k5": 80.0, "ngram/k5": 140.0}.items():
            store.record_speed(key, arm, SpeedSample(100.0, 100.0 / rate, "stream"), gate, later)
    for _ in range(6):
        store.record(key, 0.1, probe=False, gate=gate, now=0.0)  # EAGLE-2's acceptance collapsed
    admissions = [store.admit(key, arms, gate, later, (i + 0.5) / 64) for i in range(64)]
    assert not any(a.probe for a in admissions)
    assert all(a.arm == 2 for a in admissions)  # prompt lookup, the fastest, not held back
    assert store.view(key).state != "closed" and store._touch(key, gate).breaker.probes == 0


HOT = "m|T>0.5"  # the state of a tenant's requests above the first temperature band


def owed_share(store, tenant, model):
    """The share of the tenant's next requests on `model` that go to EAGLE-2 (its owed sample)."""
    decided = [store.admit((tenant, model), ARMS, GATE, 0.0, (i + 0.5) / 4096 / 4096).arm for i in range(4096)]
    return sum(decided) / len(decided)


@pytest.mark.parametrize(("eagle", "owed_when_hot"), [(50.0, False), (270.0, True)], ids=["like-the-others", "differs"])
def test_a_tenant_owes_a_candidate_one_sample_unless_another_band_showed_it_like_the_others(eagle, owed_when_hot):
    """Temperature bands part a tenant's state (gate.temperature_bands), and each is a newcomer's
    at first. Three veterans measured EAGLE-2 at 0.5x plain in both bands. A tenant that paid its
    owed sample in its greedy band and found EAGLE-2 as slow as they did owes none in its hot band:
    the prior decides there at once. One for whom EAGLE-2 ran at 2.7x greedy is owed one there too."""
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        for model in ("m", HOT):
            feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 50.0}, model=model)
    feed(store, "new", {"plain": 100.0}, n=1, model=HOT)  # its first hot request, prior-decided
    assert owed_share(store, "new", HOT) > 0.4  # nothing known of its first band: owed
    feed(store, "new", {"plain": 100.0, "eagle_2/k5": eagle}, n=1)  # its greedy band: the owed sample
    hot = owed_share(store, "new", HOT)
    assert hot > 0.4 if owed_when_hot else hot < 0.01


@pytest.mark.parametrize(
    ("eagle", "owed_when_greedy"), [(50.0, False), (270.0, True)], ids=["like-the-others", "differs"]
)
def test_the_owed_sample_is_paid_in_whichever_band_comes_first(eagle, owed_when_greedy):
    """A tenant whose first requests are hot pays its owed sample there; its greedy band, sent
    later, owes none when that sample showed EAGLE-2 as the others measured it (one sample per
    model, whatever the order of its bands: issue 40's "speculates at most once before plain")."""
    store = InMemoryStateStore()
    for veteran in ("a", "b", "c"):
        for model in ("m", HOT):
            feed(store, veteran, {"plain": 100.0, "eagle_2/k5": 50.0}, model=model)
    feed(store, "new", {"plain": 100.0}, n=1)  # its first greedy request, prior-decided
    assert owed_share(store, "new", "m") > 0.4  # nothing known of its hot band: owed
    feed(store, "new", {"plain": 100.0, "eagle_2/k5": eagle}, n=1, model=HOT)  # the owed sample, hot
    greedy = owed_share(store, "new", "m")
    assert greedy > 0.4 if owed_when_greedy else greedy < 0.01
