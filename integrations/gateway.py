"""An OpenAI-compatible gateway in front of engine pools (one per arm: plain decoding, and each
speculative candidate), choosing per request by AceSpecDec's decision (``pip install
'ace-mw[gateway]'``: httpx and uvicorn).

    ace-mw gateway --pool baseline=http://127.0.0.1:8002 --pool ngram/k4=http://127.0.0.1:8001
    ace-mw gateway --config ace.toml          # its [pools] table, followed on every save

Without a config each pool but `baseline` is a candidate of the speed policy, labelled by what its
name says it runs (ALGORITHM[/kN]); a pool that does not say is refused, since a guessed label
would put its speed under another name.

Engines such as vLLM and llama.cpp switch speculation per server, not per request, so the gateway
routes: the middleware decides (mode, key settings, temperature gate, breaker, the arm measured
fastest), puts the pool name in ``request.state.ace_pool``, and the proxy streams the request to
that pool's URL with httpx, forwarding every response chunk as it arrives. The engines' figures
flow back through the middleware into the breaker and the speed estimates. Pools come from the
config in force (so a reload moves them); `--pool` adds pools the config file does not name.
Point any OpenAI client at http://127.0.0.1:PORT/v1.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ace_mw.directive import ALGORITHMS, BASELINE_POOL, SPECULATIVE_POOL
from ace_mw.usage import Parser

from .asgi import AceSpecDec
from .common import ConfigLike

# Connection-level headers are the proxy's own business on each hop (RFC 9110, section 7.6.1).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)
ROUTES = ("/v1/chat/completions", "/v1/completions")
logger = logging.getLogger("ace_mw")


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in HOP_BY_HOP}


def build_app(config: ConfigLike, extra_pools: Mapping[str, str] | None = None) -> AceSpecDec:
    """The proxy app with AceSpecDec in front. A request goes to the URL of its decision's pool in
    the config in force (a followed file's reload included), or in `extra_pools`; to `baseline`
    when the middleware stepped aside. Upstream bodies are asked for uncompressed, so the middleware
    can read the figures. A pool that refuses the connection gets the client a 502, one that does
    not answer within `upstream.first_byte_timeout_s` a 504, both in OpenAI's error shape (and
    the middleware counts them against the pool: outlier detection). `GET /v1/models` is the
    baseline pool's; `GET /health` is the gateway's own: 200 while some pool is in the loop's
    choices, else 503."""
    extra = dict(extra_pools or {})
    client = httpx.AsyncClient(timeout=None)

    def pools_in_force() -> dict[str, str]:
        return {**extra, **middleware.controller.config.pools}  # the config in force, reloads included

    async def proxy(request: Request) -> Response:
        pools = pools_in_force()
        # No pool when the middleware did not decide this route (a config whose `paths` leave it out).
        name = getattr(request.state, "ace_pool", BASELINE_POOL)
        name = name if name in pools else BASELINE_POOL
        upstream = middleware.controller.config.upstream
        timeout = httpx.Timeout(upstream.first_byte_timeout_s, connect=upstream.connect_timeout_s)
        try:
            answer = await client.send(
                client.build_request(
                    request.method,
                    pools[name].rstrip("/") + request.url.path,
                    headers={**forwardable(request.headers), "accept-encoding": "identity"},
                    content=await request.body(),
                    timeout=timeout,
                ),
                stream=True,
            )
        except httpx.TimeoutException as exc:
            connecting = isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout))
            return upstream_error(
                502 if connecting else 504,
                name,
                "did not answer in time" if not connecting else "could not be reached in time",
            )
        except httpx.TransportError as exc:
            return upstream_error(502, name, f"could not be reached ({type(exc).__name__})")
        return StreamingResponse(
            relayed(answer, name),
            status_code=answer.status_code,
            headers=forwardable(answer.headers),
            background=BackgroundTask(answer.aclose),
        )

    async def models(request: Request) -> Response:
        pools = pools_in_force()
        try:
            answer = await client.get(
                pools[BASELINE_POOL].rstrip("/") + "/v1/models",
                headers={**forwardable(request.headers), "accept-encoding": "identity"},
                timeout=10.0,
            )
        except httpx.TransportError as exc:
            return upstream_error(502, BASELINE_POOL, f"could not be reached ({type(exc).__name__})")
        return Response(answer.content, answer.status_code, headers=forwardable(answer.headers))

    async def health(request: Request) -> Response:
        controller = middleware.controller
        report = controller.pool_health()
        serving = [name for name in pools_in_force() if not report.get(name, {}).get("ejected")]
        return JSONResponse({"status": "ok" if serving else "unavailable", "pools": report}, 200 if serving else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    routes = [Route(path, proxy, methods=["POST"]) for path in ROUTES]
    routes += [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    middleware = AceSpecDec(UnfinishedOnBreak(app), config=config)
    if middleware.config_error is not None:
        raise SystemExit(f"ace-mw gateway: error: {middleware.config_error}")
    pools = {**extra, **middleware.controller.config.pools}
    if BASELINE_POOL not in pools:
        raise SystemExit("the gateway needs a 'baseline' pool: --pool baseline=URL, or [pools] in the config")
    clash = sorted(set(extra) & set(middleware.controller.config.pools))
    if clash:
        raise SystemExit(f"pool {clash[0]!r} is named both in the config file and on the command line")
    return middleware


async def relayed(answer: httpx.Response, pool: str) -> AsyncIterator[bytes]:
    """The pool's bytes as they arrive. If the pool breaks off mid-answer, what it sent has gone
    out and the stream ends there, unfinished (no [DONE], no closing chunk of ours): the client
    sees an error, nothing is invented, and the middleware learns nothing from a broken answer."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        logger.warning("ace-mw gateway: pool %s broke off its answer (%s)", pool, type(exc).__name__)
        raise UpstreamBrokeOff(pool) from None


