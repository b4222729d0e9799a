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
from dataclasses import dataclass
from typing import NamedTuple

from ..acceptance import AcceptanceFigures
from ..config import GateConfig
from ..directive import PLAIN_ARM
from ..vocabulary import Reason

PLAIN = PLAIN_ARM  # the label of the plain-decoding arm (index 0 of every arm list)
OK = Reason.OK  # the best arm is speculative
SLOWER = Reason.SLOWER  # the best arm is plain decoding: speculation measured slower
EXPLORE = Reason.EXPLORE  # exploration traffic, sent to an arm that is not the best

# A decode speed outside these bounds is a broken figure, not a measurement.
MAX_TOKENS_PER_S = 1e6
MAX_DECODE_S = 24 * 3600.0


@dataclass(slots=True)
class SpeedSample:
    """One response's decode: `tokens` produced in `seconds` after the first token. Read-only by
    contract (a plain slots dataclass: one is built per measured response)."""

    tokens: float
    seconds: float
    source: str  # "engine" (reported by the engine) | "stream" (timed from the stream's chunks)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def checked_sample(tokens: float | None, seconds: float | None, source: str) -> SpeedSample | None:
    """A sample, or None when the figures are missing, non-finite, negative or absurd."""
    if tokens is None or seconds is None:
        return None
    if not (math.isfinite(tokens) and math.isfinite(seconds)) or tokens < 1 or not 0 < seconds <= MAX_DECODE_S:
        return None
    if tokens / seconds > MAX_TOKENS_PER_S:
        return None
    return SpeedSample(float(tokens), float(seconds), source)


class StreamTiming:
    """What one response showed of its own speed as it passed: when its token-bearing chunks went
    by (the first and the last) and the output token count its usage reported."""

    __slots__ = ("first", "last", "chunks", "usage_tokens")

    def __init__(self) -> None:
        self.first = 0.0
        self.last = 0.0
        self.chunks = 0
        self.usage_tokens: int | None = None

    def tick(self, now: float) -> None:
        if not self.chunks:
            self.first = now
        self.last = now
        self.chunks += 1


def response_sample(figures: AcceptanceFigures | None, timing: StreamTiming | None) -> tuple[SpeedSample | None, bool]:
    """(the response's decode-speed sample or None, whether an engine figure was garbage).

    The engine's own decode time wins; else the stream's timing: tokens after the first over the
    time from the first to the last token-bearing chunk (the prefill is before the first). Tokens
    come from the reported usage, else one per token-bearing chunk (exact for engines that stream
    one token per chunk)."""
    produced = figures.output_tokens if figures is not None else None
    if produced is None and timing is not None:
        produced = timing.usage_tokens
    garbage = False
    if figures is not None and figures.decode_seconds is not None:
        tokens = figures.decode_tokens if figures.decode_tokens is not None else _after_first(produced)
        sample = checked_sample(tokens, figures.decode_seconds, "engine")
        if sample is not None:
            return sample, False
        garbage = not (tokens is None or tokens < 1)  # a usable count with an unusable time
    if timing is not None and timing.chunks >= 2:
        tokens = _after_first(produced if produced is not None else timing.chunks)
        return checked_sample(tokens, timing.last - timing.first, "stream"), garbage
    return None, garbage


def _after_first(produced: int | None) -> int | None:
    return produced - 1 if produced is not None else None


class ArmEstimate:
    """Decayed decode-speed evidence of one arm. Not thread-safe by itself (see state.py)."""

    __slots__ = ("tokens", "seconds", "weight", "updated_at", "misses")

    def __init__(self) -> None:
        self.tokens = 0.0  # decayed sums of the samples' tokens and seconds
        self.seconds = 0.0
        self.weight = 0.0  # decayed number of samples
        self.updated_at = 0.0
        self.misses = 0  # responses in a row that gave no sample

    @property
    def rate(self) -> float | None:
        """Estimated tokens per second, or None before any sample."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    def evidence(self, gate: GateConfig, now: float) -> float:
        """How many samples the estimate is worth now (it loses weight while nothing arrives)."""
        if not self.weight:
            return 0.0
        return self.weight * _time_decay(gate, now - self.updated_at)

    def add(self, sample: SpeedSample, gate: GateConfig, now: float) -> None:
        keep = gate.speed_decay * _time_decay(gate, now - self.updated_at) if self.weight else 0.0
        self.tokens = self.tokens * keep + sample.tokens
        self.seconds = self.seconds * keep + sample.seconds
        self.weight = self.weight * keep + 1.0
        self.updated_at = max(now, self.updated_at)
        self.misses = 0

    def miss(self) -> None:
        """A response of this arm finished without a usable sample."""
        self.misses += 1


class Choice(NamedTuple):
    arm: int  # index into the arm labels: 0 is plain decoding
    reason: str  # OK | SLOWER | EXPLORE
    speedup: float | None  # estimated speed of the chosen arm over plain decoding, when both are measured


class ArmPlan(NamedTuple):
    """What `choose_arm` works out from the estimates before the request's own draw. It holds
    until a sample (or a miss) arrives, the config changes, or `valid_until`, when a measured arm's
    evidence decays below `speed_min_samples`: a tenant's requests share one plan until then, and
    its choices are built with it."""

    labels: tuple[str, ...]
    gate: GateConfig
    valid_until: float
    fraction: float  # the share of requests that explore
    exploited: Choice  # the arm outside exploration
    explored: tuple[Choice, ...]  # the arms exploration draws from

    def choose(self, bucket: float) -> Choice:
        """The arm for one request; `bucket` in [0, 1) is the request's sticky hash."""
        # The low bits of the bucket: independent of the high bits that canary and probe splits use.
        draw = (bucket * 4096.0) % 1.0
        explored, fraction = self.explored, self.fraction
        if explored and draw < fraction:
            return explored[int(draw / fraction * len(explored))]
        return self.exploited


