"""One process's state: `TenantState` per (tenant, model), the `StateStore` protocol, and
`InMemoryStateStore`.

Per key the state is a `TenantState`: the acceptance circuit breaker (gate.py) and the decode-speed
estimates of every arm (speed.py). The controller talks to a `StateStore` only. `InMemoryStateStore`
keeps one `TenantState` per key in an LRU-capped OrderedDict behind one lock; each call is a dict
lookup plus an O(arms) step, so the critical section is tiny and never awaits (safe from threads and
from asyncio code alike).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from ..config import GateConfig
from ..decide.gate import Breaker
from ..decide.prior import PriorPool, PriorView
from ..decide.speed import (
    EXPLORE,
    NO_PRIORS,
    OK,
    PRIOR,
    SLOWER,
    ArmEstimate,
    ArmPlan,
    Prior,
    SpeedSample,
    best_candidate,
    plan_arms,
)
from ..vocabulary import Reason

BreakerKey = tuple[str, str]  # (hashed tenant, model or "")

BREAKER_OPEN = Reason.BREAKER_OPEN
PROBE = Reason.PROBE
# Admission reasons whose responses are read only within gate.max_measured_per_s (an exploring
# request beyond it runs the chosen arm instead); breaker probes are always read.
SAMPLED = (OK, SLOWER, PRIOR, EXPLORE, BREAKER_OPEN)


class Admission(NamedTuple):
    """What the gates decided for one request that passed the temperature gate."""

    state: str  # the breaker's state: "closed" | "open" | "half_open"
    arm: int  # index into the settings' arms: 0 is plain decoding, i >= 1 the i-th candidate
    reason: str  # "ok" | "slower" | "prior" | "explore" | "probe" | "breaker_open"
    probe: bool  # a breaker probe: its response must be recorded or released
    speedup: float | None  # estimated speed of the chosen arm over plain decoding
    measured: bool = True  # the response is read (figures, speed); else it passes unread


class BreakerView(NamedTuple):
    """A read-only copy of one breaker, for telemetry and inspection."""

    state: str
    rolling_alpha: float | None
    samples: int
    trips: int
    open_until: float
    probes: int


class ArmView(NamedTuple):
    """A read-only copy of one arm's speed estimate."""

    tokens_per_s: float | None
    samples: float  # decayed evidence, now
    age_s: float | None  # since its last sample (None before any)
    misses: int


class TenantView(NamedTuple):
    """One (tenant, model) as a status page shows it."""

    key: BreakerKey
    breaker: BreakerView
    arms: dict[str, ArmView]
    decisions: Mapping[str, int] = MappingProxyType({})  # the gates' verdicts by reason (see TenantState)
    unread: int = 0  # admissions whose response was not read (gate.max_measured_per_s)
    # (arm label, reason, speedup): where traffic outside exploration goes now (None: never admitted)
    chosen: tuple[str, str, float | None] | None = None


MAX_PLANS = 32  # plans kept per tenant: one per load the arms were at (decide/load.py)


