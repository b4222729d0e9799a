"""The speed gate: which arm decodes fastest for one (tenant, model), measured on its own traffic.

The arms are plain decoding plus every speculative candidate of the tenant's settings. Each arm keeps
a decayed estimate of its decode speed (output tokens per second after the first token, so a prefill
never counts), built from the responses it served. A request goes to the arm with the best estimate;
speculation must beat plain decoding by `gate.speed_margin` to be chosen, since a tie is not worth
the drafting compute. A sticky share of traffic explores the other arms so that every estimate
stays measured: `gate.explore_fraction` once every arm is measured, `gate.explore_fraction_unmeasured`
while some arm has too little fresh evidence (new, or stale after a quiet period).

The estimate is the ratio of decayed token and time sums (aggregate tokens per second, the figure a
fleet is judged by, rather than a mean of per-response rates). Evidence decays per sample
(`speed_half_life` responses) and with time (`speed_half_life_s`), so a change in hardware, load or
traffic is followed. Everything here is O(number of arms) per request, and the arms are few.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from ..config import GateConfig
from ..directive import PLAIN_ARM
from ..vocabulary import Reason
from .load import SEPARATOR, Joining
from .posterior import Belief, Observed, Posterior, posterior
from .samples import SpeedSample

PLAIN = PLAIN_ARM  # the label of the plain-decoding arm (index 0 of every arm list)
OK = Reason.OK  # the best arm is speculative
SLOWER = Reason.SLOWER  # the best arm is plain decoding: speculation measured slower
EXPLORE = Reason.EXPLORE  # exploration traffic, sent to an arm that is not the best
PRIOR = Reason.PRIOR  # the pooled prior of the model decided: the tenant's own evidence is still thin
JOINED = Reason.JOINED  # the best arm whose pool is busy, where pools share their cores


class ArmEstimate:
    """Decayed decode-speed evidence of one arm. Not thread-safe by itself (see state.py)."""

    __slots__ = ("tokens", "seconds", "logs", "squares", "weight", "updated_at", "misses")

    def __init__(self) -> None:
        self.tokens = 0.0  # decayed sums of the samples' tokens and seconds
        self.seconds = 0.0
        self.logs = 0.0  # decayed sums of the samples' log rates and their squares: the arm's noise
        self.squares = 0.0
        self.weight = 0.0  # decayed number of samples
        self.updated_at = 0.0
        self.misses = 0  # responses in a row that gave no sample

    @property
    def rate(self) -> float | None:
        """Estimated tokens per second, or None before any sample."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def sums(self) -> tuple[float, float, float, float]:
        """The decayed sums a fleet merges (state/fleet.py): tokens, seconds, log rates, squares."""
        return self.tokens, self.seconds, self.logs, self.squares

    @property
    def noise(self) -> float:
        """The variance of one sample's log rate on this arm for this tenant: its samples' own
        spread, shrunk towards ARM_NOISE as if that had been seen in NOISE_PRIOR_SAMPLES samples
        (one sample alone says nothing of its spread). An arm whose speed swings with the
        prompt (a drafter that some prompts suit) weighs its samples less than one that keeps its pace."""
        if self.weight <= 0 or self.squares <= 0:  # nothing measured (or sums from a version without them)
            return ARM_NOISE
        spread = max(0.0, self.squares - self.logs * self.logs / self.weight)
        return (NOISE_PRIOR_SAMPLES * ARM_NOISE + spread) / (NOISE_PRIOR_SAMPLES + max(0.0, self.weight - 1.0))

    def evidence(self, gate: GateConfig, now: float) -> float:
        """How many samples the estimate is worth now (it loses weight while nothing arrives)."""
        if not self.weight:
            return 0.0
        return self.weight * _time_decay(gate, now - self.updated_at)

    def add(self, sample: SpeedSample, gate: GateConfig, now: float) -> None:
        keep = gate.speed_decay * _time_decay(gate, now - self.updated_at) if self.weight else 0.0
        self.set_sums(tuple(s * keep + v for s, v in zip(self.sums, sample.sums, strict=True)))
        self.weight = self.weight * keep + 1.0
        self.updated_at = max(now, self.updated_at)
        self.misses = 0

    def set_sums(self, sums: tuple[float, ...]) -> None:
        self.tokens, self.seconds, self.logs, self.squares = sums

    def miss(self) -> None:
        """A response of this arm finished without a usable sample."""
        self.misses += 1


