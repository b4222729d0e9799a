"""The two gates in front of speculation: the request's temperature and the tenant's recent
acceptance rate.

The temperature gate is a pure function. The acceptance circuit breaker is one small state machine
per (tenant, model); it holds no lock and never awaits, so a `StateStore` can run each call inside
one short critical section (see state.py).

Breaker states:
- CLOSED: every request speculates; each response's alpha feeds an EMA. After `min_samples`
  responses an EMA below `alpha_floor` trips the breaker.
- OPEN: requests are gated for a cooldown (`cooldown_s`, multiplied by `cooldown_growth` on every
  consecutive trip, capped at `max_cooldown_s`), except a sticky `probe_fraction` of conversations,
  at most `max_concurrent_probes` at a time, so the estimate keeps learning.
- HALF_OPEN (after the cooldown): only probes pass, at most `max_concurrent_probes` in flight.
  Once `min_probe_samples` probe responses are in, an EMA >= `reenable_threshold` closes the
  breaker, anything lower opens it again with a longer cooldown (hysteresis: floor < re-enable).
The EMA restarts on every trip and on every close: OPEN and HALF_OPEN together are one probing
episode with one fresh estimate. Responses of requests admitted before a trip are ignored.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left
from functools import lru_cache
from typing import Any

from ..config import GateConfig
from ..vocabulary import Algorithm

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
UNCHECKED = "unchecked"  # the breaker was not consulted for this request
TEMPERATURE_SEPARATOR = "|T>"  # between a model and the temperature band its state is kept for
_MAX_FLOAT = sys.float_info.max

Admission = tuple[str, bool, bool]  # (state, admitted, probe)
_ALGORITHMS = frozenset(a.value for a in Algorithm)


def breaker_judges(arm: str, policy: str) -> bool:
    """Whether the acceptance of a response on the candidate `arm` (a label) feeds the tenant's
    breaker. Under the speed policy an arm that drafts for free (prompt lookup) is judged by its
    speed alone, and the breaker does not hold it back: its acceptance is low by nature (about 0.45
    on real vLLM pools while 1.2-1.5x faster than plain decoding, docs/benchmarks.md), and a draft
    it wastes costs next to nothing. The breaker guards the drafters whose drafts cost a forward
    pass each. Under `policy = "acceptance"` it judges every candidate: there is nothing else."""
    if policy != "speed":
        return True
    algorithm = arm.partition("/")[0]
    return not (algorithm in _ALGORITHMS and Algorithm(algorithm).drafts_for_free)


@lru_cache(maxsize=1024)
def judged_arms(arms: tuple[str, ...], policy: str) -> tuple[bool, ...]:
    """Per arm (plain decoding first): whether the breaker holds it back when open."""
    return tuple(i == 0 or breaker_judges(label, policy) for i, label in enumerate(arms))


@lru_cache(maxsize=1024)
def unjudged(arms: tuple[str, ...], judged: tuple[bool, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(the labels, the indices) of the arms an open breaker lets run: plain decoding and those it
    does not judge. The same tuple object for the same arguments, so a plan made for them is found
    again by identity."""
    kept = tuple(i for i, judges in enumerate(judged) if i == 0 or not judges)
    return tuple(arms[i] for i in kept), kept


def effective_temperature(raw: Any, default: float) -> float | None:
    """The temperature the engine will sample at, or None if the client sent an unusable one.

    Absent or null means the OpenAI API default (`default`, 1.0 unless configured). Booleans,
    strings, NaN, infinities and negatives are the client's error: the caller passes the request
    through ungated and lets the app reject it.
    """
    if type(raw) is float:  # the common case, in two comparisons (NaN fails both)
        return raw if 0.0 <= raw <= _MAX_FLOAT else None
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    try:
        value = float(raw)
    except OverflowError:  # an int too large for a float
        return None
    return value if math.isfinite(value) and value >= 0 else None


def state_model(model: str, temperature: float | None, bands: tuple[float, ...]) -> str:
    """The model as a tenant's state is keyed: itself for a request in the first temperature band
    (`gate.temperature_bands`: T <= 0.5 by default, and for any request without a usable
    temperature), `"<model>|T><bound>"` in the band above `bound`. Acceptance, and so whether a
    drafter pays, falls as a request samples hotter: a tenant that sends greedy requests and
    sampled ones has each learnt apart, and its prior pooled with other tenants' in the same band."""
    if temperature is None or not bands or temperature <= bands[0]:
        return model  # nearly every request: no work
    return _banded(model, bands[bisect_left(bands, temperature) - 1])


@lru_cache(maxsize=4096)
def other_bands(state: str, bands: tuple[float, ...]) -> tuple[str, ...]:
    """The states of `state`'s model in its other temperature bands (`state_model`)."""
    model = state.partition(TEMPERATURE_SEPARATOR)[0]
    return tuple(other for other in (model, *(_banded(model, bound) for bound in bands)) if other != state)


