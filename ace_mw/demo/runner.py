"""The run: every policy's `AceSpecDec` around one engine app, served and driven over HTTP.

`PolicyRouter` mounts one `AceSpecDec` per policy, each with its own `AceController` (fresh state),
around the same app: the in-process engine's OpenAI server, or `proxy_app` in front of an external
engine. `serve` runs it with uvicorn on loopback. `Sender` sends a `workload.Request` to one policy
with the real `openai` client (streaming or not) and measures the response into a `Record`;
`WorkloadRun.run` sends every request to every policy, interleaved request by request with the
first policy rotating, so that load from other processes hits them alike.
"""

from __future__ import annotations

import math
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ace_mw import AceConfig, AceController, EngineAdapter, get_adapter
from ace_mw.integrations import AceSpecDec

from .workload import CALIBRATION, FLAKY, KEYS, WARM_UP, Probe, Request, policy_config, tenant_id

HEADER = "X-ACE-Skill-Speculative-Decoding"
ROUTES = ("/v1/chat/completions", "/v1/completions")


def proxy_app(upstream: str | Mapping[str, str]) -> Starlette:
    """An OpenAI-compatible app that forwards the completion routes to `upstream` (a base URL, or
    pool name -> base URL: then to the pool of the request's decision, `request.state.ace_pool`,
    `baseline` when the middleware stepped aside), streaming every response chunk back as it
    arrives and asking for uncompressed bodies, so the middleware in front can read the figures."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    pools = {"baseline": upstream} if isinstance(upstream, str) else dict(upstream)
    bases = {name: url.rstrip("/").removesuffix("/v1") for name, url in pools.items()}
    hop_by_hop = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "upgrade", "te"}

    async def forward(request: HTTPRequest) -> Response:
        headers = {k: v for k, v in request.headers.items() if k not in hop_by_hop}
        pool = getattr(request.state, "ace_pool", None)
        base = bases.get(pool) if pool is not None and len(bases) > 1 else None
        sent = client.build_request(
            "POST",
            (base or bases["baseline"]) + request.url.path,
            headers={**headers, "accept-encoding": "identity"},
            content=await request.body(),
        )
        reply = await client.send(sent, stream=True)
        return StreamingResponse(
            reply.aiter_raw(),
            status_code=reply.status_code,
            headers={k: v for k, v in reply.headers.items() if k.lower() not in hop_by_hop},
            background=BackgroundTask(reply.aclose),
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=[Route(path, forward, methods=["POST"]) for path in ROUTES], lifespan=lifespan)


class PolicyRouter:
    """One ASGI app: `/<policy>/...` goes to that policy's `AceSpecDec` around the shared `app`."""

    def __init__(self, app: ASGIApp | Mapping[str, ASGIApp], configs: Mapping[str, AceConfig]) -> None:
        """`app`: the one app every policy runs over, or one per policy (by name)."""
        apps = app if isinstance(app, Mapping) else dict.fromkeys(configs, app)
        self.app = next(iter(apps.values()))
        self.controllers = {name: AceController(config) for name, config in configs.items()}
        self.mounts = {name: AceSpecDec(apps[name], controller=c) for name, c in self.controllers.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name, _, rest = scope["path"].lstrip("/").partition("/")
        mount = self.mounts.get(name)
        if mount is None:
            await Response(f"no policy {name!r}", status_code=404)(scope, receive, send)
            return
        path = "/" + rest
        await mount({**scope, "path": path, "raw_path": path.encode()}, receive, send)


@contextmanager
def serve(app: ASGIApp) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a thread; yield its base URL. Leaving
    the block stops the server (in-flight requests get a few seconds to finish)."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets; without it Nagle
    # and delayed ACKs hold small streamed chunks back by ~40 ms, which the TPOT would show.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    # Keep-alive past any pause between a policy's turns: with uvicorn's 5 s, a client that sends on
    # a connection the server is closing at that moment gets a connection error (the demo's
    # clients do not retry), as one request of the vLLM demo's draft-model policy did.
    config = uvicorn.Config(
        app, log_level="critical", access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=600
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the demo server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


# -- sending and recording ------------------------------------------------------------------------


@dataclass
class Record:
    """One response of one policy: the request, the decision, what it measured, the state after."""

    index: int
    policy: str
    tenant: str
    category: str
    temperature: float
    stream: bool
    header: str | None
    phase: str
    decision: str  # x-ace-speculative-decoding: applied | gated | shadow | off
    reason: str
    arm: str  # x-ace-speculative-decoding-arm, "" where no arm applied
    tokens: int
    latency_s: float
    ttft_s: float | None  # streams only
    tpot_s: float | None  # decode seconds per token after the first
    tpot_source: str  # "stream" (client-side chunk times) | "engine" (reported decode time) | ""
    alpha: float | None  # the engine's acceptance rate for this response (None: it did not speculate)
    breaker: str  # the tenant's breaker after the response ("" if the policy tracks none)
    rolling_alpha: float | None
    at_s: float  # when the response ended, seconds since the run started
    error: str | None = None

    @property
    def speculated(self) -> bool:
        """The policy asked the engine to speculate (the engine may still draft little or nothing)."""
        return self.decision == "applied"


@dataclass
class Sender:
    """Sends one request to one policy with the `openai` client and measures the response."""

    base_url: str
    model: str
    adapter: EngineAdapter
    max_tokens: int
    controllers: Mapping[str, AceController]
    started: float = field(default_factory=time.perf_counter)
    _clients: dict[tuple[str, str], openai.OpenAI] = field(default_factory=dict)

    def client(self, policy: str, key: str) -> openai.OpenAI:
        found = self._clients.get((policy, key))
        if found is None:
            found = self._clients[policy, key] = openai.OpenAI(
                base_url=f"{self.base_url}/{policy}/v1", api_key=key, max_retries=0, timeout=600.0
            )
        return found

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def send(self, policy: str, request: Request, max_tokens: int | None = None) -> Record:
        key = KEYS[request.tenant]
        client = self.client(policy, key)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": request.prompt}],
            "temperature": request.temperature,
            "max_tokens": max_tokens or self.max_tokens,
            "seed": request.seed,
            "user": request.conversation,
            "extra_headers": {HEADER: request.header} if request.header else None,
        }
        started = time.perf_counter()
        error = None
        try:
            if request.stream:
                headers, measured = self._stream(client, body, started)
            else:
                headers, measured = self._complete(client, body)
        except openai.APIError as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            headers, measured = {}, Measured()
        ended = time.perf_counter()
        controller = self.controllers.get(policy)
        view = controller.store.view((tenant_id(key), self.model)) if controller is not None else None
        return Record(
            request.index,
            policy,
            request.tenant,
            request.category,
            request.temperature,
            request.stream,
            request.header,
            request.phase,
            headers.get("x-ace-speculative-decoding", ""),
            headers.get("x-ace-speculative-decoding-reason", ""),
            headers.get("x-ace-speculative-decoding-arm", ""),
            measured.tokens,
            ended - started,
            measured.ttft(started),
            measured.tpot_s,
            measured.tpot_source,
            measured.alpha,
            view.state if view is not None else "",
            view.rolling_alpha if view is not None else None,
            ended - self.started,
            error,
        )

    def _stream(self, client: openai.OpenAI, body: dict[str, Any], started: float) -> tuple[Any, Measured]:
        raw = client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **body
        )
        measured = Measured()
        for chunk in raw.parse():
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                measured.first = measured.first or now
                measured.last = now
            if chunk.usage is not None:
                measured.tokens = chunk.usage.completion_tokens
            measured.read(self.adapter, chunk.to_dict())
        if measured.first is not None and measured.last is not None and measured.tokens > 1:
            measured.tpot_s, measured.tpot_source = (measured.last - measured.first) / (measured.tokens - 1), "stream"
        return raw.headers, measured

    def _complete(self, client: openai.OpenAI, body: dict[str, Any]) -> tuple[Any, Measured]:
        raw = client.chat.completions.with_raw_response.create(**body)
        completion = raw.parse()
        measured = Measured(tokens=completion.usage.completion_tokens if completion.usage else 0)
        figures = measured.read(self.adapter, completion.to_dict())
        if figures is not None and figures.decode_seconds is not None and math.isfinite(figures.decode_seconds):
            decoded = figures.decode_tokens if figures.decode_tokens is not None else measured.tokens - 1
            if decoded > 0 and figures.decode_seconds > 0:
                measured.tpot_s, measured.tpot_source = figures.decode_seconds / decoded, "engine"
        return raw.headers, measured