class Prior(NamedTuple):
    """What the other tenants on the same model measured of one arm (prior.py pools it): a normal
    belief about the arm's log speed ratio to plain decoding."""

    mean: float  # log(arm tokens/s over plain tokens/s), the tenants' weighted median
    spread: float  # the between-tenant spread of that log ratio (a standard deviation)
    tenants: int  # how many tenants it pools
    weight: float  # the (capped) samples it pools
    sole: str | None = None  # the one tenant it pools, when there is one (a tenant is not its own prior)

    @property
    def ratio(self) -> float:
        return math.exp(self.mean)


NO_PRIORS: Mapping[str, Prior] = {}
# The spread of the log speed ratio of one response on a candidate to one on plain decoding (timing
# noise, the prompt mix) before the arms' own samples show theirs (ArmEstimate.noise): how much a
# sample of a tenant's own weighs against the prior. Each arm's share of it is ARM_NOISE.
LOG_RATIO_SD = 0.3
ARM_NOISE = LOG_RATIO_SD**2 / 2
NOISE_PRIOR_SAMPLES = 1.0  # what LOG_RATIO_SD weighs against the arm's measured spread, in samples


# An arm a tenant has barely measured against the chosen one weighs its upside (`_upside`) over this:
# a tie claims the whole `explore_fraction_unmeasured` (prompt lookup about as fast as the chosen
# arm: measure it now), one bad sample of its own or a prior at 0.8x a fraction of it, EAGLE-2 at
# half the speed next to nothing.
COIN_FLIP = 0.5
# An arm's difference from the chosen one is measured once its posterior is this sure of it (a
# standard deviation of the log ratio: +-10 %): until then it explores as an arm short of samples
# does, by its upside. A few samples of prompt lookup, whose speed on code prompts swings 0.5x-2x
# with the prompt, leave it at +-20 % and more: at 5 % of traffic, an estimate that read it
# slow on its first prompts kept a tenant off its fastest arm for the whole run.
MEASURED_SD = 0.1
MEASURED_VARIANCE = MEASURED_SD**2


class OwnRatio(NamedTuple):
    """One tenant's own measure of a candidate against plain decoding."""

    log_ratio: float  # log of the arm's rate over plain's
    samples: float  # the lesser evidence of the two (what a pooled prior weighs the tenant by)
    var: float  # the variance of log_ratio: each arm's noise over its samples


def own_ratio(
    arms: Mapping[str, ArmEstimate], label: str, gate: GateConfig, now: float, plain_label: str = PLAIN
) -> OwnRatio | None:
    """The tenant's own ratio of `label` to plain, from its estimates; None until both arms have
    served a sample. `plain_label`: the plain arm to compare with (at a load, decide/load.py:
    plain at that load)."""
    plain, arm = arms.get(plain_label), arms.get(label)
    if plain is None or arm is None or not plain.tokens or not arm.tokens or not plain.seconds or not arm.seconds:
        return None
    plain_samples, arm_samples = plain.evidence(gate, now), arm.evidence(gate, now)
    if plain_samples <= 0 or arm_samples <= 0:
        return None
    var = arm.noise / arm_samples + plain.noise / plain_samples
    ratio = math.log((arm.tokens / arm.seconds) / (plain.tokens / plain.seconds))
    return OwnRatio(ratio, min(plain_samples, arm_samples), var)


class Choice(NamedTuple):
    arm: int  # index into the arm labels: 0 is plain decoding
    reason: str  # OK | SLOWER | PRIOR | EXPLORE
    speedup: float | None  # estimated speed of the chosen arm over plain decoding, where one is known