@lru_cache(maxsize=4096)
def _banded(model: str, bound: float) -> str:
    return f"{model}{TEMPERATURE_SEPARATOR}{bound:g}"


class Breaker:
    """Acceptance circuit breaker of one (tenant, model). O(1) per call; not thread-safe by itself."""

    __slots__ = (
        "state",
        "_weighted_sum",
        "_weight",
        "samples",
        "trips",
        "cooldown",
        "open_until",
        "probes",
        "_last_probe_at",
        "epoch",
        "probe_slots",
    )

    def __init__(self) -> None:
        self.state = CLOSED
        self._weighted_sum = 0.0  # EMA numerator and denominator: sum d^i * alpha_i, sum d^i
        self._weight = 0.0
        self.samples = 0  # responses since the last reset
        self.trips = 0  # consecutive trips without a successful close
        self.cooldown = 0.0  # length of the current/last OPEN period
        self.open_until = 0.0
        self.probes = 0  # probe requests in flight
        self._last_probe_at = 0.0
        self.epoch = 0  # episodes begun: +1 on every trip and every close (a shared store syncs on it)
        self.probe_slots: int | None = None  # probe slots this process holds; None: gate.max_concurrent_probes

    @property
    def rolling_alpha(self) -> float | None:
        """The bias-free EMA of alpha since the last reset (None before any sample)."""
        return self._weighted_sum / self._weight if self._weight else None

    def admit(self, gate: GateConfig, now: float, bucket: float) -> Admission:
        """Whether one request may speculate. `bucket` in [0, 1) is the request's sticky hash."""
        if self.state == CLOSED:
            return CLOSED, True, False
        self._advance(gate, now)
        if self.state == CLOSED:
            return CLOSED, True, False
        slots = gate.max_concurrent_probes if self.probe_slots is None else self.probe_slots
        if self.probes >= slots and now - self._last_probe_at > gate.probe_timeout_s:
            self.probes = 0  # those probes never reported back (lost responses): free the slots
        if self.may_probe(gate, bucket) and self.probes < slots:
            self.probes += 1
            self._last_probe_at = now
            return self.state, True, True
        return self.state, False, False

    def may_probe(self, gate: GateConfig, bucket: float) -> bool:
        """Whether a request of an OPEN or HALF_OPEN breaker is one that probes, slots permitting."""
        return self.state == HALF_OPEN or bucket < gate.probe_fraction

    def record(self, alpha: float, probe: bool, gate: GateConfig, now: float) -> None:
        """Feed one response's acceptance rate (probe: it was admitted as a probe)."""
        if probe:
            self.probes = max(0, self.probes - 1)
        self._advance(gate, now)
        if self.state == CLOSED:
            self._add(alpha, gate)
            if self.samples >= gate.min_samples and self._weighted_sum < gate.alpha_floor * self._weight:
                self._trip(gate, now)
        elif probe:
            self._add(alpha, gate)
            self._judge(gate, now)

    def release(self) -> None:
        """A probe finished without figures: free its slot, learn nothing."""
        self.probes = max(0, self.probes - 1)

    def episode(self) -> tuple[float, float, int]:
        """The current episode's evidence: (decayed sum of alphas, decayed weight, samples)."""
        return self._weighted_sum, self._weight, self.samples

    def adopt(
        self, state: str, trips: int, cooldown: float, open_until: float, evidence: tuple[float, float, int]
    ) -> None:
        """Take an episode decided elsewhere (a fleet's shared state): its state and evidence.
        Probes in flight and the epoch stay this process's own."""
        self.state, self.trips, self.cooldown, self.open_until = state, trips, cooldown, open_until
        self._weighted_sum, self._weight, self.samples = evidence

    def _add(self, alpha: float, gate: GateConfig) -> None:
        self._weighted_sum = self._weighted_sum * gate.decay + alpha
        self._weight = self._weight * gate.decay + 1.0
        self.samples += 1

    def _reset(self) -> None:
        self._weighted_sum = self._weight = 0.0
        self.samples = 0

    def _advance(self, gate: GateConfig, now: float) -> None:
        if self.state == OPEN and now >= self.open_until:
            self.state = HALF_OPEN
            self._judge(gate, now)  # probes taken while OPEN may already suffice

    def _judge(self, gate: GateConfig, now: float) -> None:
        if self.state != HALF_OPEN or self.samples < gate.min_probe_samples:
            return
        if self._weighted_sum >= gate.reenable_threshold * self._weight:
            self.state = CLOSED
            self.trips = 0
            self.epoch += 1
            self._reset()
        else:
            self._trip(gate, now)

    def _trip(self, gate: GateConfig, now: float) -> None:
        grown = self.cooldown * gate.cooldown_growth if self.trips else gate.cooldown_s
        self.cooldown = min(grown, gate.max_cooldown_s)
        self.trips += 1
        self.epoch += 1
        self.state = OPEN
        self.open_until = now + self.cooldown
        self._reset()