def plan_arms(arms: Mapping[str, ArmEstimate], labels: tuple[str, ...], gate: GateConfig, now: float) -> ArmPlan:
    """The plan of `choose_arm` from the estimates now (`labels[0]` is PLAIN).

    Until some candidate is measured the first one runs, and nothing explores until it is measured:
    a new tenant starts speculating. Reason SLOWER means a candidate was measured and plain
    decoding beat it."""
    rates = _measured_rates(arms, labels, gate, now)
    best = fastest(rates, len(labels), gate.speed_margin)
    others = [i for i in range(len(labels)) if i != best]
    needy = [i for i in others if i not in rates and _can_measure(arms.get(labels[i]), gate)]
    if best not in rates and _can_measure(arms.get(labels[best]), gate):
        fraction, pool = 0.0, others  # measure the default arm first: there is nothing to compare with yet
    elif needy:
        fraction, pool = gate.explore_fraction_unmeasured, needy
    else:
        fraction, pool = gate.explore_fraction, others
    # Rates do not change between samples; evidence decays, and an arm stops counting as measured
    # when weight * 0.5 ** (elapsed / half_life) falls below speed_min_samples.
    valid_until = math.inf
    for i in rates:
        arm = arms[labels[i]]
        expiry = arm.updated_at + gate.speed_half_life_s * math.log2(arm.weight / gate.speed_min_samples)
        valid_until = min(valid_until, expiry)
    plain = rates.get(0)

    def choice(arm: int, reason: str) -> Choice:
        return Choice(arm, reason, rates[arm] / plain if plain and arm in rates else None)

    exploited = choice(best, SLOWER if best == 0 else OK)
    return ArmPlan(labels, gate, valid_until, fraction, exploited, tuple(choice(i, EXPLORE) for i in pool))


def choose_arm(
    arms: Mapping[str, ArmEstimate], labels: tuple[str, ...], gate: GateConfig, now: float, bucket: float
) -> Choice:
    """The arm for one request (see plan_arms, ArmPlan.choose)."""
    return plan_arms(arms, labels, gate, now).choose(bucket)


def best_candidate(arms: Mapping[str, ArmEstimate], labels: tuple[str, ...], gate: GateConfig, now: float) -> int:
    """The fastest measured speculative arm (the first candidate when none is measured)."""
    rates = _measured_rates(arms, labels, gate, now)
    return max(range(1, len(labels)), key=lambda i: (i in rates, rates.get(i, 0.0), -i))


def _measured_rates(
    arms: Mapping[str, ArmEstimate], labels: tuple[str, ...], gate: GateConfig, now: float
) -> dict[int, float]:
    rates = {}
    for i, label in enumerate(labels):
        arm = arms.get(label)
        if arm is not None and arm.rate is not None and arm.evidence(gate, now) >= gate.speed_min_samples:
            rates[i] = arm.rate
    return rates


def fastest(rates: Mapping[int, float], n_arms: int, margin: float) -> int:
    """The arm that traffic goes to outside exploration, from the measured `rates` (arm index ->
    tokens/s): the fastest measured candidate, unless plain decoding is measured and as fast
    (within the margin); with no candidate measured yet, the first one (speculation gets its chance)."""
    candidates = [i for i in rates if i]
    if not candidates:
        return 1 if n_arms > 1 else 0
    best = max(candidates, key=lambda i: (rates[i], -i))
    plain = rates.get(0)
    return 0 if plain is not None and rates[best] < plain * (1.0 + margin) else best


def _can_measure(arm: ArmEstimate | None, gate: GateConfig) -> bool:
    """An arm whose responses keep finishing without a sample stops claiming extra exploration."""
    return arm is None or arm.misses < gate.speed_max_misses


def _time_decay(gate: GateConfig, elapsed: float) -> float:
    return float(0.5 ** (max(0.0, elapsed) / gate.speed_half_life_s))