class ArmPlan(NamedTuple):
    """What `choose_arm` works out from the estimates before the request's own draw. It holds
    until a sample (or a miss) arrives, the config or the prior changes, or `valid_until` (evidence
    decays with time): a tenant's requests share one plan until then, and its choices are built
    with it."""

    labels: tuple[str, ...]
    gate: GateConfig
    valid_until: float
    fraction: float  # the share of requests that explore
    exploited: Choice  # the arm outside exploration
    explored: tuple[Choice, ...]  # the arms exploration draws from
    bounds: tuple[float, ...] = ()  # the upper end of each explored arm's slice of [0, fraction)
    ranked: tuple[Choice, ...] = ()  # every arm as it would be exploited, best first (`exploited` first)

    def choose(self, bucket: float) -> Choice:
        """The arm for one request; `bucket` in [0, 1) is the request's sticky hash."""
        # The low bits of the bucket: independent of the high bits that canary and probe splits use.
        draw = (bucket * 4096.0) % 1.0
        if self.explored and draw < self.fraction:
            for choice, bound in zip(self.explored, self.bounds, strict=True):
                if draw < bound:
                    return choice
            return self.explored[-1]
        return self.exploited

    def joined(self, joining: Joining) -> Choice | None:
        """Where a request joins the batch of pools that share their cores (decide/load.py,
        `arms_now`), or None when it should not: the best arm's pool is that batch's (it runs
        there), no arm's is, or the best arm there is slower than the best arm with `joining.cost`
        taken off its speed. Busy now, that cost counts the batch's requests too (a second batch
        halves the step rate of both: with k in flight, a pool under 1 / (2 + k) of the best
        arm's speed is not joined, `split_cost`); at idle it is the chance that a pinned request
        cuts in, and only arms with estimated speeds are weighed."""
        best, busy = self.exploited, joining.pools
        if busy[best.arm]:
            return None
        found = self.best_among(busy)
        if not busy[found.arm]:
            return None
        if best.speedup is None or found.speedup is None:
            return found._replace(reason=JOINED) if joining.now else None
        if found.speedup < best.speedup * (1.0 - joining.cost):
            return None
        return found._replace(reason=JOINED)

    def best_among(self, allowed: tuple[bool, ...]) -> Choice:
        """The best arm of those `allowed` (per arm), as it would be exploited; plain decoding
        where none is: where a request on pools that share their cores joins (decide/load.py)."""
        return next((c for c in self.ranked if allowed[c.arm]), Choice(0, SLOWER, None))


