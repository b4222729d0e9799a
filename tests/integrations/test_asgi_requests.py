"""AceSpecDec on the request side: what it reads, what it passes through untouched, and why."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support.servers import serve_asgi
from support.upstream import FakeUpstream

from ace_mw.adapters import register_adapter
from ace_mw.adapters.vllm import VLLMAdapter
from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.directive import BASELINE_POOL, SPECULATIVE_POOL
from ace_mw.errors import ConfigError
from ace_mw.integrations import AceSpecDec
from ace_mw.state import InMemoryStateStore

PROD = {"mode": "prod"}
CHAT = "/v1/chat/completions"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.fixture(scope="module")
def upstream():
    return FakeUpstream()


@pytest.fixture(scope="module")
def middleware(upstream):
    return AceSpecDec(upstream.app, config=PROD, max_body_bytes=8192)


@pytest.fixture(scope="module")
def base_url(middleware):
    with serve_asgi(middleware) as url:
        yield url


UNREADABLE = {
    "not_json": (b'{"model": "m", "messages": [', "application/json"),
    "not_object": (b'[{"model": "m"}]', "application/json"),
    "too_large": (json.dumps({**GOOD, "pad": "x" * 10_000}).encode(), "application/json"),
    "unsupported_content_type": (json.dumps(GOOD).encode(), "text/plain"),
    "empty": (b"", "application/json"),
    "deeply_nested": (b"[" * 3000 + b"]" * 3000, "application/json"),
}
REASONS = {"deeply_nested": "not_json"}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_body_passes_through_byte_identical(base_url, upstream, case):
    raw, content_type = UNREADABLE[case]
    response = httpx.post(base_url + CHAT, content=raw, headers={"content-type": content_type})
    assert upstream.received[-1].body == raw
    assert response.headers["x-ace-speculative-decoding"] == "off"
    assert response.headers["x-ace-speculative-decoding-reason"] == "body_unreadable:" + REASONS.get(case, case)


def test_oversized_streamed_body_is_replayed_in_order(base_url, upstream):
    """No content-length: the cap trips mid-read, and what was read is replayed before the rest."""
    parts = [json.dumps(GOOD).encode()[:-1], b', "pad": "', b"y" * 10_000, b'"}']

    def chunks():
        yield from parts

    response = httpx.post(base_url + CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert upstream.received[-1].body == b"".join(parts)
    assert response.headers["x-ace-speculative-decoding-reason"] == "body_unreadable:too_large"


@pytest.mark.parametrize("temperature", ['"hot"', "NaN", "-1", "true"])
def test_bad_temperature_passes_through_for_the_app_to_reject(base_url, upstream, temperature):
    raw = b'{"model": "m", "messages": [], "temperature": ' + temperature.encode() + b"}"
    response = httpx.post(base_url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert upstream.received[-1].body == raw
    assert response.status_code == 400  # the fake engine's own answer
    assert response.headers["x-ace-speculative-decoding-reason"] == "bad_temperature"


def test_json_content_type_with_charset_is_read(base_url, upstream):
    httpx.post(
        base_url + CHAT, content=json.dumps(GOOD).encode(), headers={"content-type": "application/json; charset=utf-8"}
    )
    assert upstream.received[-1].json["use_speculative_decoding"] is True


def test_unhandled_route_passes_through_without_headers(base_url):
    response = httpx.get(base_url + "/health")
    assert response.json()["ok"] is True
    assert "x-ace-speculative-decoding" not in response.headers


def test_response_headers_off_keeps_the_decision_but_tells_the_client_nothing(upstream):
    """`response_headers = false`: the request is decided and rewritten as ever, the app still sees
    the decision, and the client's response carries no x-ace-* header (a streamed one included)."""
    controller = AceController(AceConfig.from_dict({**PROD, "response_headers": False}))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        plain = httpx.post(url + CHAT, json=GOOD)
        streamed = httpx.post(url + CHAT, json={**GOOD, "stream": True})
    assert upstream.received[-1].json["use_speculative_decoding"] is True
    for response in (plain, streamed):
        assert response.status_code == 200
        assert not [name for name in response.headers if name.startswith("x-ace-")]
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert controller.status()["decisions"]["applied"]["ok"] == 2


