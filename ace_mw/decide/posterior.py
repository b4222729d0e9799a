"""A tenant's belief about its arms' speeds: every arm against every other, not only through plain.

The speed policy compares arms by their log speed ratio to plain decoding, `delta[i]` (plain's is
0). A tenant measures each arm on its own prompts, and its prompts set a level of their own (short
answers, long prompts): the mean log rate of arm i is `level + delta[i]` plus noise. Each
`delta[i]` has a prior (what the other tenants measured, decide/prior.py); the level has none.

The belief is the Gaussian posterior of all the deltas at once, the level integrated out. What that
buys over comparing each arm with plain alone: a tenant that runs prompt lookup almost always and
plain decoding once knows prompt lookup against the draft model from their own samples, both
measured often, where the two ratios to plain each rest on that one plain sample (and every arm
then counted as unmeasured, explored at the high rate). Where plain is measured well, the belief
of an arm is what the ratio to plain and its prior make of it, as before.

An arm's data say nothing alone: with one arm measured there is no comparison, and the belief of
each delta is its prior. An arm measured without a prior, where nothing it is compared with is
anchored to plain (plain unmeasured, no measured arm with a prior), has no belief: the caller
measures before it compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Observed(NamedTuple):
    """An arm's own samples: the log of its aggregate rate, and how precise that is (samples over
    the arm's per-sample noise)."""

    log_rate: float
    precision: float


class Belief(NamedTuple):
    """A prior of one delta: mean and standard deviation."""

    mean: float
    sd: float


class Posterior(NamedTuple):
    """The deltas of the arms that have a belief: means, covariances and how much of each arm's
    precision its own data give (the rest is its prior's). Index 0 is plain: mean 0, no variance."""

    arms: tuple[int, ...]  # the arms with a belief, plain (0) first
    means: dict[int, float]
    covariance: dict[tuple[int, int], float]
    data_precision: dict[int, float]  # of the arm's delta, beyond its prior's
    prior_precision: dict[int, float]

    def mean(self, arm: int) -> float:
        return self.means[arm]

    def var(self, arm: int) -> float:
        return self.covariance.get((arm, arm), 0.0)

    def variance_between(self, a: int, b: int) -> float:
        """The variance of delta[a] - delta[b]: two arms a tenant measured side by side compare
        more precisely than their ratios to plain each do."""
        cov = self.covariance
        return max(0.0, cov.get((a, a), 0.0) + cov.get((b, b), 0.0) - 2.0 * cov.get((a, b), 0.0))


def posterior(observed: Sequence[Observed | None], priors: Sequence[Belief | None]) -> Posterior | None:
    """The posterior of the deltas of arms 1.. from each arm's own samples (`observed`, plain at 0)
    and the priors of arms 1.. (`priors[0]` is ignored); None when no candidate has a belief.

    With p_i each measured arm's precision, P their sum and the level integrated out (a flat prior),
    the samples add diag(p) - p p^T / P to the prior's diagonal precision: a diagonal less a rank
    one, whose inverse is closed (Sherman-Morrison). O(arms), no matrix to solve."""
    n = len(observed)
    seen = {i: o for i in range(n) if (o := observed[i]) is not None and o.precision > 0}
    if not (0 in seen or any(priors[i] is not None for i in seen if i)):
        seen = {}  # the measured arms' level against plain is unknown: only their priors speak
    unknowns = tuple(i for i in range(1, n) if priors[i] is not None or i in seen)
    if not unknowns:
        return None
    if len(seen) < 2:
        seen = {}  # one arm alone compares with nothing
    total = sum(o.precision for o in seen.values())
    centre = sum(o.precision * o.log_rate for o in seen.values()) / total if seen else 0.0
    diagonal, linear, prior_precision = {}, {}, {}
    for arm in unknowns:
        belief, own = priors[arm], seen.get(arm)
        precision = 1.0 / belief.sd**2 if belief is not None else 0.0
        if belief is not None:
            prior_precision[arm] = precision
        diagonal[arm] = precision + (own.precision if own is not None else 0.0)
        linear[arm] = (belief.mean * precision if belief is not None else 0.0) + (
            own.precision * (own.log_rate - centre) if own is not None else 0.0
        )
    # (D - u u^T / P)^-1 = D^-1 + w w^T / (P - u^T D^-1 u), w = D^-1 u, u the candidates' precisions.
    weights = {arm: seen[arm].precision / diagonal[arm] if arm in seen else 0.0 for arm in unknowns}
    level = total - sum(weights[arm] * seen[arm].precision for arm in unknowns if arm in seen)
    shared = 1.0 / level if seen and level > 1e-12 else 0.0  # the level's uncertainty, shared by all
    pulled = shared * sum(weights[arm] * linear[arm] for arm in unknowns)
    means = {0: 0.0}
    covariance: dict[tuple[int, int], float] = {}
    data_precision = {}
    for a in unknowns:
        means[a] = linear[a] / diagonal[a] + weights[a] * pulled
        for b in unknowns:
            covariance[a, b] = (1.0 / diagonal[a] if a == b else 0.0) + weights[a] * weights[b] * shared
        data_precision[a] = max(0.0, 1.0 / covariance[a, a] - prior_precision.get(a, 0.0))
    return Posterior((0, *unknowns), means, covariance, data_precision, prior_precision)