def plan_arms(
    arms: Mapping[str, ArmEstimate],
    labels: tuple[str, ...],
    gate: GateConfig,
    now: float,
    priors: Mapping[str, Prior] = NO_PRIORS,
    settled: frozenset[str] = frozenset(),
) -> ArmPlan:
    """The plan of `choose_arm` from the estimates now (`labels[0]` is PLAIN, at its load) and the pooled priors
    of the candidates (by label).

    Each candidate's log speed ratio to plain is a posterior (`beliefs`): its prior, moved by the
    tenant's own samples of every arm, which compare the arms with each other as well as with
    plain (decide/posterior.py). Traffic goes to the candidate with the best posterior mean if
    that beats plain by `speed_margin`, else to plain (reason PRIOR where the decisive candidate's prior outweighs the
    tenant's own evidence and the choice is the one the prior alone makes).

    Exploration follows the posterior of each arm's difference from the chosen one, weighted by
    what is at stake: the share of the expected difference that is a gain (`_upside`: a tie 1/2, a
    clear loser near 0).
    - an arm of which the tenant has fewer than `speed_min_samples` samples, or the chosen arm has,
      or whose difference from the chosen one is still uncertain by more than MEASURED_SD (a
      drafter whose speed swings with the prompt, measured a few times),
      takes min(1, upside / COIN_FLIP) of `explore_fraction_unmeasured` (its first samples say
      whether this tenant differs from the prior, worth the most where that is a tie); a candidate
      never measured at all, once plain has been, takes it whole (`first_sample_due`), unless it
      is `settled` (the tenant's first temperature band showed it like the others:
      `settled_candidates`);
    - the measured arms share `explore_fraction` (at most), each by its upside: an arm short of
      samples does not raise what the measured ones may take;
    - together they take at most `explore_fraction_unmeasured`, and a chosen arm still short of
      samples keeps at least an explored arm's share.

    With nothing known (no prior, no ratio) the fastest candidate measured alone runs, else the
    first one, and nothing explores until it is measured: a tenant on a model no one has measured
    starts speculating."""
    evidence = [arm.evidence(gate, now) if (arm := arms.get(label)) is not None else 0.0 for label in labels]
    measurable = [_can_measure(arms.get(label), gate) for label in labels]
    post = beliefs(arms, labels, gate, now, priors)
    unmeasured_cap, measured_cap = gate.explore_fraction_unmeasured, gate.explore_fraction
    cap = measured_cap
    shares: dict[int, float] = {}  # explored arm -> its share of traffic (before the cap)
    if post is None:
        rated = {i: arms[labels[i]].rate or 0.0 for i in range(1, len(labels)) if evidence[i] >= gate.speed_min_samples}
        best = max(rated, key=lambda i: (rated[i], -i)) if rated else (1 if len(labels) > 1 else 0)
        others = [i for i in range(len(labels)) if i != best]
        needy = [i for i in others if measurable[i] and evidence[i] < gate.speed_min_samples]
        if evidence[best] < gate.speed_min_samples and measurable[best]:
            pass  # measure the default arm first: there is nothing to compare with yet
        elif needy:
            cap, shares = unmeasured_cap, dict.fromkeys(needy, unmeasured_cap)
        else:
            shares = dict.fromkeys(others, measured_cap)
        exploited = Choice(best, OK if best else SLOWER, None)
        order = sorted(range(len(labels)), key=lambda i: (i != best, -(rated.get(i) or 0.0), i))
        ranked = tuple(Choice(i, OK if i else SLOWER, None) for i in order)
    else:
        floor = math.log1p(gate.speed_margin)  # plain, as a candidate must beat it
        mean = {i: floor if i == 0 else post.mean(i) for i in post.arms}
        best = max(mean, key=lambda i: (mean[i], -i))
        decisive = best or max(post.arms[1:], key=lambda i: (mean[i], -i))
        # The prior decided when it outweighs the tenant's own evidence and its own verdict (this
        # candidate or plain) is the one taken.
        prior = priors.get(labels[decisive])
        prior_led = post.prior_precision.get(decisive, 0.0) > post.data_precision[decisive]
        agrees = prior is not None and (prior.mean >= floor) == (best != 0)
        reason = PRIOR if prior_led and agrees else (OK if best else SLOWER)
        exploited = Choice(best, reason, _speedup(best, post))
        order = sorted(range(len(labels)), key=lambda i: (i != best, -mean.get(i, -math.inf), i))
        ranked = (exploited, *(Choice(i, OK if i else SLOWER, _speedup(i, post)) for i in order[1:]))
        upsides: dict[int, float] = {}  # measured arms: they share `measured_cap` by their upside
        cap = unmeasured_cap
        for i in range(len(labels)):
            if i == best:
                continue
            if i in mean:
                # An arm the tenant has barely measured against the chosen one: its first samples
                # say whether this tenant differs from the prior, worth the most where that is a
                # tie. Once measured: the share of the expected difference that is a gain.
                against = (mean[i] - mean[best], post.variance_between(i, best))
                owed = first_sample_due(arms.get(labels[i]), labels[i], evidence[0], measurable[i])
                if i and owed and labels[i] not in settled:
                    shares[i] = unmeasured_cap
                elif min(evidence[i], evidence[best]) < gate.speed_min_samples or against[1] > MEASURED_VARIANCE:
                    shares[i] = unmeasured_cap * min(1.0, _upside(against) / COIN_FLIP)
                else:
                    upsides[i] = _upside(against)
            else:  # a candidate nothing is known of: measure it (a sliver if it never reports)
                shares[i] = unmeasured_cap if measurable[i] else measured_cap
        measured = sum(upsides.values())
        for i, upside in upsides.items():
            shares[i] = upside * min(measured_cap, measured) / measured if measured > 0 else 0.0
    pool = [i for i, share in shares.items() if share > 0]
    total = sum(shares[i] for i in pool)
    fraction = min(cap, total)
    if pool and measurable[best] and evidence[best] < gate.speed_min_samples:
        # The chosen arm is short of samples of its own too: it keeps an explored arm's share, so
        # that a cap near 1 cannot leave it unmeasured (and the others without a ratio to it).
        fraction = min(fraction, total / (total + cap))
    bounds, edge = [], 0.0
    for i in pool:
        edge += fraction * shares[i] / total
        bounds.append(edge)
    explored = tuple(Choice(i, EXPLORE, _speedup(i, post)) for i in pool)
    # Evidence decays with time, which moves the posteriors: plan afresh every 1/16 half-life.
    valid_until = now + gate.speed_half_life_s / 16
    return ArmPlan(labels, gate, valid_until, fraction, exploited, explored, tuple(bounds), ranked)


def first_sample_due(arm: ArmEstimate | None, label: str, plain_evidence: float, measurable: bool) -> bool:
    """Whether a candidate is owed its first sample of this tenant's own: never measured by it
    (at rest: an arm at a load band takes what comes), while plain decoding has been. However
    tight a prior that says it is slower, one request tells whether this tenant's traffic is the
    exception (a prior a tenant can leave: docs/concepts.md); the cost is capped at that one
    request per candidate and tenant, its first one being plain, as the prior decides."""
    return measurable and plain_evidence > 0 and (arm is None or arm.weight == 0) and SEPARATOR not in label