def test_response_headers_off_and_unread_responses_reach_the_client_as_the_app_sent_them(upstream):
    """With nothing to add to a response and nothing to read in it (`response_headers = false`,
    past `gate.max_measured_per_s`), the app is handed the server's own `send`: its responses come
    out exactly as without the middleware, streamed ones included, while requests are still
    decided and rewritten."""
    config = {**PROD, "response_headers": False, "gate": {"max_measured_per_s": 0.01}}
    controller = AceController(AceConfig.from_dict(config))
    streamed = {**GOOD, "stream": True}
    served, bare = [], []
    with serve_asgi(upstream.app) as bare_url, serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        first = httpx.post(url + CHAT, json=streamed)  # read (the bucket starts full)
        for body in (streamed, GOOD):
            served.append(httpx.post(url + CHAT, json=body))
            forwarded = upstream.received[-1]
            assert forwarded.json["use_speculative_decoding"] is True
            # The bare app, asked exactly what the middleware forwarded, answers the same bytes.
            bare.append(
                httpx.post(bare_url + CHAT, content=forwarded.body, headers={"content-type": "application/json"})
            )
    assert first.text.endswith("data: [DONE]\n\n")
    for ours, theirs in zip(served, bare, strict=True):
        assert ours.status_code == theirs.status_code == 200
        assert ours.content == theirs.content
        assert [(k, v) for k, v in ours.headers.items() if k != "date"] == [
            (k, v) for k, v in theirs.headers.items() if k != "date"
        ]
    assert controller.status()["decisions"]["applied"]["ok"] == 3


def test_get_on_handled_path_is_not_decided(base_url):
    response = httpx.get(base_url + CHAT)
    assert response.status_code == 405
    assert "x-ace-speculative-decoding" not in response.headers


async def state_app(request: Request) -> JSONResponse:
    decision = request.state.ace_decision
    if decision is None:
        return JSONResponse({"pool": request.state.ace_pool, "outcome": None})
    return JSONResponse({"pool": request.state.ace_pool, "outcome": decision.outcome, "reason": decision.reason})


STATE_APP = Starlette(routes=[Route(CHAT, state_app, methods=["POST"])])


def test_decision_and_pool_are_exposed_in_request_state():
    app = Starlette(routes=STATE_APP.routes)
    app.add_middleware(AceSpecDec, config=PROD)
    with serve_asgi(app) as url:
        applied = httpx.post(url + CHAT, json=GOOD).json()
        gated = httpx.post(url + CHAT, json={**GOOD, "temperature": 0.9}).json()
    assert applied == {"pool": SPECULATIVE_POOL, "outcome": "applied", "reason": "ok"}
    assert gated == {"pool": BASELINE_POOL, "outcome": "gated", "reason": "temperature"}


def test_lifespan_reaches_the_app():
    events = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    with serve_asgi(AceSpecDec(Starlette(lifespan=lifespan), config=PROD), lifespan="on"):
        assert events == ["startup"]
    assert events == ["startup", "shutdown"]


def test_websocket_scope_goes_straight_to_the_app():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope, receive, send))

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        pass

    scope = {"type": "websocket", "path": CHAT, "headers": []}
    asyncio.run(AceSpecDec(app, config=PROD)(scope, receive, send))
    assert seen == [(scope, receive, send)]


class FailingController(AceController):
    """A controller whose `begin` raises: a bug past every fail-open of its own."""

    def __init__(self) -> None:
        super().__init__(AceConfig.from_dict(PROD))

    def begin(self, request, write=None):
        raise RuntimeError("begin broke")


class BrokenStore(InMemoryStateStore):
    def admit(self, *args, **kwargs):
        raise RuntimeError("admit broke")


class BrokenAdapter(VLLMAdapter):
    """An adapter whose injection fails in one of two ways: raising, or writing a body that cannot
    be encoded as JSON (the middleware's write then fails)."""

    def __init__(self, name: str, fault: str) -> None:
        self.name, self.fault = name, fault

    def inject(self, body, directive):
        if self.fault == "raises":
            raise RuntimeError("inject broke")
        new, injection = super().inject(body, directive)
        return ({**new, "not_json": {1, 2}} if self.fault == "unencodable" else new), injection

    @property
    def figure_markers(self):
        if self.fault == "observer":
            raise RuntimeError("observer broke")
        return super().figure_markers