class UpstreamBrokeOff(Exception):
    """A pool closed or stalled mid-answer: the response to the client is cut off too."""


class UnfinishedOnBreak:
    """Leaves the response of an answer that broke off unfinished, instead of raising into the
    server (a traceback for what is the pool's failure, logged already): the server then closes
    the connection, and AceSpecDec reads the response as incomplete."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except UpstreamBrokeOff:
            return


def upstream_error(status: int, pool: str, what: str) -> JSONResponse:
    """A gateway error in OpenAI's shape (`openai` raises it as an APIStatusError)."""
    kind = "bad_gateway" if status == 502 else "gateway_timeout"
    message = f"pool {pool!r} {what}"
    logger.warning("ace-mw gateway: %s: answering %d", message, status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


# Pool names that say what the pool runs, for a gateway started without a config.
ALIASES = {"eagle2": "eagle_2", "eagle3": "eagle_3", "draft": "draft_model", "prompt_lookup": "ngram"}


def pool_argument(text: str) -> tuple[str, str]:
    name, equals, url = text.partition("=")
    if not equals or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def candidate(pool: str, runs: str | None = None) -> dict[str, Any]:
    """The candidate of a pool named on the command line, from what it runs: `runs`, else the
    pool's own name (`ngram`, `eagle_3/k4`, `draft`: ALGORITHM[/kN]). Without a config nothing
    else says what a vLLM pool runs, and a label that guessed would put its speed under another
    name, so a pool that does not say is refused (SystemExit naming the ways to say it)."""
    algorithm, _, k = (runs or pool).partition("/k")
    algorithm = ALIASES.get(algorithm, algorithm)
    if algorithm not in ALGORITHMS or (k and not k.isdigit()):
        raise SystemExit(
            f"ace-mw gateway: error: pool {pool!r}: say what it runs, as ALGORITHM[/kN] ({', '.join(ALGORITHMS)}): "
            f"--pool ngram/k4=URL, --speculative-runs eagle_3/k4 with --speculative-url, or --config"
        )
    found: dict[str, Any] = {"algorithm": algorithm, "pool": pool}
    if k:
        found["num_speculative_tokens"] = int(k)
    return found


def parser(prog: str = "ace-mw gateway") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pool",
        type=pool_argument,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an upstream pool (repeatable): 'baseline' runs plain decoding; any other NAME says what "
        "the pool runs, ALGORITHM[/kN] (ngram/k4=URL, eagle_3=URL, draft=URL)",
    )
    parser.add_argument("--speculative-url", help="the same as --pool speculative=URL")
    parser.add_argument(
        "--speculative-runs", metavar="ALGORITHM[/kN]", help="what the --speculative-url pool runs (eagle_3/k4)"
    )
    parser.add_argument("--baseline-url", help="the same as --pool baseline=URL")
    parser.add_argument(
        "--config", help="AceConfig TOML/JSON file, followed on every save (default: prod, vLLM adapter)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    return parser


def run(args: argparse.Namespace) -> None:
    named = dict(args.pool)
    for name, url in ((SPECULATIVE_POOL, args.speculative_url), (BASELINE_POOL, args.baseline_url)):
        if url:
            named[name] = url
    if args.config:
        serve(build_app(args.config, named), args.host, args.port)
        return
    pools = {name.partition("/k")[0]: url for name, url in named.items()}
    runs = {SPECULATIVE_POOL: args.speculative_runs}
    candidates = [candidate(name, runs.get(name)) for name in named if name != BASELINE_POOL]
    config: dict[str, Any] = {"mode": "prod", "adapter": "vllm", "pools": pools}
    if candidates:
        config["candidates"] = [{**c, "pool": c["pool"].partition("/k")[0]} for c in candidates]
    serve(build_app(config), args.host, args.port)


def serve(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
    """Bind and listen first (port 0 = any free port), print the URL, then serve until interrupted."""
    import uvicorn

    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets; without it Nagle
    # and delayed ACKs hold small streamed chunks back by ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # before the line below: a client that reads it may connect at once
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> None:
    run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
