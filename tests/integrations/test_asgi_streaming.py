"""AceSpecDec on the response side: no buffering, garbage and broken streams, nothing left behind."""

from __future__ import annotations

import gzip
import json
import threading
import time

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from support.servers import serve_asgi, wait_for
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDec

CHAT = "/v1/chat/completions"
KEY = "sk-stream"
TENANT = tenant(KEY)
HEADERS = {"authorization": f"Bearer {KEY}"}
# One low-acceptance response trips the breaker; while OPEN every request is a probe (probe
# slots are the in-flight state that must never leak).
SPEC_FIELDS = {"num_speculative_tokens": 5, "speculative_algorithm": "eagle_2"}  # the default candidate
PROBING = {
    "mode": "prod",
    "gate": {"min_samples": 1, "cooldown_s": 60, "probe_fraction": 1.0, "max_concurrent_probes": 5},
}


def body(model: str = "m", usage: bool = True) -> dict:
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": True}
    if usage:
        payload["stream_options"] = {"include_usage": True}
    return payload


def stream_all(url: str, payload: dict) -> bytes:
    with httpx.stream("POST", url + CHAT, json=payload, headers=HEADERS, timeout=10) as response:
        return b"".join(response.iter_raw())


class Probing:
    """An app whose tenant's breaker is OPEN, so each next request holds a probe slot."""

    def __init__(self, script: Script) -> None:
        self.upstream = FakeUpstream(Script(figures=figures(10, 1, 10)))
        self.controller = AceController(AceConfig.from_dict(PROBING))
        self.middleware = AceSpecDec(self.upstream.app, controller=self.controller)
        self.script = script

    def __enter__(self) -> str:
        self._server = serve_asgi(self.middleware)
        url = self._server.__enter__()
        stream_all(url, body())
        assert self.breaker().state == "open"
        self.upstream.script = self.script
        return url

    def __exit__(self, *exc) -> None:
        self._server.__exit__(*exc)

    def breaker(self):
        return self.controller.store.view((TENANT, "m"))


@pytest.mark.parametrize("client_asks_usage", [True, False], ids=["usage_asked", "usage_forced"])
def test_first_chunk_reaches_client_before_upstream_sends_the_second(client_asks_usage):
    """Both observer paths: without anything forced every chunk passes as is; when the middleware
    forced `include_usage` (what a default OpenAI stream gets) the observer strips the usage
    chunk again and holds back unfinished events, but never a complete one."""
    upstream = FakeUpstream(Script(hold_after=1))
    with serve_asgi(AceSpecDec(upstream.app, config={"mode": "prod"})) as url:
        with httpx.stream("POST", url + CHAT, json=body(usage=client_asks_usage), timeout=10) as response:
            chunks = response.iter_raw()
            first = next(chunks)
            held_back = len(upstream.sent[-1])
            upstream.script.release.set()
            rest = b"".join(chunks)
    sent = upstream.sent[-1]
    assert upstream.received[-1].json["stream_options"] == {"include_usage": True}
    assert held_back == 1
    assert first == sent[0]
    assert first + rest == b"".join(chunk for chunk in sent if client_asks_usage or b'"usage"' not in chunk)


def test_a_keep_alive_ping_during_a_long_prefill_reaches_the_client_at_once():
    """The engine pings (a comment line, no blank line after it) while it prefills; the middleware
    forced include_usage, so it strips and holds unfinished events, but never a ping."""
    sent_ping, go = threading.Event(), threading.Event()

    async def engine(request):
        async def events():
            yield b": ping\n"
            sent_ping.set()
            await anyio.to_thread.run_sync(go.wait, 10)
            yield b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = AceSpecDec(Starlette(routes=[Route(CHAT, engine, methods=["POST"])]), config={"mode": "prod"})
    with serve_asgi(app) as url:
        with httpx.stream("POST", url + CHAT, json=body(usage=False), timeout=10) as response:
            chunks = response.iter_raw()
            started = time.monotonic()
            first = next(chunks)
            waited = time.monotonic() - started
            go.set()
            rest = b"".join(chunks)
    assert sent_ping.is_set() and first == b": ping\n"
    assert waited < 5  # held, it would wait for the go, which comes only after it arrived
    assert rest.endswith(b"data: [DONE]\n\n")


def test_malformed_sse_is_forwarded_byte_identical():
    upstream = FakeUpstream(Script(malformed=True, figures=figures(10, 9, 5)))
    with serve_asgi(AceSpecDec(upstream.app, config={"mode": "prod"})) as url:
        received = stream_all(url, body())
    assert received == b"".join(upstream.sent[-1])