@pytest.mark.usefixtures("adapter_registry")
@pytest.mark.parametrize("fault", ["admit", "raises", "unencodable", "observer"])
def test_internal_error_fails_open_and_is_counted(upstream, fault):
    """A fault inside the controller (store, adapter, the body's encoding, the observer): the
    request reaches the engine as the client sent it, and the decision says so ("off",
    "internal_error") unless only the observer failed; the controller counts the fault."""
    adapter = BrokenAdapter(f"broken-{fault}", "none")
    register_adapter(adapter)  # which checks the whole contract: the fault comes after
    adapter.fault = fault
    config = AceConfig.from_dict({**PROD, "adapter": "vllm" if fault == "admit" else f"broken-{fault}"})
    controller = AceController(config, store=BrokenStore() if fault == "admit" else None)
    middleware = AceSpecDec(upstream.app, controller=controller)
    raw = json.dumps(GOOD).encode()
    with serve_asgi(middleware) as url:
        response = httpx.post(url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"
    stage = {"admit": "decide", "raises": "inject", "unencodable": "inject", "observer": "observe"}[fault]
    assert controller.status()["decisions"]["error"] == {stage: 1}
    if fault == "observer":
        assert response.headers["x-ace-speculative-decoding"] == "applied"
    else:
        assert upstream.received[-1].body == raw
        assert response.headers["x-ace-speculative-decoding"] == "off"
        assert response.headers["x-ace-speculative-decoding-reason"] == "internal_error"
        assert controller.status()["decisions"]["off"] == {"internal_error": 1}
    assert middleware.failures.counts == {stage: 1}  # the same one tally, counted once


def test_a_broken_controller_fails_open_and_leaves_the_baseline_pool_in_state():
    middleware = AceSpecDec(Starlette(routes=STATE_APP.routes), controller=FailingController())
    with serve_asgi(middleware) as url:
        assert httpx.post(url + CHAT, json=GOOD).json() == {"pool": BASELINE_POOL, "outcome": None}
    assert middleware.failures.counts == {"begin": 1}


def test_a_failed_injection_is_off_in_state_headers_and_learning(upstream):
    """The request went out as the client sent it: it must not be credited to a speculative arm,
    and a probe slot it held is freed."""
    config = AceConfig.from_dict(
        {**PROD, "gate": {"speed_min_samples": 1, "explore_fraction": 0.0, "explore_fraction_unmeasured": 0.0}}
    )
    controller = AceController(config)
    middleware = AceSpecDec(Starlette(routes=STATE_APP.routes), controller=controller)
    with serve_asgi(middleware) as url:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("ace_mw.integrations.json_body._encode", _raise)
            seen = httpx.post(url + CHAT, json=GOOD)
    assert seen.json() == {"pool": BASELINE_POOL, "outcome": "off", "reason": "internal_error"}
    assert seen.headers["x-ace-speculative-decoding"] == "off"
    (row,) = controller.status()["tenants"]
    assert all(arm["samples"] == 0 for arm in row["arms"])  # nothing learnt from it


def _raise(*args):
    raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")


def test_a_lone_surrogate_escape_in_the_body_is_sent_on_with_the_directive(base_url, upstream):
    """json.loads keeps "\\ud800" as a lone surrogate, which UTF-8 cannot encode: the re-encoded body
    escapes it again, so the engine gets what the client sent plus the directive."""
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800y"}], "temperature": 0,'
        b' "use_speculative_decoding": false}'
    )
    response = httpx.post(base_url + CHAT, content=raw, headers={"content-type": "application/json"})
    sent = json.loads(upstream.received[-1].body)
    assert response.headers["x-ace-speculative-decoding"] == "applied"
    assert sent["use_speculative_decoding"] is True
    assert sent["messages"][0]["content"] == "x\ud800y"


def test_fastapi_app_sees_the_injected_body_and_state():
    api = FastAPI()

    @api.post(CHAT)
    async def chat(request: Request) -> dict:
        body = await request.json()
        return {"pool": request.state.ace_pool, "use": body.get("use_speculative_decoding")}

    api.add_middleware(AceSpecDec, config=PROD)
    with serve_asgi(api) as url:
        response = httpx.post(url + CHAT, json=GOOD)
    assert response.json() == {"pool": SPECULATIVE_POOL, "use": True}
    assert response.headers["x-ace-speculative-decoding"] == "applied"


def test_routes_follow_a_config_update_at_run_time(upstream):
    controller = AceController(AceConfig.from_dict(PROD))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        before = httpx.post(url + "/v1/completions", json=GOOD)
        controller.update(AceConfig.from_dict({**PROD, "paths": [CHAT]}))
        after = httpx.post(url + "/v1/completions", json=GOOD)
    assert before.headers["x-ace-speculative-decoding"] == "applied"
    assert "x-ace-speculative-decoding" not in after.headers


