"""InMemoryStateStore: one breaker per (tenant, model), LRU-capped, each call alone under its lock."""

import threading
import time

from ace_mw import GateConfig, InMemoryStateStore
from ace_mw.decide import tenant as tenant_module
from ace_mw.decide.gate import CLOSED, Breaker

# The breaker alone (the speed policy has its own tests, core/test_speed.py and test_speed_loop.py).
GATE = GateConfig(policy="acceptance", alpha_floor=0.5, min_samples=3)
OUTSIDE = 0.5  # a sticky bucket above the probe share
ARMS = ("plain", "eagle_2/k5")


def test_store_evicts_the_least_recently_used_breaker():
    gate = GateConfig(max_tracked_tenants=2)
    store = InMemoryStateStore()
    for tenant in "aba":  # a is then the most recent
        store.admit((tenant, "m"), ARMS, gate, 0.0, 0.5)
    store.admit(("c", "m"), ARMS, gate, 0.0, 0.5)
    assert len(store) == 2
    assert store.view(("b", "m")) is None and store.view(("a", "m")) is not None


def test_store_keeps_one_breaker_per_tenant_and_model():
    store = InMemoryStateStore()
    for _ in range(GATE.min_samples):
        store.record(("a", "m1"), 0.0, probe=False, gate=GATE, now=0.0)
    assert store.admit(("a", "m1"), ARMS, GATE, 1.0, OUTSIDE).reason == "breaker_open"
    assert store.admit(("a", "m2"), ARMS, GATE, 1.0, OUTSIDE).reason == "ok"


def test_store_record_returns_the_updated_breaker():
    view = InMemoryStateStore().record(("a", "m"), 0.8, probe=False, gate=GATE, now=0.0)
    assert (view.state, view.rolling_alpha, view.samples) == (CLOSED, 0.8, 1)


def test_store_release_of_an_untracked_key_is_harmless():
    store = InMemoryStateStore()
    store.release(("nobody", ""))
    assert len(store) == 0


def test_store_runs_each_breaker_call_alone_under_concurrent_threads(monkeypatch):
    """The store's lock is all that keeps a breaker consistent: `Breaker` is not thread-safe, but
    its read-modify-writes (``samples += 1``) are a few bytecodes wide, so a plain stress test
    almost never sees two threads inside one (the old version passed 30 of 30 runs without the
    lock). This breaker yields the GIL in the middle of every call, so without the lock a second
    thread walks in (measured with the lock removed: 272 to 399 of the 400 calls overlapped
    another, in 10 of 10 runs); with it, none."""
    guard = threading.Lock()  # protects the counters below, not the breaker
    inside, overlaps = [0], [0]

    class YieldingBreaker(Breaker):
        def admit(self, *args):
            return self._alone(super().admit, args)

        def record(self, *args):
            return self._alone(super().record, args)

        def _alone(self, call, args):
            with guard:
                inside[0] += 1
                overlaps[0] += inside[0] > 1
            time.sleep(1e-4)  # another thread runs here unless the store keeps it out
            try:
                return call(*args)
            finally:
                with guard:
                    inside[0] -= 1

    monkeypatch.setattr(tenant_module, "Breaker", YieldingBreaker)  # where TenantState looks it up
    gate = GateConfig(policy="acceptance", min_samples=10**9)
    store = InMemoryStateStore()
    per_thread, threads = 50, 4

    def traffic():
        for _ in range(per_thread):
            probe = store.admit(("a", "m"), ARMS, gate, 0.0, OUTSIDE).probe
            store.record(("a", "m"), 1.0, probe=probe, gate=gate, now=0.0)

    workers = [threading.Thread(target=traffic) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert overlaps[0] == 0
    assert store.view(("a", "m")).samples == per_thread * threads