@dataclass
class Measured:
    """What one response showed the client."""

    tokens: int = 0
    first: float | None = None  # perf_counter of the first and last token-bearing chunks
    last: float | None = None
    tpot_s: float | None = None
    tpot_source: str = ""
    alpha: float | None = None

    def read(self, adapter: EngineAdapter, payload: dict[str, Any]) -> Any:
        """The adapter's figures in one response JSON (a body or a chunk); the latest report wins."""
        figures = adapter.extract(payload)
        if figures is not None and figures.alpha is not None and figures.drafted != 0:
            self.alpha = figures.alpha
        return figures

    def ttft(self, started: float) -> float | None:
        return self.first - started if self.first is not None else None


# -- running --------------------------------------------------------------------------------------


@dataclass
class WorkloadRun:
    """The whole run: one mount per policy (plus the calibration mount), the server, the sender and
    every record so far."""

    app: ASGIApp
    model: str
    adapter: str
    max_tokens: int
    policies: Sequence[str]
    records: list[Record] = field(default_factory=list)

    @contextmanager
    def serving(self, config: Mapping[str, Any]) -> Iterator[WorkloadRun]:
        """Serve every policy's mount, configured from the demo config `config`, for the block."""
        names = [*self.policies, CALIBRATION]
        self.router = PolicyRouter(self.app, {name: policy_config(config, _policy_of(name)) for name in names})
        with serve(self.router) as url:
            self.sender = Sender(url, self.model, get_adapter(self.adapter), self.max_tokens, self.router.controllers)
            try:
                yield self
            finally:
                self.sender.close()

    def configure(self, config: Mapping[str, Any]) -> None:
        """Swap every mount to policies made from a new demo config (`AceController.update`)."""
        for name, controller in self.router.controllers.items():
            controller.update(policy_config(config, _policy_of(name)))

    def warm_up(self, prompt: str, max_tokens: int = 8) -> None:
        """One short request per mount from a tenant nobody reports: first calls pay one-time costs."""
        for name in self.router.mounts:
            self.sender.send(name, Request(-1, WARM_UP, "chat", prompt, 0.0, 0, True), max_tokens)

    def warm_priors(self, requests: Sequence[Request], learners: Sequence[str]) -> None:
        """The warm-up tenants' requests, to the mounts of `learners` (the policies that learn
        speed): what they measure becomes the model's priors."""
        for request in requests:
            for name in learners:
                self.sender.send(name, request)

    def calibrate(self, candidates: Sequence[Probe]) -> tuple[list[Probe], float]:
        """Send the flaky tenant's candidate requests to the calibration mount (always-on, never
        reported): each comes back with its measured alpha. Also returns their mean latency."""
        measured, latencies = [], []
        for i, probe in enumerate(candidates):
            request = Request(-1 - i, FLAKY, probe.category, probe.prompt, probe.temperature, probe.seed, False)
            record = self.sender.send(CALIBRATION, request)
            measured.append(Probe(probe.category, probe.prompt, probe.temperature, probe.seed, record.alpha))
            latencies.append(record.latency_s)
        return measured, statistics.fmean(latencies) if latencies else 0.0

    def run(self, requests: Sequence[Request], on_record: Callable[[Record], None] = lambda r: None) -> list[Record]:
        """Send every request to every policy, the first policy rotating per request. A
        KeyboardInterrupt propagates; `records` keeps what finished."""
        self.sender.started = time.perf_counter()
        policies = list(self.policies)
        for request in requests:
            turn = request.index % len(policies)
            for policy in policies[turn:] + policies[:turn]:
                record = self.sender.send(policy, request)
                self.records.append(record)
                on_record(record)
        return self.records


def _policy_of(mount: str) -> str:
    return "always-on" if mount == CALIBRATION else mount