def test_injected_fields_are_appended_to_the_bytes_the_client_sent(base_url, upstream):
    raw = (
        b'{"model": "m",\n "messages": [{"role": "user", "content": "caf\\u00e9"}], "temperature": 0.0,'
        b' "max_tokens": 1e400}  '
    )
    httpx.post(base_url + CHAT, content=raw, headers={"content-type": "application/json"})
    sent = upstream.received[-1].body
    assert sent.startswith(raw.rstrip()[:-1])
    assert json.loads(sent)["use_speculative_decoding"] is True


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"])
def test_a_body_in_any_json_encoding_is_read_and_decided(base_url, upstream, encoding):
    """UTF-8 is decoded directly; the encodings json.loads detects still parse (RFC 8259 asks
    for UTF-8, but json.loads, and so the apps behind us, take these)."""
    body = {**GOOD, "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600"}]}
    raw = json.dumps(body, ensure_ascii=False).encode(encoding)
    response = httpx.post(base_url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert response.headers["x-ace-speculative-decoding"] == "applied"
    sent = upstream.received[-1].json
    assert sent["use_speculative_decoding"] is True
    assert {key: sent[key] for key in body} == body


def test_changed_fields_reencode_the_whole_body(base_url, upstream):
    raw = json.dumps({**GOOD, "stream": True, "stream_options": {"include_usage": False}}).encode()
    httpx.post(base_url + CHAT, content=raw, headers={"content-type": "application/json"})
    sent = upstream.received[-1].json
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == GOOD["messages"]


@pytest.mark.parametrize(
    "headers, conflict",
    [
        ([("authorization", "Bearer sk-mine"), ("authorization", "Bearer sk-other")], "authorization"),
        ([("x-api-key", "sk-mine"), ("x-api-key", "sk-other")], "x-api-key"),
        ([("x-ace-skill-speculative-decoding", "off"), ("x-ace-skill-speculative-decoding", "prod")], None),
    ],
)
def test_an_identity_header_sent_twice_differently_is_refused(base_url, upstream, headers, conflict):
    """ace-mw would decide as one key and a Starlette app serve as the other (the app reads the
    first header, a plain dict the last): the request is refused before anything is decided."""
    sent = len(upstream.received)
    response = httpx.post(base_url + CHAT, json=GOOD, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "ambiguous_identity" and error["param"] == (conflict or headers[0][0])
    assert len(upstream.received) == sent  # never reached the app


def test_the_same_identity_header_twice_with_one_value_is_not_ambiguous(base_url):
    headers = [
        ("authorization", "Bearer sk-mine"),
        ("authorization", "Bearer sk-mine"),
        ("accept", "a"),
        ("accept", "b"),
    ]
    response = httpx.post(base_url + CHAT, json=GOOD, headers=headers)
    assert response.status_code == 200 and response.headers["x-ace-speculative-decoding"] == "applied"


POOLED = {
    "mode": "prod",
    "adapter": "llamacpp",
    "pools": {"baseline": "http://plain:8080", "lookup": "http://lookup:8080", "draft": "http://draft:8080"},
    "gate": {"policy": "acceptance"},
    "candidates": [{"algorithm": "ngram", "pool": "lookup"}, {"algorithm": "draft_model", "pool": "draft"}],
    "keys": {"sk-drafting": {"candidates": [{"algorithm": "draft_model", "pool": "draft"}]}},
}


def test_each_arm_is_routed_to_its_named_pool():
    """Arms as pools: a request that speculates goes to its candidate's pool, a gated one to
    baseline; the arm label names the pool; the response header and request.state agree."""
    app = Starlette(routes=STATE_APP.routes)
    app.add_middleware(AceSpecDec, config=POOLED)
    with serve_asgi(app) as url:
        first = httpx.post(url + CHAT, json=GOOD)
        hot = httpx.post(url + CHAT, json={**GOOD, "temperature": 1.0})
        keyed = httpx.post(url + CHAT, json=GOOD, headers={"authorization": "Bearer sk-drafting"})
    assert first.json() == {"pool": "lookup", "outcome": "applied", "reason": "ok"}
    assert first.headers["x-ace-speculative-decoding-arm"] == "ngram/k5@lookup"
    assert hot.json() == {"pool": "baseline", "outcome": "gated", "reason": "temperature"}
    assert keyed.json()["pool"] == "draft"


def test_arms_that_cannot_be_told_apart_are_a_config_error_naming_the_field():
    """Two candidates on one server of an engine that sets speculation per server are one arm."""
    same = {**POOLED, "candidates": [{"algorithm": "ngram"}, {"algorithm": "draft_model"}]}
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict(same)
    assert caught.value.path == "candidates[1].pool" and "llamacpp adapter cannot switch" in str(caught.value)
    keyed = {**POOLED, "keys": {"sk-k": {"candidates": [{"pool": "draft"}, {"algorithm": "ngram", "pool": "draft"}]}}}
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict(keyed)
    assert caught.value.path.startswith("keys.sha256:") and caught.value.path.endswith(".candidates[1].pool")
    # the in-process engine switches per request: its candidates may share the speculative pool
    assert AceConfig.from_dict({"candidates": [{"algorithm": "ngram"}, {"algorithm": "eagle_2"}]})
