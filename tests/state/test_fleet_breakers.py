"""The fleet's breakers through RedisStateStore on a real redis-server (stores in one process stand
for replicas): a trip reaches replicas that track the tenant and those that never saw it, a
replica that joins late (after many trips, or after a sync that could not list a trip) gates
every tripped tenant from its first request, a close reaches replicas that only heard of the
trip, and probe slots are shared."""

from __future__ import annotations

import time

import pytest
from support.redis_fleet import ARMS, GATE, INTERVAL, KEY, flush, now, trip
from support.servers import wait_for

from ace_mw.config import GateConfig
from ace_mw.decide.gate import CLOSED, OPEN
from ace_mw.state import BREAKER_OPEN
from ace_mw.state.fleet import redis_key

redis = pytest.importorskip("redis")


def test_a_trip_reaches_a_replica_tracking_the_tenant_and_one_that_never_saw_it(fleet):
    a, b = fleet("a"), fleet("b")
    other = ("fedcba9876543210", "m")
    b.admit(KEY, ARMS, GATE, now(), 0.5)  # b tracks KEY; `other` it has never seen
    flush(a, b)
    trip(a)
    trip(a, other)
    pushed = a.health()["syncs"] + 2  # a's next full sync pushes the trips and lists them
    wait_for(lambda: a.health()["syncs"] >= pushed, timeout=5, what="a's push")
    since = b.health()["syncs"]
    wait_for(lambda: b.view(KEY).state == OPEN, timeout=5, what="the trip on b")
    # b's next full sync reads it: counted in syncs, not seconds, so a loaded machine cannot fail
    # it (the fleet's bound in seconds is test_fleet_replicas.py's)
    assert b.health()["syncs"] - since <= 2
    flush(b)
    assert b.admit(other, ARMS, GATE, now(), 0.9).reason == BREAKER_OPEN  # first sight, already gated
    assert b.view(other).open_until == pytest.approx(a.view(other).open_until, abs=0.2)
    healthy = ("00000000000000aa", "m")
    assert b.admit(healthy, ARMS, GATE, now(), 0.9).state == CLOSED


def test_a_replica_started_after_many_trips_gates_every_tripped_tenant_from_its_first_request(fleet):
    """The fleet's open breakers reach a replica that joins late: its first sync reads every
    tripped key there is (not the last N events of a stream), so no first request speculates for
    a tenant the fleet has tripped."""
    a = fleet("a")
    tenants = [(f"{i:016x}", "m") for i in range(1500)]
    for key in tenants:
        trip(a, key)
    flush(a)
    b = fleet("late")
    wait_for(lambda: b.health()["syncs"] >= 1, timeout=10, what="the late replica's first sync")
    for key in tenants[::50] + tenants[-3:]:
        assert b.admit(key, ARMS, GATE, now(), 0.9).reason == BREAKER_OPEN, key
    assert b.admit(("ffffffffffffffff", "m"), ARMS, GATE, now(), 0.9).state == CLOSED


def test_a_trip_the_index_could_not_list_reaches_a_late_replica_once_it_can(fleet, redis_server):
    """A sync that pushed a trip and then could not list it in the transitions index (Redis
    refuses the write: an ACL user without ZADD but on the replicas' set) lists it at a later
    sync, so a replica that joins then gates the tenant from its first request. Before, the trip
    was settled and never listed."""
    admin = redis.Redis.from_url(redis_server.url, decode_responses=True)
    admin.execute_command("ACL", "SETUSER", "a", "on", ">pw", "~*", "&*", "+@all", "-zadd", "(+zadd ~ace:replicas)")
    a = fleet("a", url=redis_server.url.replace("redis://", "redis://a:pw@"))
    trip(a)
    name = redis_key("ace", *KEY)
    wait_for(lambda: admin.hget(name, "st") == OPEN and a.health()["sync_errors"] > 0, timeout=10, what="a failed sync")
    assert admin.zscore("ace:transitions", name) is None
    admin.execute_command("ACL", "SETUSER", "a", "+zadd")
    wait_for(lambda: admin.zscore("ace:transitions", name) is not None, timeout=10, what="the trip listed")
    late = fleet("late")
    wait_for(lambda: late.health()["syncs"] >= 1, timeout=10, what="the late replica's first sync")
    assert late.admit(KEY, ARMS, GATE, now(), 0.9).reason == BREAKER_OPEN


def test_a_tenant_closed_by_the_fleet_is_not_gated_on_a_replica_that_only_heard_of_its_trip(fleet):
    gate = GateConfig(min_samples=4, cooldown_s=0.0, min_probe_samples=1, max_concurrent_probes=2)
    a, b = fleet("a"), fleet("b")
    for _ in range(gate.min_samples):
        a.admit(KEY, ARMS, gate, now(), 0.5)
        a.record(KEY, 0.05, probe=False, gate=gate, now=now())
    flush(a, b)  # b has heard of the trip, and tracks nothing
    assert b._fleet_open
    for _ in range(20):  # probe slots are leased from the fleet at a sync
        if a.admit(KEY, ARMS, gate, now(), 0.5).probe:
            break
        flush(a)
    else:
        raise AssertionError("no probe slot was ever leased")
    a.record(KEY, 0.95, probe=True, gate=gate, now=now())  # the probe closes it
    assert a.view(KEY).state == CLOSED
    flush(a, b)
    assert b.admit(KEY, ARMS, gate, now(), 0.5).state == CLOSED


def test_the_fleet_shares_probe_slots(fleet):
    """Eight replicas of a HALF_OPEN breaker, every request probe-eligible, no probe ever
    finishing: together they hold at most max_concurrent_probes, not eight times as many."""
    gate = GateConfig(min_samples=4, cooldown_s=0.0, max_concurrent_probes=2)
    stores = [fleet(f"r{i}") for i in range(8)]
    for store in stores:
        store.admit(KEY, ARMS, gate, now(), 0.5)
    flush(*stores)
    for _ in range(gate.min_samples):
        t = now()
        stores[0].admit(KEY, ARMS, gate, t, 0.5)
        stores[0].record(KEY, 0.05, probe=False, gate=gate, now=t)
    wait_for(lambda: all(s.view(KEY).trips == 1 for s in stores), timeout=5, what="every replica to see the trip")
    probes = 0
    deadline = now() + 12 * INTERVAL
    while now() < deadline:
        for store in stores:
            probes += store.admit(KEY, ARMS, gate, now(), 0.5).probe
        time.sleep(INTERVAL / 10)
    assert 1 <= probes <= gate.max_concurrent_probes
    assert sum(s.view(KEY).probes for s in stores) == probes
