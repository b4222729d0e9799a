"""RedisStateStore against a real redis-server: several stores in one process stand for replicas
(each with its own sync thread and connection). The Lua merge equals the Python one, nothing is
counted twice, priors pool every replica's tenants, NOSCRIPT and TTLs are handled, and Redis
killed, hung or restarted empty never delays a decision while what was learnt meanwhile is merged
back. The fleet's breakers are in test_fleet_breakers.py, black-box tests through two uvicorn
processes in test_fleet_replicas.py."""

from __future__ import annotations

import logging
import signal
import time

import httpx
import pytest
from support.servers import wait_for

from ace_mw.state.fleet import NO_TIME_DECAY, Evidence, fold, redis_key

redis = pytest.importorskip("redis")
from support.redis_fleet import ARMS, GATE, INTERVAL, KEY, flush, now, sample  # noqa: E402

from ace_mw.state.redis_store import RedisStateStore  # noqa: E402


def test_pooled_estimates_are_the_python_merge_of_every_replicas_samples(fleet, redis_server):
    a, b = fleet("a"), fleet("b")
    expected_arm, expected_alpha = Evidence.empty(2), Evidence.empty(1)
    for store, samples in ((a, [(100, 1.0), (120, 1.0), (90, 1.5)]), (b, [(40, 1.0), (60, 2.0)])):
        batch_arm, batch_alpha = Evidence.empty(2), Evidence.empty(1)
        for tokens, seconds in samples:
            t = now()
            store.admit(KEY, ARMS, GATE, t, 0.5)
            store.record(KEY, tokens / 200, probe=False, gate=GATE, now=t)
            store.record_speed(KEY, ARMS[1], sample(tokens, seconds), GATE, t)
            batch_arm.add((tokens, seconds), GATE.speed_decay, GATE.speed_half_life_s, t)
            batch_alpha.add((tokens / 200,), GATE.decay, NO_TIME_DECAY, t)
        expected_arm = fold(expected_arm, batch_arm, GATE.speed_decay, GATE.speed_half_life_s)
        expected_alpha = fold(expected_alpha, batch_alpha, GATE.decay, NO_TIME_DECAY)
        flush(store)  # a's batch lands before b's
    for store in (a, b):  # a key is refreshed while it is in use: one more request each
        store.admit(KEY, ARMS, GATE, now(), 0.5)
    flush(a, b)
    for store in (a, b):
        arm = store.arm_views(KEY, GATE, now())[ARMS[1]]
        assert arm.tokens_per_s == pytest.approx(expected_arm.sums[0] / expected_arm.sums[1], rel=1e-4)
        view = store.view(KEY)
        assert view.samples == 5
        assert view.rolling_alpha == pytest.approx(expected_alpha.sums[0] / expected_alpha.weight, rel=1e-9)
    fields = redis.Redis.from_url(redis_server.url, decode_responses=True).hgetall(redis_key("ace", *KEY))
    assert fields["n:" + ARMS[1]] == "5" and fields["bn"] == "5"
    assert float(fields["w:" + ARMS[1]]) == pytest.approx(expected_arm.weight, rel=1e-4)


def test_a_replicas_own_samples_count_once_across_many_syncs(fleet, redis_server):
    a, b = fleet("a"), fleet("b")
    for i in range(8):
        t = now()
        a.admit(KEY, ARMS, GATE, t, 0.5)
        a.record(KEY, 0.9, probe=False, gate=GATE, now=t)
        a.record_speed(KEY, "plain", sample(50, 1.0), GATE, t)
        if i % 2:
            flush(a)
    flush(a, b)
    b.admit(KEY, ARMS, GATE, now(), 0.5)
    flush(b)
    assert a.view(KEY).samples == b.view(KEY).samples == 8
    fields = redis.Redis.from_url(redis_server.url, decode_responses=True).hgetall(redis_key("ace", *KEY))
    assert fields["n:plain"] == "8"