class TenantState:
    """The breaker, the arm estimates and the gates' verdicts of one (tenant, model). Not
    thread-safe by itself."""

    __slots__ = (
        "breaker",
        "arms",
        "decisions",
        "plan",
        "plans",
        "plan_version",
        "labels",
        "reads",
        "reads_at",
        "unread",
    )

    def __init__(self) -> None:
        self.breaker = Breaker()
        self.arms: dict[str, ArmEstimate] = {}  # arm label -> estimate (labels survive config reloads)
        # reason -> admissions ("ok", "slower", "explore", "probe", "breaker_open"): a handful of
        # keys, kept and evicted with the tenant, so bounded by the same LRU cap
        self.decisions: dict[str, int] = {}
        self.plan: ArmPlan | None = None  # the speed policy's last plan, shared by requests until it goes stale
        # The plans of the arms at each load (decide/load.py: the same arms at other bands are
        # other labels); the same version and staleness rules as `plan`.
        self.plans: dict[tuple[str, ...], ArmPlan] = {}
        self.plan_version = -1  # the prior pool's version the plans were built with
        self.labels: tuple[str, ...] = ()  # the arms of the last admission (the status page's plan)
        # A token bucket of responses to read (gate.max_measured_per_s, one second's worth deep).
        self.reads = math.inf  # a new key starts full
        self.reads_at = 0.0
        self.unread = 0  # admissions whose response was not read

    def arms_changed(self) -> None:
        """An arm's estimate changed (a sample, a miss, the fleet's view): plan afresh."""
        self.plan = None
        self.plans.clear()

    def admit(
        self,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        priors: Callable[[], Mapping[str, Prior]] = lambda: NO_PRIORS,
        version: int = 0,
    ) -> Admission:
        """The breaker first (a collapse of acceptance wins), then the speed policy, then whether
        the response is read. `priors()` gives the pooled priors of the arms, `version` says
        whether they changed since the plan was made."""
        state, admitted, probe = self.breaker.admit(gate, now, bucket)
        self.labels = arms
        speedup = None
        reason: str
        if not admitted:
            arm, reason = 0, BREAKER_OPEN
        elif probe:
            arm, reason = best_candidate(self.arms, arms, gate, now, priors()), PROBE
        elif gate.policy == "acceptance":
            arm, reason = 1, OK
        else:
            plan = self.plan
            if plan is None or plan.labels is not arms:
                plan = self.plans.get(arms)
            if plan is None or plan.gate is not gate or now >= plan.valid_until or self.plan_version != version:
                if self.plan_version != version or len(self.plans) >= MAX_PLANS:
                    self.plans.clear()
                plan = self.plans[arms] = plan_arms(self.arms, arms, gate, now, priors())
                self.plan_version = version
            self.plan = plan
            arm, reason, speedup = plan.choose(bucket)
        measured = True
        if reason in SAMPLED and not self.take_read(gate.max_measured_per_s, now):
            if reason == EXPLORE and self.plan is not None:
                # Exploring without reading would run a slower arm for nothing: run the chosen one.
                arm, reason, speedup = self.plan.exploited
            measured = False
            self.unread += 1
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        return Admission(state, arm, reason, probe, speedup, measured)

    def chosen(self, gate: GateConfig, now: float, priors: Mapping[str, Prior]) -> tuple[str, str, float | None] | None:
        """(arm label, reason, speedup) of where the last admission's arms send traffic outside
        exploration now; None before any admission."""
        if not self.labels:
            return None
        arm, reason, speedup = plan_arms(self.arms, self.labels, gate, now, priors).exploited
        return self.labels[arm], reason, speedup

    def take_read(self, rate: float, now: float) -> bool:
        """Whether the response of a request admitted at `now` is read: at most `rate` per second,
        bursts up to one second's worth, evenly spaced under steady load (so the reads of a busy
        key spread over time rather than bunching at the start of each second)."""
        if rate == math.inf:
            return True
        reads = min(max(rate, 1.0), self.reads + (now - self.reads_at) * rate)
        self.reads_at = now
        if reads >= 1.0:
            self.reads = reads - 1.0
            return True
        self.reads = reads
        return False

    def record_speed(self, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float) -> None:
        estimate = self.arms.get(arm)
        if estimate is None:
            estimate = self.arms[arm] = ArmEstimate()
        if sample is None:
            estimate.miss()
        else:
            estimate.add(sample, gate, now)
        self.arms_changed()

    def arm_views(self, gate: GateConfig, now: float) -> dict[str, ArmView]:
        return {
            label: ArmView(a.rate, a.evidence(gate, now), now - a.updated_at if a.weight else None, a.misses)
            for label, a in self.arms.items()
        }


class StateStore(Protocol):
    def admit(self, key: BreakerKey, arms: tuple[str, ...], gate: GateConfig, now: float, bucket: float) -> Admission:
        """The gates' verdict for one request; a probe must later be recorded or released."""

    def record(self, key: BreakerKey, alpha: float, *, probe: bool, gate: GateConfig, now: float) -> BreakerView:
        """Feed one response's acceptance rate; returns the breaker after the update."""

    def release(self, key: BreakerKey) -> None:
        """A probe finished without figures."""

    def record_speed(self, key: BreakerKey, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float) -> None:
        """Feed one response's decode speed to the arm that served it (None: it gave no figure)."""

    def view(self, key: BreakerKey) -> BreakerView | None:
        """The breaker of `key`, or None if it is not tracked."""

    def arm_views(self, key: BreakerKey, gate: GateConfig, now: float) -> dict[str, ArmView]:
        """The speed estimate of every arm of `key` that has served a response."""

    def snapshot(self, gate: GateConfig, now: float, limit: int = 100) -> list[TenantView]:
        """The `limit` most recently used keys, most recent first (for status pages)."""

    def priors(self, gate: GateConfig, now: float) -> list[PriorView]:
        """The pooled prior of every (model, arm) some tenant measured (for status pages)."""

    def health(self) -> dict[str, Any]:
        """What the store says about itself: backend, tracked keys, and for a shared store its
        connection state and the age of its fleet view."""

    def start(self) -> None:
        """Begin any background work (a shared store's sync); idempotent. The controller starts its
        store when it is built."""

    @property
    def synced(self) -> bool:
        """Whether decisions go ahead: this process holds the fleet's state (a shared store's
        first sync is over) or a wait for it timed out. Always, for a store that shares nothing."""

    def wait_synced(self, timeout_s: float) -> bool:
        """Until this process holds the fleet's state, `timeout_s` at most; whether it does.
        Decisions go ahead after it either way. True at once for a store that shares nothing."""

    def close(self) -> None:
        """Stop background work, flushing what is not yet shared; idempotent."""


