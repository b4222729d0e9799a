"""`RedisStateStore`: the state of a fleet of gateway replicas, pooled through one Redis.

Every decision reads this process's own `TenantState`s, exactly as `InMemoryStateStore` does: the
hot path never waits on Redis. Each (tenant, model) also keeps the samples it saw since its last
sync (fleet.py: a few decayed sums) and whether its breaker tripped or closed. A background thread
running an anyio event loop syncs every `sync_interval_s` (at once after a trip or close): it pushes
those samples and transitions to the key's Redis hash with a single-key Lua script (EVALSHA, batched
in pipelines, the script reloaded on NOSCRIPT), and takes back the fleet's merged state. A won
transition is also indexed in a sorted set of keys by the time of their last transition; every
sync reads what is new there (a replica's first sync reads it all, however long ago) and the
breaker state of those keys, so a trip reaches every replica, even one that has never seen the
tenant or started after the trip, within one interval plus a few round trips. Probe slots of OPEN breakers
are leased from the same hash, so the fleet as a whole sends `max_concurrent_probes` probes.

A thread rather than a task in the app's loop: one mechanism serves ASGI, gRPC aio and sync gRPC
servers alike, and no Redis stall or merge of thousands of keys can hold up the app's loop. It
starts when the controller is built (`start()`: with the app, whatever the app does with its
lifespan), again at once in a child forked from a process that syncs, never at a request; and
`close()` flushes what is not yet pushed. A replica's first decisions may wait for its first sync,
for `state.first_sync_wait_s` at most (`wait_synced`), and then go ahead on what it holds: a fresh
replica does not decide for a tenant the fleet has gated before it has read the fleet.

Faults: short connect/socket timeouts, no client retries, one attempt per backoff period (a breaker
around Redis: exponential with jitter, up to 10 s), a fresh connection after each failure. While
Redis is unreachable every replica decides on its own evidence (and its own probe slots), keeps the
samples it could not push, logs once per minute and counts; `health()` says since when. When Redis
returns the kept samples are pushed and merged like any others (sync_health.py).

Over 500 lines, on purpose: the hot path's overrides and the sync's steps (take, push, settle,
restore, requeue) share one lock and one set of due keys, and read as one protocol; the merge
arithmetic (fleet.py), a key's replica state (replica.py) and the sync's health (sync_health.py)
live apart.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from ..config import GateConfig, StateConfig
from ..decide.gate import CLOSED, OPEN
from ..decide.load import Joining
from ..decide.prior import Contribution
from ..decide.samples import SpeedSample
from ..decide.tenant import Admission, TenantState
from ..errors import StoreUnavailable
from .fleet import (
    ARM_SUMS,
    NO_TIME_DECAY,
    SYNC_SCRIPT,
    Evidence,
    Push,
    common_fields,
    parse_reply,
    redis_key,
)
from .memory import BreakerKey, BreakerView, InMemoryStateStore, breaker_view
from .redaction import describe, redact
from .replica import FleetEvent, FleetTenant
from .sync_health import SyncHealth

logger = logging.getLogger("ace_mw.state.fleet")

KEYS_PER_PIPELINE = 500
PIPELINES_PER_SYNC = 20  # a sync pushes at most 10,000 keys; the rest wait for the next one
TRANSITIONS_PER_SYNC = 10_000  # keys whose transition one sync reads; the rest, the next one
UNINDEXED_KEPT = 10_000  # won transitions kept for the index while it cannot be written
LOCK_SLICE = 64  # keys handled per hold of the store's lock during a sync
LEASE_SYNCS = 3  # a probe-slot lease lapses after this many sync intervals without renewal
MAX_MODELS = 64  # the most recently served models whose priors each sync reads

_SCRIPT_SHA = hashlib.sha1(SYNC_SCRIPT.encode()).hexdigest()


class RedisStateStore(InMemoryStateStore):
    """Decides locally, shares through Redis (see the module docstring and docs/operations.md).

    `clock` must be the controller's (the times it passes in); `replica` names this process in
    Redis (default: host, pid and a random suffix)."""

    def __init__(
        self, config: StateConfig, *, clock: Callable[[], float] = time.monotonic, replica: str | None = None
    ) -> None:
        super().__init__()
        if config.backend != "redis" or config.url is None:
            raise ValueError("RedisStateStore needs a state config with backend = 'redis' and a url")
        self.config = config
        self.replica = replica or f"{socket.gethostname()[:40]}-{os.getpid()}-{random.getrandbits(24):06x}"
        self._clock = clock
        self._url = config.url
        self._transitions_key = f"{config.prefix}:transitions"
        self._replicas_key = f"{config.prefix}:replicas"
        self._due: dict[BreakerKey, FleetTenant] = {}  # keys to sync: used or changed since the last sync
        self._by_name: dict[str, BreakerKey] = {}  # Redis hash -> tracked key
        self._fleet_open: OrderedDict[str, FleetEvent] = OrderedDict()  # open breakers of keys not tracked here
        self._gate = GateConfig()  # the last gate the hot path passed (the pushes use its decays)
        self._transitions_from = "-inf"  # Redis time from which the transitions index is read next
        # Keys whose transition this replica won and the index does not list yet (a sync that
        # failed after its pushes leaves them for the next): the late replicas read the index.
        self._unindexed: OrderedDict[str, None] = OrderedDict()
        self._pool.changed = set()  # prior contributions to share at the next sync
        self._models: OrderedDict[str, None] = OrderedDict()  # models served, most recent last
        # The sync thread (one per process: a forked child starts its own).
        self._start_lock = threading.Lock()
        self._pid = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: anyio.Event | None = None
        self._stopping = False
        self._closed = False  # closed on purpose: no restart in a forked child
        self._synced = threading.Event()  # the first sync of this process is over (done or failed)
        self._fork_hook = False
        self._sync_health = SyncHealth(config.url, config.sync_interval_s, clock)  # the sync thread writes it
        self.events_applied = 0
        self.events_published = 0
        self._last_keys = 0
        self._replicas: int | None = None

    # -- the hot path: local state only --------------------------------------------------------

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
            tenant = self._touch(key, gate)
            breaker = tenant.breaker
            if self._sync_health.degraded:
                breaker.probe_slots = None  # no leases while Redis is away: this process's own slots
            epoch = breaker.epoch
            admission = self._admit(tenant, key, arms, gate, now, bucket, joinable)
            self._used(key[1])
            if admission.state != CLOSED and not admission.probe and breaker.may_probe(gate, bucket):
                tenant.refused += 1
            changed = breaker.epoch != epoch
            if changed:
                self._transition(tenant)
            self._due[key] = tenant
            self._gate = gate
        if changed:
            self._wake_now()
        return admission

    def record(self, key: BreakerKey, alpha: float, *, probe: bool, gate: GateConfig, now: float) -> BreakerView:
        with self._lock:
            tenant = self._touch(key, gate)
            breaker = tenant.breaker
            epoch, samples = breaker.epoch, breaker.samples
            breaker.record(alpha, probe, gate, now)
            changed = breaker.epoch != epoch
            if changed:
                self._transition(tenant)
            elif breaker.samples != samples:  # the sample counted in this episode
                tenant.new_alpha.add((alpha,), gate.decay, NO_TIME_DECAY, now)
            self._due[key] = tenant
            view = breaker_view(breaker)
        if changed:
            self._wake_now()
        return view

    def record_speed(self, key: BreakerKey, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float) -> None:
        with self._lock:
            tenant = self._touch(key, gate)
            learnt = self._record_speed(tenant, key, arm, sample, gate, now)
            if learnt is not None:
                new = tenant.new_speed.get(arm)
                if new is None:
                    new = tenant.new_speed[arm] = Evidence.empty(ARM_SUMS)
                new.add(learnt.sums, gate.speed_decay, gate.speed_half_life_s, now)
            self._due[key] = tenant

    def _used(self, model: str) -> None:
        """`model` was just decided for: its priors are read at each sync (the MAX_MODELS most recent)."""
        self._models[model] = None
        self._models.move_to_end(model)
        while len(self._models) > MAX_MODELS:
            self._models.popitem(last=False)

    def _touch(self, key: BreakerKey, gate: GateConfig) -> FleetTenant:
        tenant = super()._touch(key, gate)
        assert isinstance(tenant, FleetTenant)
        return tenant

    def _transition(self, tenant: FleetTenant) -> None:
        """A trip or close here: the new episode starts from nothing; probe slots come from the
        fleet (none until leased) unless Redis is away."""
        tenant.new_alpha = Evidence.empty(1)
        tenant.breaker.probe_slots = None if self._sync_health.degraded or tenant.breaker.state == CLOSED else 0

    def _new_tenant(self, key: BreakerKey) -> FleetTenant:
        name = redis_key(self.config.prefix, *key)
        tenant = FleetTenant(key, name)
        self._by_name[name] = key
        event = self._fleet_open.pop(name, None)
        if event is not None:  # the fleet tripped it before this process saw it
            tenant.adopt_event(event)
        return tenant

    def _evicted(self, key: BreakerKey, tenant: TenantState) -> None:
        assert isinstance(tenant, FleetTenant)
        self._by_name.pop(tenant.name, None)
        self._due.pop(key, None)  # its unshared samples go with it: memory stays bounded

    # -- status --------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        now = self._clock()
        started = self._thread is not None and self._thread.is_alive()
        return {
            "backend": "redis",
            "url": redact(self._url),
            "replica": self.replica,
            **self._sync_health.report(started, now),
            "last_sync_keys": self._last_keys,
            "pending_keys": len(self._due),
            "tracked": len(self._tenants),
            "replicas": self._replicas,
            "events_applied": self.events_applied,
            "events_published": self.events_published,
        }

    # -- the sync thread -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise StoreUnavailable unless Redis answers a PING now (``state.required``: a typo in the
        host fails the deploy instead of running degraded)."""
        import redis

        timeout = max(self.config.timeout_s, 1.0)  # a first connection, not a sync's round trip
        client = redis.Redis.from_url(self._url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(
                f"state.required: Redis at {redact(self._url)} cannot be reached: {describe(exc, self._url)}"
            ) from None
        finally:
            client.close()

    def start(self) -> None:
        """Start the sync thread of this process (idempotent); a child forked from here starts its
        own at the fork."""
        with self._start_lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._stopping = self._closed = False
            self._thread = threading.Thread(target=self._thread_main, name="ace-mw-fleet-sync", daemon=True)
            self._thread.start()
            if not self._fork_hook:
                self._fork_hook = True
                store = weakref.ref(self)
                os.register_at_fork(after_in_child=lambda: _restart_in_child(store))

    @property
    def synced(self) -> bool:
        """Whether decisions go ahead: the first sync of this process is over (done, or failed:
        Redis is away and the replica decides on its own state), or a wait for it timed out."""
        return self._synced.is_set()

    def wait_synced(self, timeout_s: float) -> bool:
        """Until this process's first sync is over, `timeout_s` at most: whether it is. Decisions
        go ahead after it either way (one wait per process, then none)."""
        if self._synced.is_set():
            return True
        done = self._synced.wait(timeout_s)
        self._synced.set()
        return done

    def _after_fork(self) -> None:
        """In a forked child: the parent's sync thread did not come along; the locks may have been
        held by a thread that is gone. The child syncs afresh before its first decisions."""
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._synced = threading.Event()
        self._thread, self._loop, self._wake = None, None, None
        if self._pid and not self._closed:
            self.start()

    def close(self) -> None:
        """Stop syncing after one last push of what is pending (bounded by the timeouts)."""
        thread = self._thread
        if thread is None or self._pid != os.getpid():
            return
        self._stopping = self._closed = True
        self._wake_now()
        thread.join(self.config.sync_interval_s + 8 * self.config.timeout_s + 1.0)
        self._pid = 0

    def sync_now(self) -> None:
        """Ask the sync thread for a sync at once (it also runs every sync_interval_s)."""
        self._wake_now()

    def _wake_now(self) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._set_wake)
            except RuntimeError:  # the loop has closed
                pass

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _thread_main(self) -> None:
        anyio.run(self._run, backend="asyncio")

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        client: aioredis.Redis | None = None
        try:
            while True:
                self._wake = anyio.Event()
                started = self._clock()
                client = await self._cycle(client)
                if self._stopping:
                    return
                with anyio.move_on_after(max(0.0, self.config.sync_interval_s - (self._clock() - started))):
                    await self._wake.wait()
        finally:
            self._loop = None
            if client is not None:
                await _quietly_close(client)

    async def _cycle(self, client: aioredis.Redis | None) -> aioredis.Redis | None:
        """One sync, unless the breaker around Redis is open; returns the client to keep (None
        after a failure: the next attempt connects afresh)."""
        now = self._clock()
        if not self._sync_health.may_try(now) and not self._stopping:
            return client
        if client is None:
            client = self._connect()
        try:
            await self._sync(client)
        except Exception as exc:
            self._sync_health.failed(exc)
            await _quietly_close(client)
            return None
        finally:
            self._synced.set()
        self._sync_health.succeeded(self._clock() - now)
        return client

    def _connect(self) -> aioredis.Redis:
        timeout = self.config.timeout_s
        return aioredis.Redis.from_url(
            self._url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # never retry inside a call: the next sync is the retry
            decode_responses=True,
            health_check_interval=0,
        )

    async def _sync(self, client: aioredis.Redis) -> None:
        deadline = 4 * self.config.timeout_s  # per round trip; the socket timeouts bound each read
        wall = time.time()
        with anyio.fail_after(deadline):
            async with client.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.zadd(self._replicas_key, {self.replica: wall})
                pipe.zremrangebyscore(self._replicas_key, "-inf", wall - 60)
                pipe.zcount(self._replicas_key, wall - LEASE_SYNCS * self.config.sync_interval_s - 1, "+inf")
                pipe.expire(self._replicas_key, int(self.config.ttl_s))
                pipe.zrangebyscore(
                    self._transitions_key, self._transitions_from, "+inf", 0, TRANSITIONS_PER_SYNC, withscores=True
                )
                head = await pipe.execute()
        seconds, micros = head[0]
        redis_now = seconds + micros / 1e6
        offset = self._clock() - redis_now
        self._replicas = int(head[3])
        if head[5]:
            with anyio.fail_after(deadline):
                await self._read_transitions(client, head[5], offset)
        self._advance_transitions(head[5], redis_now)
        with self._lock:
            due, self._due = list(self._due.values()), {}
        keep = KEYS_PER_PIPELINE * PIPELINES_PER_SYNC
        self._requeue(due[keep:])  # over one sync's share: the next sync takes them
        chunks = [due[i : i + KEYS_PER_PIPELINE] for i in range(0, min(len(due), keep), KEYS_PER_PIPELINE)]
        keys = 0
        for n, chunk in enumerate(chunks):
            batch = self._take(chunk)
            keys += len(batch)
            try:
                with anyio.fail_after(deadline):
                    replies = await self._push(client, batch)
            except BaseException:
                self._restore(batch)
                self._requeue([tenant for later in chunks[n + 1 :] for tenant in later])
                raise
            self._unindexed.update(dict.fromkeys(self._settle(batch, replies)))
        self._last_keys = keys
        if self._unindexed:
            with anyio.fail_after(deadline):
                await self._index_transitions(client, offset, redis_now)
        with anyio.fail_after(deadline):
            await self._share_priors(client, offset)

    async def _index_transitions(self, client: aioredis.Redis, offset: float, redis_now: float) -> None:
        """List the transitions this replica won in the index, at the Redis time of now (the
        other replicas read it from a margin before their last read); kept for the next sync
        until the index has them, the most recent UNINDEXED_KEPT at most."""
        while len(self._unindexed) > UNINDEXED_KEPT:
            self._unindexed.popitem(last=False)
        names = list(self._unindexed)
        async with client.pipeline(transaction=False) as pipe:
            pipe.zadd(self._transitions_key, dict.fromkeys(names, self._clock() - offset))
            pipe.zremrangebyscore(self._transitions_key, "-inf", f"({redis_now - self.config.ttl_s!r}")
            pipe.expire(self._transitions_key, int(self.config.ttl_s))
            await pipe.execute()
        for name in names:
            self._unindexed.pop(name, None)
        self.events_published += len(names)

    async def _share_priors(self, client: aioredis.Redis, offset: float) -> None:
        """Push the prior contributions that changed here and read the fleet's, one hash per model
        (field `tenant|label`, value `log_ratio samples at`, at on the Redis clock): every replica's
        priors pool every tenant of the fleet, also those it never serves. `offset` is local -
        Redis clock."""
        with self._lock:
            pool = self._pool
            changed, pool.changed = pool.changed or set(), set()
            writes: dict[str, tuple[dict[Any, Any], list[str]]] = {}
            for (model, label), tenant in changed:
                put, drop = writes.setdefault(model, ({}, []))
                c = pool.contribution((model, label), tenant)
                field = f"{tenant}|{label}"
                if c is None:
                    drop.append(field)
                else:
                    put[field] = f"{c.log_ratio!r} {c.samples!r} {c.at - offset!r}"
            models = sorted(set(self._models) | set(writes))
        async with client.pipeline(transaction=False) as pipe:
            for model in models:
                name = self._prior_key(model)
                put, drop = writes.get(model, ({}, []))
                if put:
                    pipe.hset(name, mapping=put)
                if drop:
                    pipe.hdel(name, *drop)
                if put or drop:
                    pipe.expire(name, int(self.config.ttl_s))
                pipe.hgetall(name)
            try:
                replies = await pipe.execute()
            except BaseException:
                with self._lock:  # not shared: the next sync pushes them
                    pool.changed = (pool.changed or set()) | changed
                raise
        tables = [reply for reply in replies if isinstance(reply, dict)]
        oldest = self._clock() - self.config.ttl_s
        with self._lock:
            for model, table in zip(models, tables, strict=True):
                pool.merge_fleet(model, _contributions(table, offset, oldest))

    def _prior_key(self, model: str) -> str:
        digest = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
        return f"{self.config.prefix}:prior:{digest}"

    def _take(self, tenants: list[FleetTenant]) -> list[tuple[FleetTenant, Push]]:
        """The pushes of the tenants still tracked; the lock is held a slice at a time, so requests
        never wait long behind a large sync."""
        batch = []
        for i in range(0, len(tenants), LOCK_SLICE):
            with self._lock:
                gate, now = self._gate, self._clock()
                for tenant in tenants[i : i + LOCK_SLICE]:
                    if self._tenants.get(tenant.key) is tenant:
                        batch.append((tenant, tenant.take(gate, now)))
        return batch

    def _requeue(self, tenants: list[FleetTenant]) -> None:
        with self._lock:
            for tenant in tenants:
                if self._tenants.get(tenant.key) is tenant:
                    self._due[tenant.key] = tenant

    def _restore(self, batch: list[tuple[FleetTenant, Push]]) -> None:
        with self._lock:
            for tenant, push in batch:
                if self._tenants.get(tenant.key) is tenant:
                    tenant.restore(push, self._gate)
                    self._due[tenant.key] = tenant

    async def _push(self, client: aioredis.Redis, batch: list[tuple[FleetTenant, Push]]) -> list[Any]:
        """EVALSHA per key in one pipeline; keys whose script Redis does not have (NOSCRIPT: a
        restart or SCRIPT FLUSH) again after SCRIPT LOAD: NOSCRIPT means it did not run."""
        lease_s = LEASE_SYNCS * self.config.sync_interval_s + 4 * self.config.timeout_s
        common = common_fields(self.replica, self._gate, lease_s, self.config.ttl_s)
        now = self._clock()
        argv = [push.payload(now, common) for _, push in batch]
        replies: list[Any] = await _evalsha(client, [(t.name, a) for (t, _), a in zip(batch, argv, strict=True)])
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await client.script_load(SYNC_SCRIPT)
            again = await _evalsha(client, [(batch[i][0].name, argv[i]) for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    def _settle(self, batch: list[tuple[FleetTenant, Push]], replies: list[Any]) -> list[str]:
        """Each key's local state becomes the fleet's (parsed outside the lock, applied a slice at
        a time); the keys whose transition this replica won are returned for the index."""
        local_now = self._clock()
        parsed = [reply if isinstance(reply, Exception) else parse_reply(reply, local_now) for reply in replies]
        won = []
        for i in range(0, len(batch), LOCK_SLICE):
            with self._lock:
                gate = self._gate
                for (tenant, push), result in zip(batch[i : i + LOCK_SLICE], parsed[i : i + LOCK_SLICE], strict=True):
                    tracked = self._tenants.get(tenant.key) is tenant
                    if isinstance(result, Exception):
                        self._sync_health.key_failed(result)
                        if tracked:
                            tenant.restore(push, gate)
                            self._due[tenant.key] = tenant
                        continue
                    view = result
                    if tracked:
                        tenant.settle(push, view, gate)
                        if view.arms:  # the fleet's estimates of this tenant: its share of the priors
                            self._pool.update(tenant.key[0], tenant.key[1], tenant.arms, gate, local_now)
                    if view.accepted:
                        won.append(tenant.name)
        return won

    async def _read_transitions(self, client: aioredis.Redis, page: list[tuple[str, float]], offset: float) -> None:
        """The breakers of the keys whose transition the index lists since the last read: adopted
        by tracked keys that have not seen them; kept (open ones only, bounded) for keys this
        process may see later, and forgotten once closed."""
        names = list(dict.fromkeys(name for name, _ in page))
        states: list[Any] = []
        for i in range(0, len(names), KEYS_PER_PIPELINE):
            async with client.pipeline(transaction=False) as pipe:
                for name in names[i : i + KEYS_PER_PIPELINE]:
                    pipe.hmget(name, "e", "st", "tr", "cd", "ou")
                states += await pipe.execute()
        with self._lock:
            cap = self._gate.max_tracked_tenants
            for name, fields in zip(names, states, strict=True):
                try:
                    epoch, state, trips, cooldown, open_until = fields
                    event = FleetEvent(
                        int(float(epoch)),
                        OPEN if state == OPEN else CLOSED,
                        int(float(trips)),
                        float(cooldown),
                        float(open_until) + offset,
                    )
                except (TypeError, ValueError):  # expired since, or not one of ours under the prefix
                    self._fleet_open.pop(name, None)
                    continue
                key = self._by_name.get(name)
                tenant = self._tenants.get(key) if key is not None else None
                if not isinstance(tenant, FleetTenant):
                    if event.state == OPEN:
                        self._fleet_open[name] = event
                        self._fleet_open.move_to_end(name)
                        while len(self._fleet_open) > cap:
                            self._fleet_open.popitem(last=False)
                    else:
                        self._fleet_open.pop(name, None)
                elif event.epoch > tenant.fleet_epoch and tenant.breaker.epoch == tenant.synced_epoch:
                    tenant.adopt_event(event)
                    self._due[tenant.key] = tenant  # its next sync brings the evidence and probe slots
                    self.events_applied += 1

    def _advance_transitions(self, page: list[tuple[str, float]], redis_now: float) -> None:
        """Where the next read of the index starts: after a full page, at its last score (read
        again: ties); else a margin before now, since a transition is indexed by its winner up to
        a sync's round trips after the time it carries."""
        if len(page) >= TRANSITIONS_PER_SYNC:
            self._transitions_from = repr(float(page[-1][1]))
            return
        margin = 2 * self.config.sync_interval_s + 8 * self.config.timeout_s + 1.0
        start = redis_now - margin
        if self._transitions_from == "-inf" or float(self._transitions_from) < start:
            self._transitions_from = repr(start)


async def _evalsha(client: aioredis.Redis, calls: list[tuple[str, str]]) -> list[Any]:
    async with client.pipeline(transaction=False) as pipe:
        for name, payload in calls:
            pipe.evalsha(_SCRIPT_SHA, 1, name, payload)
        return list(await pipe.execute(raise_on_error=False))


async def _quietly_close(client: aioredis.Redis) -> None:
    try:
        with anyio.move_on_after(1.0):
            await client.aclose()
    except Exception:  # a broken connection has nothing left to close
        pass


def _contributions(table: dict[str, str], offset: float, oldest: float) -> dict[tuple[str, str], Contribution]:
    """A model's prior hash as contributions by (label, tenant), on the local clock; fields that
    do not parse (another version, a hand edit) or older than `oldest` are skipped."""
    out = {}
    for field, value in table.items():
        tenant, _, label = field.partition("|")
        try:
            log_ratio, samples, at = (float(x) for x in value.split())
        except ValueError:
            continue
        local_at = at + offset
        if label and math.isfinite(log_ratio) and 0 < samples < math.inf and local_at >= oldest:
            out[label, tenant] = Contribution(log_ratio, samples, local_at)
    return out


def _restart_in_child(store: weakref.ref[RedisStateStore]) -> None:
    found = store()
    if found is not None:
        found._after_fork()
