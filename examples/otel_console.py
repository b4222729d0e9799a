"""ace-mw's OpenTelemetry output, printed to the console.

    python -m examples.otel_console

Installs the OTel SDK with a console exporter, puts opentelemetry-instrumentation-asgi's server
middleware outside AceSpecDec (so our attributes land on the server span instead of a span of our
own), serves a toy engine with uvicorn on loopback and sends two chat requests: one speculative
(its span gets `ace.spec_decode.*` decision and acceptance attributes) and one gated by its
temperature. ace-mw itself depends on opentelemetry-api only; the SDK is the application's choice.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import uvicorn
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDec

CONFIG = {"mode": "prod", "adapter": "ace"}


async def toy_chat(request: Request) -> JSONResponse:
    """A stand-in engine: a fixed answer, with vLLM-style acceptance figures when asked to speculate."""
    body = await request.json()
    answer = {
        "id": "chatcmpl-toy",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", ""),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15},
    }
    if body.get("use_speculative_decoding"):
        answer["metrics"] = {
            "speculative_decoding": {"num_draft_tokens": 20, "num_accepted_draft_tokens": 8, "num_spec_steps": 4}
        }
    return JSONResponse(answer)


def build_app(provider: TracerProvider):
    engine = Starlette(routes=[Route("/v1/chat/completions", toy_chat, methods=["POST"])])
    controller = AceController(AceConfig.from_dict(CONFIG), tracer_provider=provider)
    return OpenTelemetryMiddleware(
        AceSpecDec(engine, controller=controller), tracer_provider=provider, exclude_spans=["receive", "send"]
    )


async def run(provider: TracerProvider) -> None:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets; without it Nagle
    # and delayed ACKs hold small streamed chunks back by ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(provider), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    async with httpx.AsyncClient(headers={"authorization": "Bearer sk-example"}) as client:
        for temperature in (0.0, 1.2):
            body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "temperature": temperature}
            response = await client.post(url, json=body)
            print(
                f"# temperature {temperature}: x-ace-speculative-decoding="
                f"{response.headers['x-ace-speculative-decoding']}",
                flush=True,
            )
    server.should_exit = True
    await serving


def main() -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "ace-mw-otel-example"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    asyncio.run(run(provider))
    provider.shutdown()


if __name__ == "__main__":
    main()
