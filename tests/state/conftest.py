"""The fleet fixture of the Redis store's tests: stores standing for replicas on the test's Redis."""

from __future__ import annotations

import pytest
from support.redis_fleet import INTERVAL

from ace_mw.config import StateConfig


@pytest.fixture
def fleet(redis_server):
    """make(name) -> a started store on the test's Redis; all closed afterwards."""
    made: list = []

    from ace_mw.state.redis_store import RedisStateStore  # needs redis-py: only where a test asks

    def make(name: str, **config) -> RedisStateStore:
        config = {"url": redis_server.url, **config}
        state = StateConfig(backend="redis", sync_interval_s=INTERVAL, timeout_s=0.2, **config)
        store = RedisStateStore(state, replica=name)
        store.start()
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