def test_malformed_sse_still_yields_the_figures():
    upstream = FakeUpstream(Script(malformed=True, figures=figures(10, 9, 5)))
    controller = AceController(AceConfig.from_dict({"mode": "prod"}))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        stream_all(url, body())
    assert controller.store.view((TENANT, "m")).rolling_alpha == pytest.approx(0.9)


def test_forced_usage_event_is_the_only_thing_removed():
    upstream = FakeUpstream(Script(malformed=True, figures=figures(10, 9, 5)))
    with serve_asgi(AceSpecDec(upstream.app, config={"mode": "prod"})) as url:
        received = stream_all(url, body(usage=False))
    sent = upstream.sent[-1]
    usage_events = [chunk for chunk in sent if b'"usage"' in chunk]
    assert len(usage_events) == 1
    assert received == b"".join(chunk for chunk in sent if chunk not in usage_events)


def test_a_stream_past_the_read_rate_is_decided_but_neither_forced_nor_read():
    """One read per 100 s: the first stream is measured (usage forced, then removed), the second
    gets the same decision and headers, reaches the engine as the client sent it (plus the
    speculation switch) and the client byte for byte as the engine sent it."""
    upstream = FakeUpstream(Script(malformed=True, figures=figures(10, 9, 5)))
    config = {"mode": "prod", "gate": {"policy": "acceptance", "max_measured_per_s": 0.01}}
    controller = AceController(AceConfig.from_dict(config))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        responses = []
        for _ in range(2):
            with httpx.stream("POST", url + CHAT, json=body(usage=False), headers=HEADERS, timeout=10) as response:
                responses.append((response.headers, b"".join(response.iter_raw())))
    (read_headers, read), (unread_headers, unread) = responses
    assert read_headers["x-ace-speculative-decoding"] == unread_headers["x-ace-speculative-decoding"] == "applied"
    forced, untouched = upstream.received[0].json, upstream.received[1].json
    assert forced["stream_options"] == {"include_usage": True} and "stream_options" not in untouched
    assert untouched == {**body(usage=False), "use_speculative_decoding": True, **SPEC_FIELDS}
    assert read == b"".join(chunk for chunk in upstream.sent[0] if b'"usage"' not in chunk)
    assert unread == b"".join(upstream.sent[1])
    assert controller.store.view((TENANT, "m")).samples == 1  # only the read one taught the breaker


def test_upstream_death_mid_stream_keeps_every_byte_sent():
    upstream = FakeUpstream(Script(die_after=2))
    received = bytearray()
    with serve_asgi(AceSpecDec(upstream.app, config={"mode": "prod"})) as url:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", url + CHAT, json=body(), timeout=10) as response:
                for chunk in response.iter_raw():
                    received += chunk
    assert bytes(received) == b"".join(upstream.sent[-1])


def test_upstream_death_mid_stream_frees_the_probe_slot():
    probing = Probing(Script(die_after=2, figures=figures(10, 9, 5)))
    with probing as url:
        with pytest.raises(httpx.RemoteProtocolError):
            stream_all(url, body())
        wait_for(lambda: probing.breaker().probes == 0, what="the probe slot to be released")
    assert probing.breaker().state == "open"


def test_client_disconnect_mid_stream_frees_the_probe_slot():
    script = Script(hold_after=2, figures=figures(10, 9, 5))
    probing = Probing(script)
    with probing as url:
        with httpx.stream("POST", url + CHAT, json=body(), headers=HEADERS, timeout=10) as response:
            chunks = response.iter_raw()  # held: dropping a half-read iterator closes the connection
            next(chunks)
            assert probing.breaker().probes == 1
        script.release.set()
        wait_for(lambda: probing.breaker().probes == 0, what="the probe slot to be released")


def test_completed_probe_records_and_frees_its_slot():
    probing = Probing(Script(figures=figures(10, 9, 5)))
    with probing as url:
        stream_all(url, body())
        wait_for(lambda: probing.breaker().samples == 1, what="the probe's figures")
        breaker = probing.breaker()
    assert (breaker.probes, breaker.samples) == (0, 1)


def test_forced_meta_info_is_removed_from_a_json_body():
    upstream = FakeUpstream(Script(figures=figures(10, 7, 5)))
    controller = AceController(AceConfig.from_dict({"mode": "prod", "adapter": "sglang"}))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        payload = {**body(), "stream": False, "max_tokens": 64}
        del payload["stream_options"]
        response = httpx.post(url + CHAT, json=payload, headers=HEADERS)
    assert upstream.received[-1].json["return_meta_info"] is True
    assert "meta_info" in json.loads(b"".join(upstream.sent[-1]))["choices"][0]
    assert "meta_info" not in response.json()["choices"][0]
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"
    assert controller.store.view((TENANT, "m")).rolling_alpha == pytest.approx(0.7)