class InMemoryStateStore:
    """Process-local state; the least recently used key is evicted past `gate.max_tracked_tenants`."""

    def __init__(self) -> None:
        self._tenants: OrderedDict[BreakerKey, TenantState] = OrderedDict()
        # Every call reads and writes several fields of one TenantState (a probe slot taken, an EMA
        # updated, an LRU entry moved): without the lock two threads interleave those steps.
        self._lock = threading.Lock()
        self._pool = PriorPool()  # the tenants' evidence pooled per (model, arm)

    def __len__(self) -> int:
        return len(self._tenants)

    def admit(self, key: BreakerKey, arms: tuple[str, ...], gate: GateConfig, now: float, bucket: float) -> Admission:
        with self._lock:
            return self._admit(self._touch(key, gate), key, arms, gate, now, bucket)

    def _admit(
        self, tenant: TenantState, key: BreakerKey, arms: tuple[str, ...], gate: GateConfig, now: float, bucket: float
    ) -> Admission:
        """`tenant.admit` with the priors of its model (under the lock)."""
        pool = self._pool
        pool.refresh(gate, now)
        return tenant.admit(arms, gate, now, bucket, lambda: pool.priors(key[0], key[1], arms), pool.version)

    def record(self, key: BreakerKey, alpha: float, *, probe: bool, gate: GateConfig, now: float) -> BreakerView:
        with self._lock:
            breaker = self._touch(key, gate).breaker
            breaker.record(alpha, probe, gate, now)
            return breaker_view(breaker)

    def release(self, key: BreakerKey) -> None:
        with self._lock:
            tenant = self._tenants.get(key)
            if tenant is not None:
                tenant.breaker.release()

    def record_speed(self, key: BreakerKey, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float) -> None:
        with self._lock:
            self._record_speed(self._touch(key, gate), key, arm, sample, gate, now)

    def _record_speed(
        self, tenant: TenantState, key: BreakerKey, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float
    ) -> None:
        """`tenant.record_speed`, and its model's prior contributions with it (under the lock)."""
        tenant.record_speed(arm, sample, gate, now)
        self._pool.update(key[0], key[1], tenant.arms, gate, now)

    def view(self, key: BreakerKey) -> BreakerView | None:
        with self._lock:
            tenant = self._tenants.get(key)
            return None if tenant is None else breaker_view(tenant.breaker)

    def arm_views(self, key: BreakerKey, gate: GateConfig, now: float) -> dict[str, ArmView]:
        with self._lock:
            tenant = self._tenants.get(key)
            return {} if tenant is None else tenant.arm_views(gate, now)

    def snapshot(self, gate: GateConfig, now: float, limit: int = 100) -> list[TenantView]:
        with self._lock:
            recent = list(itertools.islice(reversed(self._tenants.items()), limit))
            self._pool.refresh(gate, now)
            return [
                TenantView(
                    key,
                    breaker_view(t.breaker),
                    t.arm_views(gate, now),
                    dict(t.decisions),
                    t.unread,
                    t.chosen(gate, now, self._pool.priors(key[0], key[1], t.labels)),
                )
                for key, t in recent
            ]

    def priors(self, gate: GateConfig, now: float) -> list[PriorView]:
        with self._lock:
            self._pool.refresh(gate, now)
            return self._pool.views()

    def health(self) -> dict[str, Any]:
        return {"backend": "memory", "tracked": len(self._tenants)}

    def start(self) -> None:
        pass  # nothing runs in the background

    @property
    def synced(self) -> bool:
        return True  # there is no fleet to read

    def wait_synced(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass

    def _touch(self, key: BreakerKey, gate: GateConfig) -> TenantState:
        tenant = self._tenants.get(key)
        if tenant is not None:
            self._tenants.move_to_end(key)
            return tenant
        tenant = self._tenants[key] = self._new_tenant(key)
        while len(self._tenants) > gate.max_tracked_tenants:
            gone, state = self._tenants.popitem(last=False)
            self._pool.forget(*gone)
            self._evicted(gone, state)
        return tenant

    def _new_tenant(self, key: BreakerKey) -> TenantState:
        """A key seen for the first time (a shared store seeds it from what the fleet knows)."""
        return TenantState()

    def _evicted(self, key: BreakerKey, tenant: TenantState) -> None:
        """The least recently used key left the cap (a shared store forgets its index entry)."""


def breaker_view(breaker: Breaker) -> BreakerView:
    return BreakerView(
        breaker.state, breaker.rolling_alpha, breaker.samples, breaker.trips, breaker.open_until, breaker.probes
    )
