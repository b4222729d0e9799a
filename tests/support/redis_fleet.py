"""What the tests of RedisStateStore share (state/test_redis_store.py, state/test_fleet_breakers.py):
a gate that trips in four samples, a tenant, syncs waited for, a trip."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ace_mw.config import GateConfig
from ace_mw.decide.gate import OPEN
from ace_mw.decide.samples import SpeedSample
from support.servers import wait_for

if TYPE_CHECKING:  # redis-py: the tests that need it skip without it
    from ace_mw.state.redis_store import RedisStateStore

INTERVAL = 0.1
GATE = GateConfig(min_samples=4, cooldown_s=30.0, max_concurrent_probes=2, speed_half_life=4)
ARMS = ("plain", "eagle_2/k5")
KEY = ("0123456789abcdef", "m")


def flush(*stores: RedisStateStore) -> None:
    """Two full syncs of each store after this call (one may have been under way already)."""
    for store in stores:
        target = store.health()["syncs"] + 2
        wait_for(lambda s=store, t=target: s.sync_now() or s.health()["syncs"] >= t, timeout=10, what="two syncs")


def now() -> float:
    return time.monotonic()


def sample(tokens: float, seconds: float) -> SpeedSample:
    return SpeedSample(tokens, seconds, "stream")


def trip(store: RedisStateStore, key=KEY) -> float:
    """Feed `key` collapsing acceptance through `store` until its breaker trips; the trip's time."""
    for _ in range(GATE.min_samples):
        t = now()
        store.admit(key, ARMS, GATE, t, 0.5)
        store.record(key, 0.05, probe=False, gate=GATE, now=t)
    assert store.view(key).state == OPEN
    return now()
