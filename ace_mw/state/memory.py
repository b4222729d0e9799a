"""One process's state: the `StateStore` protocol and `InMemoryStateStore`.

Per key the state is a `TenantState` (decide/tenant.py: the breaker, the arm estimates, the plans
and the admission that decides from them). The controller talks to a `StateStore` only.
`InMemoryStateStore` keeps one `TenantState` per key in an LRU-capped OrderedDict behind one lock;
each call is a dict lookup plus an O(arms) step, so the critical section is tiny and never awaits
(safe from threads and from asyncio code alike). The store stores and pools (the priors across
tenants); it decides nothing.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from ..config import GateConfig
from ..decide.gate import Breaker, other_bands
from ..decide.load import Joining
from ..decide.prior import PriorPool, PriorView
from ..decide.samples import SpeedSample
from ..decide.speed import settled_candidates
from ..decide.tenant import Admission, ArmView, TenantState

BreakerKey = tuple[str, str]  # (hashed tenant, model or "")


class BreakerView(NamedTuple):
    """A read-only copy of one breaker, for telemetry and inspection."""

    state: str
    rolling_alpha: float | None
    samples: int
    trips: int
    open_until: float
    probes: int


class TenantView(NamedTuple):
    """One (tenant, model) as a status page shows it."""

    key: BreakerKey
    breaker: BreakerView
    arms: dict[str, ArmView]
    decisions: Mapping[str, int] = MappingProxyType({})  # the gates' verdicts by reason (see TenantState)
    unread: int = 0  # admissions whose response was not read (gate.max_measured_per_s)
    # (arm label, reason, speedup): where traffic outside exploration goes now (None: never admitted)
    chosen: tuple[str, str, float | None] | None = None


class StateStore(Protocol):
    def admit(
        self,
        key: BreakerKey,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        joinable: Joining | None = None,
    ) -> Admission:
        """The gates' verdict for one request; a probe must later be recorded or released.
        `joinable`: where a request on shared cores should join (decide/load.py)."""

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

    def admit(
        self,
        key: BreakerKey,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        joinable: Joining | None = None,
    ) -> Admission:
        with self._lock:
            return self._admit(self._touch(key, gate), key, arms, gate, now, bucket, joinable)

    def _admit(
        self,
        tenant: TenantState,
        key: BreakerKey,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        joinable: Joining | None = None,
    ) -> Admission:
        """`tenant.admit` with the priors of its model (under the lock), and the candidates its
        other temperature bands settled (speed.settled_candidates)."""
        pool = self._pool
        pool.refresh(gate, now)
        settled = partial(self._settled, key, arms, gate.temperature_bands) if gate.temperature_bands else frozenset
        priors = partial(pool.priors, key[0], key[1], arms)
        return tenant.admit(arms, gate, now, bucket, priors, pool.version, joinable, settled)

    def _settled(self, key: BreakerKey, arms: tuple[str, ...], bands: tuple[float, ...]) -> frozenset[str]:
        """The candidates the tenant of `key` settled on the same model in its other temperature
        bands (under the lock): its owed first sample is paid in whichever band comes first."""
        settled: frozenset[str] = frozenset()
        for model in other_bands(key[1], bands):
            other = self._tenants.get((key[0], model))
            if other is not None:
                settled |= settled_candidates(other.arms, self._pool.priors(key[0], model, arms), arms)
        return settled

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
    ) -> SpeedSample | None:
        """`tenant.record_speed`, and its model's prior contributions with it (under the lock); the
        sample as learnt. A band's sample may settle a candidate for the tenant's other bands on
        the model (speed.settled_candidates): their plans are made afresh."""
        learnt = tenant.record_speed(arm, sample, gate, now)
        self._pool.update(key[0], key[1], tenant.arms, gate, now)
        for model in other_bands(key[1], gate.temperature_bands):
            other = self._tenants.get((key[0], model))
            if other is not None:
                other.arms_changed()
        return learnt

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
