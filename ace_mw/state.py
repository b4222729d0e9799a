"""Where breaker state lives: a pluggable store keyed by (tenant, model).

The controller talks to a `StateStore` only. `InMemoryStateStore` keeps one `Breaker` per key in an
LRU-capped OrderedDict behind one lock; each call is a dict lookup plus an O(1) breaker step, so
the critical section is tiny and never awaits (safe from threads and from asyncio code alike).
A shared store (e.g. for a fleet of gateways) implements the same four methods.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Protocol

from .config import GateConfig
from .gate import Admission, Breaker

BreakerKey = tuple[str, str]  # (hashed tenant, model or "")


class BreakerView(NamedTuple):
    """A read-only copy of one breaker, for telemetry and inspection."""

    state: str
    rolling_alpha: float | None
    samples: int
    trips: int
    open_until: float
    probes: int


class StateStore(Protocol):
    def admit(self, key: BreakerKey, gate: GateConfig, now: float, bucket: float) -> Admission:
        """(state, admitted, probe) for one request; a probe must later be recorded or released."""

    def record(self, key: BreakerKey, alpha: float, *, probe: bool, gate: GateConfig, now: float) -> BreakerView:
        """Feed one response's acceptance rate; returns the breaker after the update."""

    def release(self, key: BreakerKey) -> None:
        """A probe finished without figures."""

    def view(self, key: BreakerKey) -> BreakerView | None:
        """The breaker of `key`, or None if it is not tracked."""


class InMemoryStateStore:
    """Process-local breakers; the least recently used is evicted past `gate.max_tracked_tenants`."""

    def __init__(self) -> None:
        self._breakers: OrderedDict[BreakerKey, Breaker] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._breakers)

    def admit(self, key: BreakerKey, gate: GateConfig, now: float, bucket: float) -> Admission:
        with self._lock:
            return self._touch(key, gate).admit(gate, now, bucket)

    def record(self, key: BreakerKey, alpha: float, *, probe: bool, gate: GateConfig, now: float) -> BreakerView:
        with self._lock:
            breaker = self._touch(key, gate)
            breaker.record(alpha, probe, gate, now)
            return _view(breaker)

    def release(self, key: BreakerKey) -> None:
        with self._lock:
            breaker = self._breakers.get(key)
            if breaker is not None:
                breaker.release()

    def view(self, key: BreakerKey) -> BreakerView | None:
        with self._lock:
            breaker = self._breakers.get(key)
            return None if breaker is None else _view(breaker)

    def _touch(self, key: BreakerKey, gate: GateConfig) -> Breaker:
        breaker = self._breakers.get(key)
        if breaker is not None:
            self._breakers.move_to_end(key)
            return breaker
        breaker = self._breakers[key] = Breaker()
        while len(self._breakers) > gate.max_tracked_tenants:
            self._breakers.popitem(last=False)
        return breaker


def _view(breaker: Breaker) -> BreakerView:
    return BreakerView(
        breaker.state, breaker.rolling_alpha, breaker.samples, breaker.trips, breaker.open_until, breaker.probes
    )