def test_the_prior_pools_tenants_that_only_other_replicas_serve(fleet, redis_server):
    """Tenants measured on replica a teach a new tenant on replica b, which never served them."""
    a, b = fleet("a"), fleet("b")
    for veteran in ("1111111111111111", "2222222222222222", "3333333333333333"):
        for _ in range(5):
            t = now()
            a.record_speed((veteran, "m"), "plain", sample(100, 1.0), GATE, t)
            a.record_speed((veteran, "m"), ARMS[1], sample(50, 1.0), GATE, t)
    b.admit(("5555555555555555", "m"), ARMS, GATE, now(), 0.5)  # b serves the model: it reads its priors
    flush(a, b)
    shared = {(p.model, p.arm): p for p in b.priors(GATE, now())}
    assert shared["m", ARMS[1]].tenants == 3 and shared["m", ARMS[1]].speedup == pytest.approx(0.5)
    first = b.admit(("4444444444444444", "m"), ARMS, GATE, now(), 0.999 / 4096)
    assert (first.arm, first.reason) == (0, "prior")
    # one tenant's figure changes on a: b follows; the hash holds one field per (tenant, arm)
    for _ in range(20):
        a.record_speed(("1111111111111111", "m"), ARMS[1], sample(400, 1.0), GATE, now())
    flush(a, b)
    fields = redis.Redis.from_url(redis_server.url, decode_responses=True).hgetall(b._prior_key("m"))
    assert len(fields) == 6  # 3 tenants x (the arm, its family)
    assert {(p.model, p.arm): p for p in b.priors(GATE, now())}["m", ARMS[1]].speedup == pytest.approx(0.5)


def test_a_flushed_script_cache_is_reloaded(fleet, redis_server):
    a = fleet("a")
    a.record_speed(KEY, "plain", sample(50, 1.0), GATE, now())
    flush(a)
    client = redis.Redis.from_url(redis_server.url)
    client.script_flush()
    a.record_speed(KEY, "plain", sample(50, 1.0), GATE, now())
    flush(a)
    assert a.health()["key_errors"] == 0 and a.health()["sync_errors"] == 0
    assert client.hget(redis_key("ace", *KEY), "n:plain") == b"2"


def test_idle_tenants_expire(fleet, redis_server):
    a = fleet("a", ttl_s=30.0)
    a.record_speed(KEY, "plain", sample(50, 1.0), GATE, now())
    flush(a)
    assert 0 < redis.Redis.from_url(redis_server.url).ttl(redis_key("ace", *KEY)) <= 30


def hot_path_seconds(store: RedisStateStore, key, n: int) -> list[float]:
    """Wall time of each admit + record + record_speed: what a request spends in the store."""
    spent = []
    for _ in range(n):
        start = time.perf_counter()
        t = now()
        store.admit(key, ARMS, GATE, t, 0.5)
        store.record(key, 0.9, probe=False, gate=GATE, now=t)
        store.record_speed(key, "plain", sample(50, 1.0), GATE, t)
        spent.append(time.perf_counter() - start)
        time.sleep(0.002)
    return spent


def test_redis_killed_and_restarted_empty_delays_nothing_and_is_merged_back(fleet, redis_server, caplog):
    caplog.set_level(logging.INFO, logger="ace_mw.state.fleet")
    a, b = fleet("a"), fleet("b")
    hot_path_seconds(a, KEY, 5)
    flush(a, b)
    redis_server.kill()
    during = hot_path_seconds(a, KEY, 300)  # about a second of traffic with Redis gone
    assert max(during) < 0.05, max(during)  # a Redis round trip on this path would cost timeout_s (0.2 s)
    health = a.health()
    assert health["degraded"] and not health["connected"] and health["degraded_since"] is not None
    assert health["sync_errors"] >= 1 and "Error" in health["last_error"]
    assert health["sync_errors"] <= 6  # backoff: 0.1, 0.2, 0.4 s... not one try per 0.1 s interval
    assert a.view(KEY).samples == 305  # decisions went on, on local state
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 2  # once per replica, not once per failed sync

    redis_server.start()  # empty: no persistence, as after a crash
    wait_for(lambda: a.health()["connected"] and b.health()["connected"], timeout=40, what="reconnection")
    b.admit(KEY, ARMS, GATE, now(), 0.5)
    flush(a, b)
    assert b.view(KEY).samples == a.view(KEY).samples == 305  # the outage's samples, merged back once
    assert b.arm_views(KEY, GATE, now())["plain"].samples > GATE.speed_min_samples
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_a_hung_redis_delays_nothing(fleet, redis_server):
    a = fleet("a")
    hot_path_seconds(a, KEY, 3)
    flush(a)
    redis_server.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        during = hot_path_seconds(a, KEY, 150)
        assert max(during) < 0.05, max(during)
        wait_for(lambda: a.health()["degraded"], timeout=5, what="the store to notice")
        assert "Timeout" in a.health()["last_error"]
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    wait_for(lambda: a.health()["connected"], timeout=40, what="reconnection")
    flush(a)
    assert a.health()["fleet_view_age_s"] < 1.0


# -- built from config, started and closed by the integrations ---------------------------------------


def state_config(url: str) -> dict:
    return {"mode": "prod", "state": {"backend": "redis", "url": url, "sync_interval_s": INTERVAL}}


