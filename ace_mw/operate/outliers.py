"""Pools that fail are taken out of the loop's choices, as Envoy's outlier detection does.

Every response that ran on a named pool tells whether the pool served it: a refused connection, a
timeout or a 5xx answer (the gateway turns the first two into 502 and 504 answers of its own) is a
failure, anything else a success (a 4xx is the client's fault, not the pool's). After
`upstream.eject_after_failures` failures in a row the pool is ejected for `upstream.ejection_s`,
doubled at each ejection that follows another without a success between them, up to
`upstream.max_ejection_s`. When the time is up the pool is back, on probation: its next failure
ejects it again at once. A pool's probe answering (pools.py) brings an ejected pool back early.

The controller asks `ejected(pool)` for the pool of every decision it routes; with nothing ejected
that is one truth test of an empty dict.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import UpstreamConfig


@dataclass(slots=True)
class _Pool:
    failures: int = 0  # in a row
    ejections: int = 0  # in a row, without a success between them
    total_ejections: int = 0
    ejected_until: float = 0.0


class PoolHealth:
    """Per pool name: its failures in a row, whether and until when it is ejected. Thread-safe."""

    def __init__(self, config: Callable[[], UpstreamConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self._ejected: dict[str, float] = {}  # pool -> ejected until (only pools ejected now)

    def ejected(self, pool: str) -> bool:
        """Whether `pool` is out of the loop's choices now."""
        if not self._ejected:
            return False
        until = self._ejected.get(pool)
        if until is None:
            return False
        if self._clock() < until:
            return True
        with self._lock:  # time is up: back on probation
            if self._ejected.get(pool) == until:
                del self._ejected[pool]
        return False

    def record(self, pool: str, failed: bool) -> bool:
        """One response on `pool` ended (`failed`: the pool did not serve it). True when this
        ejected the pool."""
        config = self._config()
        with self._lock:
            entry = self._pools.get(pool)
            if entry is None:
                if not failed or len(self._pools) >= 64:  # pools come from the config: a handful
                    return False
                entry = self._pools[pool] = _Pool()
            if not failed:
                entry.failures = entry.ejections = 0
                return False
            entry.failures += 1
            on_probation = entry.ejections > 0 and pool not in self._ejected
            if pool in self._ejected or (entry.failures < config.eject_after_failures and not on_probation):
                return False
            entry.ejections += 1
            entry.total_ejections += 1
            period = min(config.max_ejection_s, config.ejection_s * 2 ** (entry.ejections - 1))
            entry.ejected_until = self._clock() + period
            self._ejected[pool] = entry.ejected_until
            return True

    def reinstate(self, pool: str) -> None:
        """The pool answered its probe: back in the loop's choices now, on probation."""
        with self._lock:
            self._ejected.pop(pool, None)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per pool that has failed: whether it is ejected, for how much longer, its failures in a
        row and its ejections so far."""
        now = self._clock()
        with self._lock:
            return {
                name: {
                    "ejected": name in self._ejected and now < entry.ejected_until,
                    "ejected_for_s": round(max(0.0, entry.ejected_until - now), 1) if name in self._ejected else 0.0,
                    "failures_in_a_row": entry.failures,
                    "ejections": entry.total_ejections,
                }
                for name, entry in self._pools.items()
            }
