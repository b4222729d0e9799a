"""A tenant's belief about its arms (decide/posterior.py): the arms compared with each other, not only
through plain decoding, and what that does to exploration (issue 39: a tenant that ran plain once
kept exploring at the unmeasured rate, since every ratio to plain rested on that one sample)."""

import math

import pytest

from ace_mw import GateConfig
from ace_mw.decide.posterior import Belief, Observed, posterior
from ace_mw.decide.samples import SpeedSample
from ace_mw.decide.speed import EXPLORE, ArmEstimate, Prior, beliefs, choose_arm

GATE = GateConfig(speed_min_samples=2, speed_half_life=20, speed_half_life_s=3600.0)
ARMS = ("plain", "ngram/k4", "draft_model/k4", "eagle_3/k4")
GRID = [(i + 0.5) / 4096 / 4096 for i in range(4096)]


def arm(*rates: float) -> ArmEstimate:
    found = ArmEstimate()
    for rate in rates:
        found.add(SpeedSample(64.0, 64.0 / rate, "engine"), GATE, 0.0)
    return found


def test_with_plain_measured_a_candidate_is_its_prior_moved_by_its_ratio_to_plain():
    """Two arms: the precision-weighted mean of the prior and the tenant's own ratio, each arm's
    noise over its samples (the estimate before the joint belief, unchanged)."""
    found = posterior([Observed(math.log(100.0), 8.0), Observed(math.log(150.0), 4.0)], [None, Belief(0.1, 0.5)])
    assert found is not None
    own, own_precision, prior_precision = math.log(1.5), 1 / (1 / 8.0 + 1 / 4.0), 1 / 0.25
    expected = (own * own_precision + 0.1 * prior_precision) / (own_precision + prior_precision)
    assert found.mean(1) == pytest.approx(expected)
    assert found.var(1) == pytest.approx(1 / (own_precision + prior_precision))
    assert found.data_precision[1] == pytest.approx(own_precision)
    assert found.prior_precision[1] == pytest.approx(prior_precision)


def test_two_candidates_measured_often_compare_precisely_however_thin_plain_is():
    plain_once = [Observed(4.6, 20.0), Observed(4.9, 200.0), Observed(4.7, 60.0)]
    found = posterior(plain_once, [None, Belief(0.35, 0.3), Belief(0.1, 0.3)])
    assert found is not None
    assert found.var(1) > 0.02 and found.var(2) > 0.02  # each against plain: one sample's worth
    assert found.variance_between(1, 2) < 0.4 * (found.var(1) + found.var(2))  # side by side: precise
    assert found.mean(1) - found.mean(2) == pytest.approx(0.2, abs=0.03)  # what their own samples say


def test_an_arm_alone_says_nothing_and_without_an_anchor_a_candidate_has_no_belief():
    assert posterior([None, Observed(5.0, 10.0)], [None, None]) is None  # nothing to compare it with
    alone = posterior([None, Observed(5.0, 10.0)], [None, Belief(0.2, 0.3)])
    assert alone is not None and (alone.mean(1), alone.var(1)) == pytest.approx((0.2, 0.09))  # its prior
    # Plain unmeasured, but a measured arm with a prior anchors the one without.
    anchored = posterior([None, Observed(5.0, 10.0), Observed(5.3, 10.0)], [None, Belief(0.2, 0.3), None])
    assert anchored is not None and anchored.mean(2) == pytest.approx(0.5, abs=0.01)
    unanchored = posterior([None, Observed(5.0, 10.0), Observed(5.3, 10.0)], [None, None, None])
    assert unanchored is None


def test_a_tenant_that_ran_plain_once_explores_at_the_measured_rate_not_the_unmeasured_one():
    """The vLLM pools' chat tenant: prompt lookup exploited (12 samples), the draft model and EAGLE-3
    measured a few times, plain once. Against plain alone every candidate counted as unmeasured and
    took its share of `explore_fraction_unmeasured` (a fifth of the traffic, at 0.6-0.7x); compared
    with prompt lookup they are measured, and clearly slower."""
    arms = {
        "plain": arm(97.0),
        "ngram/k4": arm(*[150.0, 120.0, 140.0, 110.0, 220.0, 130.0] * 2),
        "draft_model/k4": arm(96.0, 100.0, 126.0),
        "eagle_3/k4": arm(91.0, 88.0),
    }
    priors = {
        "ngram/k4": Prior(math.log(1.45), 0.3, 3, 30.0),
        "draft_model/k4": Prior(math.log(1.1), 0.25, 3, 20.0),
        "eagle_3/k4": Prior(math.log(0.9), 0.25, 3, 20.0),
    }
    split = [choose_arm(arms, ARMS, GATE, 0.0, bucket, priors) for bucket in GRID]
    explored = sum(c.reason == EXPLORE for c in split) / len(split)
    assert explored <= GATE.explore_fraction
    assert sum(c.arm == 1 for c in split) / len(split) >= 1 - GATE.explore_fraction
    found = beliefs(arms, ARMS, GATE, 0.0, priors)
    assert found is not None and found.variance_between(1, 2) < found.var(1) + found.var(2)


def test_the_closed_form_is_the_gaussian_posterior_with_the_level_unknown():
    """Sherman-Morrison against the normal equations of the full model (a level and every delta,
    the level's prior vanishing), on random arms, priors and precisions."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(2, 7))
        observed = [
            Observed(rng.uniform(4, 5.5), rng.uniform(0.5, 200)) if rng.random() < 0.7 else None for _ in range(n)
        ]
        priors = [None] + [
            Belief(rng.uniform(-0.5, 0.7), rng.uniform(0.25, 0.6)) if rng.random() < 0.6 else None for _ in range(n - 1)
        ]
        found = posterior(observed, priors)
        if found is None:
            continue
        arms = found.arms[1:]
        where = {a: k + 1 for k, a in enumerate(arms)}
        seen = [i for i in range(n) if observed[i] is not None and (i == 0 or i in where)]
        matrix, vector = np.zeros((len(arms) + 1,) * 2), np.zeros(len(arms) + 1)
        matrix[0, 0] = 1e-12  # the level: a flat prior
        for a in arms:
            if priors[a] is not None:
                matrix[where[a], where[a]] += priors[a].sd ** -2
                vector[where[a]] += priors[a].mean * priors[a].sd ** -2
        for i in seen:
            row = np.zeros(len(arms) + 1)
            row[0] = 1.0
            if i:
                row[where[i]] = 1.0
            matrix += observed[i].precision * np.outer(row, row)
            vector += observed[i].precision * observed[i].log_rate * row
        covariance = np.linalg.inv(matrix)
        means = covariance @ vector
        for a in arms:
            assert found.mean(a) == pytest.approx(means[where[a]], abs=1e-6)
            for b in arms:
                assert found.covariance[a, b] == pytest.approx(covariance[where[a], where[b]], abs=1e-6)
