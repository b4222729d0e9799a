"""An OpenAI-compatible gateway in front of two engine pools, one with speculative decoding and one
without, choosing per request by AceSpecDec's decision.

    python -m examples.gateway --speculative-url http://127.0.0.1:8001 --baseline-url http://127.0.0.1:8002

Engines such as vLLM switch speculation per server, not per request, so the gateway routes: the
middleware decides (mode, key settings, temperature gate, acceptance breaker), puts the pool name in
``request.state.ace_pool``, and the proxy streams the request to that pool with httpx, forwarding
every response chunk as it arrives. The engines' acceptance figures flow back through the
middleware into the breaker. Point any OpenAI client at http://127.0.0.1:PORT/v1.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ace_mw.config import AceConfig
from ace_mw.directive import BASELINE_POOL, SPECULATIVE_POOL
from ace_mw.integrations import AceSpecDec

from .serving import serve

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


def build_app(config: AceConfig) -> Starlette:
    """The proxy app with AceSpecDec in front; `config.pools` maps pool names to base URLs.
    Upstream bodies are asked for uncompressed, so the middleware can read acceptance figures."""
    pools = dict(config.pools)
    if BASELINE_POOL not in pools:
        raise ValueError("config.pools needs at least a 'baseline' URL")
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))

    async def proxy(request: Request) -> Response:
        base = pools.get(request.state.ace_pool, pools[BASELINE_POOL])  # baseline if we stepped aside
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
    async def lifespan(app: Starlette):
        yield
        await client.aclose()

    app = Starlette(routes=[Route(path, proxy, methods=["POST"]) for path in ROUTES], lifespan=lifespan)
    app.add_middleware(AceSpecDec, config=config)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speculative-url", required=True, help="base URL of the speculative pool")
    parser.add_argument("--baseline-url", required=True, help="base URL of the baseline pool")
    parser.add_argument("--config", help="AceConfig TOML/JSON file (default: prod mode, vLLM adapter)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    args = parser.parse_args()
    pools = {SPECULATIVE_POOL: args.speculative_url, BASELINE_POOL: args.baseline_url}
    if args.config:
        config = replace(AceConfig.from_file(args.config), pools=pools)
    else:
        config = AceConfig.from_dict({"mode": "prod", "adapter": "vllm", "pools": pools})
    serve(build_app(config), args.host, args.port)


if __name__ == "__main__":
    main()
