"""An OpenAI-compatible gateway in front of engine pools (one per arm: plain decoding, and each
speculative candidate), choosing per request by AceSpecDec's decision (``pip install
'ace-mw[gateway]'``: httpx and uvicorn).

    ace-mw gateway --pool baseline=http://127.0.0.1:8002 --pool speculative=http://127.0.0.1:8001
    ace-mw gateway --config ace.toml          # its [pools] table, followed on every save

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
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from ace_mw.directive import BASELINE_POOL, SPECULATIVE_POOL
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


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in HOP_BY_HOP}


def build_app(config: ConfigLike, extra_pools: Mapping[str, str] | None = None) -> AceSpecDec:
    """The proxy app with AceSpecDec in front. A request goes to the URL of its decision's pool in
    the config in force (a followed file's reload included), or in `extra_pools`; to `baseline`
    when the middleware stepped aside. Upstream bodies are asked for uncompressed, so the middleware
    can read the figures."""
    extra = dict(extra_pools or {})
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))

    async def proxy(request: Request) -> Response:
        pools = {**extra, **middleware.controller.config.pools}  # the config in force, reloads included
        # No pool when the middleware did not decide this route (a config whose `paths` leave it out).
        base = pools.get(getattr(request.state, "ace_pool", BASELINE_POOL)) or pools[BASELINE_POOL]
        upstream = await client.send(
            client.build_request(
                request.method,
                base.rstrip("/") + request.url.path,
                headers={**forwardable(request.headers), "accept-encoding": "identity"},
                content=await request.body(),
            ),
            stream=True,
        )
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers=forwardable(upstream.headers),
            background=BackgroundTask(upstream.aclose),
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route(path, proxy, methods=["POST"]) for path in ROUTES], lifespan=lifespan)
    middleware = AceSpecDec(app, config=config)
    if middleware.config_error is not None:
        raise SystemExit(f"ace-mw gateway: error: {middleware.config_error}")
    pools = {**extra, **middleware.controller.config.pools}
    if BASELINE_POOL not in pools:
        raise SystemExit("the gateway needs a 'baseline' pool: --pool baseline=URL, or [pools] in the config")
    clash = sorted(set(extra) & set(middleware.controller.config.pools))
    if clash:
        raise SystemExit(f"pool {clash[0]!r} is named both in the config file and on the command line")
    return middleware


def pool_argument(text: str) -> tuple[str, str]:
    name, equals, url = text.partition("=")
    if not equals or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def parser(prog: str = "ace-mw gateway") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pool",
        type=pool_argument,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an upstream pool (repeatable); 'baseline' runs plain decoding",
    )
    parser.add_argument("--speculative-url", help="the same as --pool speculative=URL")
    parser.add_argument("--baseline-url", help="the same as --pool baseline=URL")
    parser.add_argument(
        "--config", help="AceConfig TOML/JSON file, followed on every save (default: prod, vLLM adapter)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    return parser


def run(args: argparse.Namespace) -> None:
    pools = dict(args.pool)
    for name, url in ((SPECULATIVE_POOL, args.speculative_url), (BASELINE_POOL, args.baseline_url)):
        if url:
            pools[name] = url
    config: ConfigLike = args.config or {"mode": "prod", "adapter": "vllm", "pools": pools}
    serve(build_app(config, pools if args.config else None), args.host, args.port)


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