def test_compressed_response_is_forwarded_unread():
    packed = gzip.compress(json.dumps({"choices": [], "metrics": {"speculative_decoding": figures(10, 9, 5)}}).encode())

    async def engine(request):
        await request.body()
        return Response(packed, media_type="application/json", headers={"content-encoding": "gzip"})

    controller = AceController(AceConfig.from_dict({"mode": "prod"}))
    app = Starlette(routes=[Route(CHAT, engine, methods=["POST"])])
    with serve_asgi(AceSpecDec(app, controller=controller)) as url:
        with httpx.stream("POST", url + CHAT, json={**body(), "stream": False}, headers=HEADERS) as response:
            received = b"".join(response.iter_raw())
    assert received == packed
    assert controller.store.view((TENANT, "m")) is not None
    assert controller.store.view((TENANT, "m")).samples == 0


@pytest.mark.parametrize("limits", [{}, {"max_tokens": 20_000}, {"max_tokens": 4000, "n": 8}])
def test_meta_info_is_never_forced_into_an_answer_too_large_to_strip(limits):
    """An SGLang answer is stripped only when held whole (up to 4 MiB): a request that does not bound
    its answer below that gets nothing forced, so nothing forced can reach the client."""
    upstream = FakeUpstream(Script(figures=figures(10, 7, 5)))
    controller = AceController(AceConfig.from_dict({"mode": "prod", "adapter": "sglang"}))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        payload = {**body(usage=False), "stream": False, **limits}
        response = httpx.post(url + CHAT, json=payload, headers=HEADERS)
    assert "return_meta_info" not in upstream.received[-1].json
    assert response.content == b"".join(upstream.sent[-1])


def test_an_answer_past_the_hold_despite_its_limit_is_counted_as_unstripped():
    """An engine that ignores max_tokens: the held body outgrows its cap and leaves as sent; the
    middleware counts the fall-back rather than hiding it."""
    upstream = FakeUpstream(Script(chunks=("x" * (5 << 20),), figures=figures(10, 7, 5)))
    middleware = AceSpecDec(upstream.app, config={"mode": "prod", "adapter": "sglang"})
    with serve_asgi(middleware) as url:
        payload = {**body(usage=False), "stream": False, "max_tokens": 64}
        response = httpx.post(url + CHAT, json=payload, headers=HEADERS, timeout=30)
    assert upstream.received[-1].json["return_meta_info"] is True
    assert response.content == b"".join(upstream.sent[-1])
    assert middleware.failures.counts == {"observe.unstripped": 1}


def test_a_deeply_nested_event_keeps_the_stream_stripped_and_counts_no_failure():
    nested = b'data: {"usage": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n\n"

    async def engine(request):
        async def events():
            yield b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            yield nested
            yield b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    middleware = AceSpecDec(Starlette(routes=[Route(CHAT, engine, methods=["POST"])]), config={"mode": "prod"})
    with serve_asgi(middleware) as url:
        received = stream_all(url, body(usage=False))
    assert nested in received and b'"choices":[]' not in received
    assert middleware.failures.counts == {}


def test_one_hostile_event_does_not_stall_the_other_requests():
    """An upstream event of a million short data lines, in one chunk, while the middleware strips
    (it forced include_usage): parsing it takes about a second of CPU, off the event loop, so a
    request on another route is answered meanwhile; the stream still arrives whole."""
    hostile = b'data: {"usage": 1}\n' + b"data: x\n" * 1_000_000 + b"\n"
    sending = threading.Event()

    async def engine(request):
        async def events():
            sending.set()
            yield hostile
            yield b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def ping(request):
        return Response(b"pong")

    routes = [Route(CHAT, engine, methods=["POST"]), Route("/ping", ping)]
    middleware = AceSpecDec(Starlette(routes=routes), config={"mode": "prod"})
    with serve_asgi(middleware) as url:
        received: list[bytes] = []
        streaming = threading.Thread(target=lambda: received.append(stream_all(url, body(usage=False))))
        streaming.start()
        assert sending.wait(10)
        time.sleep(0.05)  # the chunk has reached the observer
        started = time.monotonic()
        assert httpx.get(url + "/ping", timeout=10).content == b"pong"
        answered = time.monotonic() - started
        streaming.join(30)
    assert received[0] == hostile + b"data: [DONE]\n\n"  # the forced usage chunk alone removed
    assert answered < 0.6, answered  # measured about 0.1 s here; held by the parse, 1.5 s
    assert middleware.failures.counts == {}