def settled_candidates(
    arms: Mapping[str, ArmEstimate], priors: Mapping[str, Prior], labels: tuple[str, ...]
) -> frozenset[str]:
    """The candidates of `labels` whose first sample a tenant does not owe in its other temperature
    bands: measured in one band (`arms`, with that band's `priors`), where its own speed ratio to
    plain lay within the pooled prior's spread. The owed sample asks whether a tenant's traffic
    differs from the others'; a tenant that answered "no" in one band, whichever it sent first, is
    taken at its word in the others (where each band's prior decides, and exploration by upside
    remains), and one that answered "yes" is owed a sample in each."""
    plain = arms.get(labels[0])
    if plain is None or not plain.rate:
        return frozenset()
    found = []
    for label in labels[1:]:
        arm, prior = arms.get(label), priors.get(label)
        if arm is not None and arm.rate and prior is not None:
            if abs(math.log(arm.rate / plain.rate) - prior.mean) <= prior.spread:
                found.append(label)
    return frozenset(found)


def _speedup(arm: int, post: Posterior | None) -> float | None:
    if post is None or arm not in post.means:
        return None
    return math.exp(post.mean(arm))


def beliefs(
    arms: Mapping[str, ArmEstimate],
    labels: tuple[str, ...],
    gate: GateConfig,
    now: float,
    priors: Mapping[str, Prior] = NO_PRIORS,
) -> Posterior | None:
    """The tenant's belief about every arm's log speed ratio to plain (`labels[0]`), from its own
    samples of each arm and the pooled priors (decide/posterior.py); None while no candidate has one."""
    observed: list[Observed | None] = []
    for label in labels:
        arm = arms.get(label)
        samples = arm.evidence(gate, now) if arm is not None and arm.tokens and arm.seconds else 0.0
        if arm is not None and samples > 0:
            observed.append(Observed(math.log(arm.tokens / arm.seconds), samples / arm.noise))
        else:
            observed.append(None)
    found_priors = [None, *(Belief(p.mean, p.spread) if (p := priors.get(label)) else None for label in labels[1:])]
    return posterior(observed, found_priors)


def _upside(difference: tuple[float, float]) -> float:
    """E[D+] / E[|D|] for a normal difference D ~ (mean, var) of an arm over the chosen one: the
    share of the expected difference that is a gain. 1/2 for a tie, near 0 for a clear loser, and
    smaller than P(D > 0) for a loser, whose exploring costs more than it can win."""
    d, var = difference
    if var <= 0:
        return 1.0 if d > 0 else 0.0
    sd = math.sqrt(var)
    z = d / sd
    density = math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    gain = sd * density + d * 0.5 * math.erfc(-z / math.sqrt(2.0))  # E[D+]
    loss = gain - d  # E[D-]
    return gain / (gain + loss) if gain + loss > 0 else 0.5


def choose_arm(
    arms: Mapping[str, ArmEstimate],
    labels: tuple[str, ...],
    gate: GateConfig,
    now: float,
    bucket: float,
    priors: Mapping[str, Prior] = NO_PRIORS,
) -> Choice:
    """The arm for one request (see plan_arms, ArmPlan.choose)."""
    return plan_arms(arms, labels, gate, now, priors).choose(bucket)


def best_candidate(
    arms: Mapping[str, ArmEstimate],
    labels: tuple[str, ...],
    gate: GateConfig,
    now: float,
    priors: Mapping[str, Prior] = NO_PRIORS,
    allowed: tuple[bool, ...] | None = None,
) -> int:
    """The candidate with the best estimate (the first one when nothing is known), of those
    `allowed` (per arm; the breaker's: those it judges) where any is: what a breaker probe runs."""
    candidates = [i for i in range(1, len(labels)) if allowed is None or allowed[i]] or list(range(1, len(labels)))
    post = beliefs(arms, labels, gate, now, priors)
    means = {i: post.mean(i) for i in candidates if post is not None and i in post.means}
    return max(candidates, key=lambda i: (i in means, means.get(i, 0.0), -i))


def _can_measure(arm: ArmEstimate | None, gate: GateConfig) -> bool:
    """An arm whose responses keep finishing without a sample stops claiming extra exploration."""
    return arm is None or arm.misses < gate.speed_max_misses


def _time_decay(gate: GateConfig, elapsed: float) -> float:
    return float(0.5 ** (max(0.0, elapsed) / gate.speed_half_life_s))
