"""The pooled prior: what the tenants on one model have measured of each arm, against plain decoding.

An arm's speed over plain decoding depends mostly on (model, arm, hardware), and every tenant on a
model measures it. So each tenant's current log speed ratio of an arm (`speed.own_ratio`) is one
contribution to the prior of (model, arm), and a new tenant decides from its first request on what
the others measured (`speed.beliefs` moves it to its own evidence as that comes in).

The prior is robust by construction, because any tenant can send anything:
- its centre is the weighted median of the tenants' log ratios, and its spread 1.4826 x their
  weighted median absolute deviation (the standard deviation, were they normal);
- a tenant weighs at most `gate.prior_tenant_weight` samples: one that floods the loop with
  samples, honest or absurd, is one bounded voice, and a median moves only when over half the
  weight does. An absurd figure from one tenant among several honest ones moves nothing;
- the spread is at least SPREAD_MIN, so that a tenant whose traffic differs leaves the prior in a
  few requests of its own (one sample weighs `LOG_RATIO_SD**-2`, the prior at most
  `SPREAD_MIN**-2`: about 1.4 samples), and SPREAD_FEW until three tenants agree or disagree;
- a tenant is never its own prior: a prior pooled from it alone is not offered to it;
- an arm without a prior of its own takes its family's (`family`: the same algorithm on the same
  pool, whatever its draft length or tree), which pools every tenant's best-measured arm of it.

Contributions age like the evidence they come from (`gate.speed_half_life_s`). A fleet shares
them through Redis (state/redis_store.py): every replica pools every tenant's contribution, also
those of tenants only other replicas serve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from ..config import GateConfig
from .load import base_arm, plain_at
from .speed import PLAIN, ArmEstimate, Prior, own_ratio

SPREAD_MIN = 0.25  # log-ratio spread below which no prior goes (see the module docstring)
SPREAD_FEW = 0.5  # the spread of a prior pooled from fewer than three tenants: not known yet, so wide
MAD_TO_SD = 1.4826
MIN_WEIGHT = 0.5  # a contribution decayed below this many samples no longer counts
# Recomputing a prior sorts its contributions: at once while few, at most once a second past this.
RECOMPUTE_AT_ONCE = 32
RECOMPUTE_EVERY_S = 1.0

PriorKey = tuple[str, str]  # (model or "", arm label)


class Contribution(NamedTuple):
    log_ratio: float
    samples: float  # the evidence it rested on when made
    at: float


class PriorView(NamedTuple):
    """One (model, arm) prior, as a status page shows it."""

    model: str
    arm: str
    speedup: float  # e ** mean: the pooled speed ratio to plain
    spread: float
    tenants: int
    samples: float


class PriorPool:
    """Contributions per (model, arm) and the priors pooled from them. Not thread-safe by itself:
    a store calls it under its own lock."""

    def __init__(self) -> None:
        self._contributions: dict[PriorKey, dict[str, Contribution]] = {}
        self._priors: dict[PriorKey, tuple[float, Prior | None]] = {}  # key -> (computed at, prior)
        self._dirty: set[PriorKey] = set()
        self._aged_at = -math.inf
        # For a fleet (state/redis_store.py): contributions changed here since the last share, and
        # those that came from the fleet (the tenants other replicas track).
        self.changed: set[tuple[PriorKey, str]] | None = None  # a shared store sets it to a set
        self._fleet: dict[PriorKey, set[str]] = {}
        self.version = 0  # goes up whenever a prior changes: plans built on the old one are stale

    def update(self, tenant: str, model: str, arms: Mapping[str, ArmEstimate], gate: GateConfig, now: float) -> None:
        """The tenant's estimates of its model's arms changed: refresh its contributions."""
        if not gate.prior_tenant_weight:
            return
        families: dict[str, tuple[float, float]] = {}
        candidates = [label for label in arms if base_arm(label)[0] != PLAIN]
        for label in candidates:  # each against plain decoding at the same load
            ratio = own_ratio(arms, label, gate, now, plain_at(label))
            self._set((model, label), tenant, ratio[:2] if ratio is not None else None, now)
            if ratio is not None:  # a tenant with two arms of a family speaks for it by the better-measured
                kin = family(label)
                if kin not in families or ratio.samples > families[kin][1]:
                    families[kin] = (ratio.log_ratio, ratio.samples)
        for kin in {family(label) for label in candidates}:
            self._set((model, kin), tenant, families.get(kin), now)

    def _set(self, key: PriorKey, tenant: str, ratio: tuple[float, float] | None, now: float) -> None:
        entries = self._contributions.get(key)
        self._fleet.get(key, set()).discard(tenant)  # measured here now
        if ratio is None:
            if entries is not None and entries.pop(tenant, None) is not None:
                self._dirty.add(key)
                if self.changed is not None:
                    self.changed.add((key, tenant))
            return
        if entries is None:
            entries = self._contributions[key] = {}
        entries[tenant] = Contribution(ratio[0], ratio[1], now)
        self._dirty.add(key)
        if self.changed is not None:
            self.changed.add((key, tenant))

    def contribution(self, key: PriorKey, tenant: str) -> Contribution | None:
        return self._contributions.get(key, {}).get(tenant)

    def models(self) -> set[str]:
        return {model for model, _ in self._contributions}

    def merge_fleet(self, model: str, shared: Mapping[tuple[str, str], Contribution]) -> None:
        """The fleet's contributions to `model`'s priors ((label, tenant) -> contribution, on the
        local clock): a tenant's newer figure wins, and one the fleet no longer holds goes, unless
        it was measured here since."""
        labels = {label for label, _ in shared} | {label for (m, label) in self._fleet if m == model}
        for label in labels:
            key = (model, label)
            entries = self._contributions.setdefault(key, {})
            remote = self._fleet.setdefault(key, set())
            for tenant in [t for t in remote if (label, t) not in shared]:
                entries.pop(tenant, None)
                remote.discard(tenant)
                self._dirty.add(key)
            for (kin, tenant), c in shared.items():
                if kin == label:
                    mine = entries.get(tenant)
                    if mine is None or (tenant in remote and mine != c) or mine.at < c.at:
                        entries[tenant] = c
                        remote.add(tenant)
                        self._dirty.add(key)

    def forget(self, tenant: str, model: str) -> None:
        """The tenant left the store (evicted): its contributions go with it."""
        for key, entries in self._contributions.items():
            if key[0] == model and entries.pop(tenant, None) is not None:
                self._dirty.add(key)

    def refresh(self, gate: GateConfig, now: float) -> None:
        """Recompute the priors whose contributions changed (at once while few, else at most once
        a second) or aged (every 1/16 of `gate.speed_half_life_s`). Cheap when nothing is due."""
        if now >= self._aged_at + gate.speed_half_life_s / 16:
            self._aged_at = now
            self._dirty.update(self._contributions)
        for key in [k for k in self._dirty if self._due(k, now)]:
            self._dirty.discard(key)
            entries = self._contributions.get(key, {})
            prior = pooled(entries, gate, now)
            before = self._priors.get(key)
            if before is None or prior != before[1]:
                self.version += 1
            if entries:
                self._priors[key] = (now, prior)
            else:
                self._contributions.pop(key, None)
                self._priors.pop(key, None)

    def priors(self, tenant: str, model: str, labels: tuple[str, ...]) -> dict[str, Prior]:
        """The priors of `labels` on `model` that `tenant` may decide on (by label), as of the last
        `refresh`."""
        found = {}
        for label in labels[1:]:
            for key in ((model, label), (model, family(label))):
                cached = self._priors.get(key)
                if cached is not None and cached[1] is not None and cached[1].sole != tenant:
                    found[label] = cached[1]
                    break
        return found

    def views(self) -> list[PriorView]:
        """Every prior there is, by (model, arm), as of the last `refresh`."""
        return [
            PriorView(model, arm, prior.ratio, prior.spread, prior.tenants, prior.weight)
            for (model, arm), (_, prior) in sorted(self._priors.items())
            if prior is not None
        ]

    def _due(self, key: PriorKey, now: float) -> bool:
        cached = self._priors.get(key)
        if cached is None or len(self._contributions.get(key, ())) <= RECOMPUTE_AT_ONCE:
            return True
        return now - cached[0] >= RECOMPUTE_EVERY_S


def family(label: str) -> str:
    """The arms an arm shares its speed with, most of it: the same algorithm on the same pool
    ("eagle_2/k5@fast" -> "eagle_2/*@fast"). Its prior stands in where the arm's own has none
    (EAGLE-2 with 5 or with 6 draft tokens)."""
    algorithm, _, rest = label.partition("/")
    pool = rest.rpartition("@")[2] if "@" in rest else ""
    return f"{algorithm}/*" + (f"@{pool}" if pool else "")


def pooled(entries: Mapping[str, Contribution], gate: GateConfig, now: float) -> Prior | None:
    """The prior of one (model, arm) from its tenants' contributions (see the module docstring)."""
    cap = gate.prior_tenant_weight
    voices = []
    for tenant, c in entries.items():
        weight = min(cap, c.samples * 0.5 ** (max(0.0, now - c.at) / gate.speed_half_life_s))
        if weight >= MIN_WEIGHT:
            voices.append((c.log_ratio, weight, tenant))
    if not voices:
        return None
    centre = weighted_median([(v, w) for v, w, _ in voices])
    if len(voices) < 3:
        spread = SPREAD_FEW
    else:
        deviation = weighted_median([(abs(v - centre), w) for v, w, _ in voices])
        spread = max(SPREAD_MIN, MAD_TO_SD * deviation)
    total = sum(w for _, w, _ in voices)
    return Prior(centre, spread, len(voices), total, voices[0][2] if len(voices) == 1 else None)


def weighted_median(values: list[tuple[float, float]]) -> float:
    """The lower weighted median of (value, weight) pairs: the smallest value at which the weight
    at or below it reaches half the total (the lower one, so that a tie between two voices leans to
    the slower figure, the cautious side)."""
    ordered = sorted(values)
    half = sum(w for _, w in ordered) / 2.0
    acc = 0.0
    for value, weight in ordered:
        acc += weight
        if acc >= half - 1e-12:
            return value
    return ordered[-1][0] if ordered else math.nan