def test_the_config_names_the_store_and_a_store_in_code_wins(redis_server):
    from ace_mw import AceConfig, AceController, InMemoryStateStore

    assert isinstance(AceController(AceConfig()).store, InMemoryStateStore)
    controller = AceController(AceConfig.from_dict(state_config(redis_server.url)))
    built = controller.store
    assert isinstance(built, RedisStateStore) and built.health()["backend"] == "redis"
    wait_for(lambda: built.health()["connected"], timeout=10, what="the sync, started with the controller")
    controller.close()
    mine = InMemoryStateStore()
    assert AceController(AceConfig.from_dict(state_config(redis_server.url)), store=mine).store is mine


def test_a_child_forked_from_a_syncing_replica_syncs_at_once_on_its_own(fleet, redis_server):
    """gunicorn --preload forks workers from a process whose store is syncing: the sync thread
    does not survive a fork, so each child starts its own at the fork, not at its first request."""
    import os

    parent = fleet("parent")
    flush(parent)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        try:
            ok = parent.wait_synced(10) and parent.health()["running"] and parent.health()["connected"]
            parent.admit(KEY, ARMS, GATE, now(), 0.5)
            parent.record_speed(KEY, "plain", sample(50, 1.0), GATE, now())
            target = parent.health()["syncs"] + 2
            deadline = time.monotonic() + 10
            while parent.health()["syncs"] < target and time.monotonic() < deadline:
                parent.sync_now()
                time.sleep(0.02)
            os._exit(0 if ok and parent.health()["syncs"] >= target else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert redis.Redis.from_url(redis_server.url).hget(redis_key("ace", *KEY), "n:plain") == b"1"
    assert parent.health()["running"]  # the parent's own sync goes on


def test_a_redis_hung_at_start_up_holds_the_first_request_within_the_bound_then_fails_open(redis_server, caplog):
    """Redis stopped before the app starts (SIGSTOP: it accepts, never answers): the app starts,
    its first request is served while Redis is still stopped (the wait for the first sync ends
    with that sync's failure, or at state.first_sync_wait_s), decided on the replica's own state."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from support.servers import serve_asgi

    from ace_mw.integrations import AceSpecDec

    async def chat(request):
        return JSONResponse({"choices": [], "seen": await request.json()})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    config = state_config(redis_server.url)
    config["state"] |= {"timeout_s": 2.0, "first_sync_wait_s": 0.5}
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        middleware = AceSpecDec(app, config=config)
        with serve_asgi(middleware, lifespan="on") as url:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
            headers = {"authorization": "Bearer sk-hung-redis"}
            with caplog.at_level(logging.WARNING, logger="ace_mw"):
                answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert answer.status_code == 200
            assert answer.json()["seen"]["messages"] == body["messages"]
            assert answer.headers["x-ace-speculative-decoding"] in ("applied", "off")
            assert not middleware.controller.store.health()["connected"]  # Redis still stopped
            assert "did not finish within 0.50 s" in caplog.text
            assert middleware.controller.synced  # nothing waits again
    finally:
        redis_server.process.send_signal(signal.SIGCONT)


SECRET = "s3cret-pw"
URLS_WITH_A_PASSWORD = {
    "redis://app:s3cret-pw@10.0.0.9:6379/2": "redis://app:***@10.0.0.9:6379/2",
    "redis://:s3cret-pw@10.0.0.9:6379/2": "redis://:***@10.0.0.9:6379/2",
    "redis://10.0.0.9:6379/0?password=s3cret-pw": "redis://10.0.0.9:6379/0?password=***",
    "rediss://app@10.0.0.9/0?db=1&password=s3cret-pw&ssl_cert_reqs=none": (
        "rediss://app@10.0.0.9/0?db=1&password=***&ssl_cert_reqs=none"
    ),
    "unix:///run/redis.sock?db=0&password=s3cret-pw": "unix:///run/redis.sock?db=0&password=***",
    "unix://app:s3cret-pw@/run/redis.sock?db=0": "unix://app:***@/run/redis.sock?db=0",
    "redis://10.0.0.9/0?password=s3cret%2Dpw": "redis://10.0.0.9/0?password=***",  # percent-encoded
}


@pytest.mark.parametrize("url", list(URLS_WITH_A_PASSWORD))
def test_the_password_stays_out_of_the_repr_and_health(url):
    from ace_mw import AceConfig
    from ace_mw.state.redaction import redact

    config = AceConfig.from_dict({"state": {"backend": "redis", "url": url}})
    assert SECRET not in repr(config)
    assert redact(config.state.url) == URLS_WITH_A_PASSWORD[url]
    store = RedisStateStore(config.state)  # never started: nothing connects
    assert SECRET not in str(store.health())


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_an_unreachable_redis_shows_no_password_in_its_warning_health_or_status_page(form, caplog):
    from starlette.applications import Starlette
    from support.servers import serve_asgi, wait_for

    from ace_mw import AceConfig, AceController
    from ace_mw.integrations import AceSpecDec

    port = _closed_port()
    url = (
        f"redis://:{SECRET}@127.0.0.1:{port}/0"
        if form == "userinfo"
        else f"redis://127.0.0.1:{port}/0?password={SECRET}"
    )
    token = "adm-" + "x" * 32
    config = {"state": {"backend": "redis", "url": url, "timeout_s": 0.2}, "admin": {"token": token}}
    controller = AceController(AceConfig.from_dict(config))
    caplog.set_level(logging.WARNING, logger="ace_mw.state.fleet")
    try:
        controller.start()
        wait_for(lambda: controller.store.health()["degraded"], timeout=10, what="the failed first sync")
        with serve_asgi(AceSpecDec(Starlette(), controller=controller)) as base:
            auth = {"authorization": f"Bearer {token}"}
            pages = [
                httpx.get(base + "/ace/status", headers={**auth, "accept": "application/json"}).text,
                httpx.get(base + "/ace/status", headers=auth).text,
            ]
    finally:
        controller.close()
    assert "unreachable" in caplog.text
    assert "***" in pages[0] and "***" in pages[1]
    for output in (caplog.text, str(controller.store.health()), *pages):
        assert SECRET not in output


def _closed_port() -> int:
    from support.redis_server import free_port

    return free_port()  # nothing listens there once the probing socket is closed


def test_asgi_lifespan_starts_the_sync_before_any_request_and_shutdown_closes_it(redis_server):
    from starlette.applications import Starlette
    from support.servers import serve_asgi

    from ace_mw.integrations import AceSpecDec

    middleware = AceSpecDec(Starlette(), config=state_config(redis_server.url))
    store = middleware.controller.store
    assert isinstance(store, RedisStateStore)
    with serve_asgi(middleware, lifespan="on"):
        wait_for(lambda: store.health()["connected"], timeout=10, what="the sync to start on startup")
        store.admit(KEY, ARMS, GATE, now(), 0.5)
        store.record_speed(KEY, "plain", sample(50, 1.0), GATE, now())
    assert not store.health()["running"]  # closed on shutdown, after a last push:
    assert redis.Redis.from_url(redis_server.url).hget(redis_key("ace", *KEY), "n:plain") == b"1"


def test_grpc_sync_and_aio_interceptors_share_state_through_redis(redis_server):
    import asyncio

    import grpc
    from support.grpc_services import GENERATE, AioGeneration, Behaviour, SyncGeneration
    from support.servers import serve_grpc, serve_grpc_aio

    from ace_mw.integrations import AceSpecDecAioInterceptor, AceSpecDecInterceptor, generation_pb2_grpc
    from ace_mw.integrations import generation_pb2 as pb

    config = {**state_config(redis_server.url), "paths": [GENERATE]}
    behaviour = Behaviour()
    behaviour.figures = (10, 1, 4)  # alpha 0.1: the breaker trips after gate.min_samples (10) of them
    auth = (("authorization", "Bearer sk-grpc-fleet"),)
    message = pb.GenerateRequest(model="m", prompt="hi", temperature=0.0)
    sync_side = AceSpecDecInterceptor(config=config)
    aio_side = AceSpecDecAioInterceptor(config=config)
    try:
        with serve_grpc(SyncGeneration(behaviour), [sync_side]) as target, grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            reasons: list[str] = []
            while "breaker_open" not in reasons:  # requests that explore plain decoding carry no alpha
                _, call = stub.Generate.with_call(message, metadata=auth)
                reasons.append(dict(call.trailing_metadata())["x-ace-speculative-decoding-reason"])
                assert len(reasons) < 60, reasons

        async def on_aio() -> str:
            async with serve_grpc_aio(AioGeneration(behaviour), [aio_side]) as target:
                async with grpc.aio.insecure_channel(target) as channel:
                    call = generation_pb2_grpc.GenerationStub(channel).Generate(message, metadata=auth)
                    await call
                    return dict(await call.trailing_metadata())["x-ace-speculative-decoding-reason"]

        # The aio side has synced since it was built; the trip reaches it within its sync interval.
        flush(sync_side.controller.store, aio_side.controller.store)
        assert asyncio.run(on_aio()) == "breaker_open"  # tripped on the sync server, gated on the aio one
    finally:
        sync_side.controller.close()
        aio_side.controller.close()
