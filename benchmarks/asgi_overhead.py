"""What AceSpecDec costs a streaming endpoint, next to opentelemetry-instrumentation-asgi.

    python benchmarks/asgi_overhead.py [--rounds 4] [--processes 2] [--seconds 2] [--concurrency 8]
                                       [--sequential 100] [--redis] [--prompt-kb 0]
                                       [--server uvicorn|uvicorn-standard] [--variants bare ace ...]

`--processes` uvicorn processes per variant on loopback, all serving the same OpenAI-style
streaming endpoint (100 SSE chunks, then the usage chunk with vLLM acceptance figures when asked
for it):
  bare    the endpoint alone
  floor   a pure-ASGI middleware that only wraps `send` (the least any response observer costs)
  ace     AceSpecDec in front, default config (prod mode: decide and inject every request; read
          up to `gate.max_measured_per_s` = 20 responses/s: forced usage chunk, SSE observation,
          its removal; the rest pass unread; OTel API only, no SDK)
  ace_read  `ace` reading every response (max_measured_per_s = inf): what each read one costs
  ace_unread  (not run by default; asgi_instructions.py) `ace` reading none past the first
          (max_measured_per_s = 0.01): what each unread one costs
  ace_quiet  (not run by default) `ace` with `response_headers = false`: no x-ace-* headers
  otel    OpenTelemetryMiddleware in front, with an SDK TracerProvider (spans recorded, not exported)
  ace_redis  (with --redis) `ace` with `state.backend = "redis"` on a redis-server started here: the
          same decisions from local state, plus the background sync of the fleet store (its
          thread's CPU per request is printed apart)
The variants are measured in interleaved rounds, so load from other processes on the machine
hits them alike, and each in several processes: the same code runs several percent faster or
slower from one process to the next (hash seed, memory layout), and one process per variant would
hand that luck to the ratio. A round is a turn per process index: the index-th process of every
variant, in an order rotated from turn to turn; per process, requests/s with `--concurrency`
streaming clients for `--seconds`, with the server's CPU time per request (Linux /proc, all
threads); then per round the time to first body byte (TTFB) of sequential requests, alternating
between the variants request by request. Prints medians and ratios to bare, and the paired ratio:
the median of each turn's ratio to bare, with a 95 % interval (this VM's speed drifts by 20 % over
seconds, which unpaired medians carry into the ratio). `--variants` measures fewer, so that more
rounds fit in the same time.
Targets: ace >= 90 % of bare requests/s, median TTFB added <= 0.5 ms, cheaper than otel; ace_redis
costs < 5 % more than ace. The request is a short chat (0.9 KB); `--prompt-kb 100` pads its history
to about 100 KB, the size of a long conversation: the app and AceSpecDec each parse it whole.
`--server uvicorn` (the default) is uvicorn's h11 parser on asyncio's loop; `--server
uvicorn-standard` runs httptools on uvloop (`pip install 'uvicorn[standard]'`), the usual
production stack, under which the bare app costs about half as much per request.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from variant_servers import arguments, chosen, cpu_seconds, report, rotation, variant_servers

VARIANTS = ("bare", "floor", "ace", "ace_read", "otel")
REDIS_VARIANT = "ace_redis"
# The AceSpecDec variants' config on top of {"mode": "prod", "adapter": "ace"}.
ACE_VARIANTS = {
    "ace": {},
    "ace_read": {"gate": {"max_measured_per_s": math.inf}},
    "ace_unread": {"gate": {"max_measured_per_s": 0.01}},
    "ace_quiet": {"response_headers": False},
    REDIS_VARIANT: {},
}
REDIS_URL_ENV = "ACE_BENCH_REDIS_URL"  # how the parent tells the ace_redis child where Redis is
SYNC_INTERVAL_ENV = "ACE_BENCH_SYNC_INTERVAL_S"  # and, optionally, its state.sync_interval_s
# uvicorn's HTTP parser and event loop: `pip install uvicorn` gives the first, `pip install
# 'uvicorn[standard]'` (httptools, uvloop: what production deployments usually run) the second.
SERVER_STACKS = {
    "uvicorn": {"http": "h11", "loop": "asyncio"},
    "uvicorn-standard": {"http": "httptools", "loop": "uvloop"},
}
SERVER_ENV = "ACE_BENCH_SERVER"  # how the parent tells the children which stack serves
CHUNKS = 100
BODY = {
    "model": "bench",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about speculative decoding. " * 20},
    ],
    "temperature": 0.0,
    "max_tokens": 100,
    "stream": True,
}


def request_body(prompt_kb: float) -> dict:
    """BODY, its history padded with alternating turns to about `prompt_kb` KB (0: as it is)."""
    turn = "Speculative decoding drafts tokens cheaply and verifies them in one pass. " * 6
    history = []
    while len(json.dumps(history)) < prompt_kb * 1024:
        history.append({"role": ("user", "assistant")[len(history) % 2], "content": turn})
    return {**BODY, "messages": [BODY["messages"][0], *history, *BODY["messages"][1:]]}


def build_app(variant: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
    }
    event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    usage = {
        **chunk,
        "choices": [],
        "usage": {"prompt_tokens": 200, "completion_tokens": CHUNKS},
        "metrics": {
            "speculative_decoding": {"num_draft_tokens": 200, "num_accepted_draft_tokens": 150, "num_spec_steps": 40}
        },
    }
    usage_event = b"data: " + json.dumps(usage).encode() + b"\n\n"

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        with_usage = (body.get("stream_options") or {}).get("include_usage")

        async def stream():
            for _ in range(CHUNKS):
                yield event
            if with_usage:
                yield usage_event
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    if variant == "floor":

        async def floor(scope, receive, send):
            async def wrapped(message):
                await send(message)

            await app(scope, receive, wrapped)

        return floor
    if variant in ACE_VARIANTS:
        from ace_mw.integrations import AceSpecDec

        config = {"mode": "prod", "adapter": "ace", **ACE_VARIANTS[variant]}
        if variant == REDIS_VARIANT:
            config["state"] = {
                "backend": "redis",
                "url": os.environ[REDIS_URL_ENV],
                "sync_interval_s": float(os.environ.get(SYNC_INTERVAL_ENV, 1.0)),
            }
        return AceSpecDec(app, config=config)
    if variant == "otel":
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
        from opentelemetry.sdk.trace import TracerProvider

        return OpenTelemetryMiddleware(app, tracer_provider=TracerProvider())
    return app


def wait_listening(port: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def serve(variant: str) -> None:
    """Child process: serve one variant on a free port and print it."""
    import uvicorn

    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets; without it Nagle
    # and delayed ACKs hold small streamed chunks back by ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    stack = SERVER_STACKS[os.environ.get(SERVER_ENV, "uvicorn")]
    config = uvicorn.Config(build_app(variant), log_level="warning", access_log=False, **stack)
    uvicorn.Server(config).run(sockets=[sock])


class Connection:
    """A raw keep-alive HTTP/1.1 client connection: one write per request, no client library
    overhead in the figures (the server's cost is what is measured)."""

    def __init__(self, port: int, body: dict = BODY) -> None:
        self.port = port
        payload = json.dumps(body).encode()
        self.request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode() + payload

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def exchange(self) -> float:
        """Send one request, read the whole chunked response; return the time to its first body byte."""
        start = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        first = None
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            if first is None:
                first = time.perf_counter() - start
            data = data[-8:] + chunk
        return first

    def close(self) -> None:
        self.writer.close()


async def throughput(
    port: int, pid: int, seconds: float, concurrency: int, body: dict = BODY
) -> tuple[float, float, float]:
    """(requests/s, server CPU seconds per request, of which in threads other than the serving
    one) with `concurrency` keep-alive clients."""
    connections = [await Connection(port, body).open() for _ in range(concurrency)]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(connection: Connection) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await connection.exchange()
            done += 1

    start, cpu, background = time.perf_counter(), cpu_seconds(pid), cpu_seconds(pid, background=True)
    await asyncio.gather(*(worker(c) for c in connections))
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    background = cpu_seconds(pid, background=True) - background
    for connection in connections:
        connection.close()
    return done / elapsed, cpu / done, background / done


async def ttfb(ports: dict[str, int], requests: int, body: dict = BODY) -> dict[str, list[float]]:
    """Sequential requests, alternating between the variants request by request, so that a
    passing load spike hits them all alike."""
    connections = {v: await Connection(port, body).open() for v, port in ports.items()}
    samples: dict[str, list[float]] = {v: [] for v in ports}
    for _ in range(requests):
        for variant, connection in connections.items():
            samples[variant].append(await connection.exchange())
    for connection in connections.values():
        connection.close()
    return samples


async def measure(servers: dict[str, list[tuple[int, int]]], args, body: dict) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds over the variants, each round measuring every process of every variant:
    a turn per process index, the variants in rotated order; `servers` maps variant -> [(port,
    pid), ...]."""
    results = {v: {"rate": [], "cpu": [], "background": [], "latency": []} for v in servers}
    for processes in servers.values():  # warm-up: imports, first-request costs
        for port, pid in processes:
            await throughput(port, pid, 0.3, args.concurrency, body)
    for round_ in range(args.rounds):
        for index in range(args.processes):  # a turn: the index-th process of every variant
            for variant in rotation(list(servers), round_ * args.processes + index):
                port, pid = servers[variant][index]
                rps, cpu, background = await throughput(port, pid, args.seconds, args.concurrency, body)
                results[variant]["rate"].append(rps)
                results[variant]["cpu"].append(cpu)
                results[variant]["background"].append(background)
        ports = {v: processes[round_ % len(processes)][0] for v, processes in servers.items()}
        for variant, samples in (await ttfb(ports, args.sequential, body)).items():
            results[variant]["latency"].extend(samples)
    return results


def main() -> None:
    args = arguments(
        "AceSpecDec overhead vs the bare app and OTel ASGI",
        (*VARIANTS, *ACE_VARIANTS),
        concurrency=8,
        redis=True,
        prompt=True,
        stacks=SERVER_STACKS,
    )
    if args.serve:
        serve(args.serve)
        return
    if args.server == "uvicorn-standard":
        missing = [name for name in ("httptools", "uvloop") if importlib.util.find_spec(name) is None]
        if missing:
            sys.exit(f"--server uvicorn-standard needs {' and '.join(missing)}: pip install 'uvicorn[standard]'")
    os.environ[SERVER_ENV] = args.server
    variants = chosen(VARIANTS, args.variants)
    if args.redis and REDIS_VARIANT not in variants:
        variants = (*variants, REDIS_VARIANT)
    with ExitStack() as stack:
        if REDIS_VARIANT in variants:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from support.redis_server import RedisServer  # the tests' launcher: a free port, no persistence

            redis = RedisServer().start()
            stack.callback(redis.stop)
            os.environ[REDIS_URL_ENV] = redis.url
        servers = stack.enter_context(variant_servers(__file__, variants, args.processes))
        for processes in servers.values():
            for port, _ in processes:
                wait_listening(port)
        body = request_body(args.prompt_kb)
        results = asyncio.run(measure(servers, args, body))
        size = len(json.dumps(body)) / 1024
        server = SERVER_STACKS[args.server]
        title = (
            f"streaming endpoint, {size:.1f} KB request, {CHUNKS} chunks/response, "
            f"uvicorn ({server['http']}, {server['loop']}) on loopback"
        )
        report(title, results, "req", "TTFB")
        if REDIS_VARIANT in variants and "ace" in variants:
            compare(results, "ace", REDIS_VARIANT)


def compare(results: dict[str, dict[str, list[float]]], base: str, other: str) -> None:
    """The Redis backend against the memory one: throughput and server CPU per request (medians),
    and the CPU of the fleet sync (the threads besides the serving one), which the two CPU
    figures' noise would hide."""
    median = {v: {k: statistics.median(xs) for k, xs in results[v].items()} for v in (base, other)}
    rate = median[other]["rate"] / median[base]["rate"]
    cpu = median[other]["cpu"] / median[base]["cpu"]
    print(f"\n{other} vs {base}: requests/s {rate:.1%}, server CPU per request {cpu:.1%} (target: < 105 %)")
    sync = median[other]["background"] - median[base]["background"]
    print(
        f"{other}'s fleet sync thread: {sync * 1e6:.1f} us CPU per request, "
        f"{sync / median[other]['cpu']:.2%} of its server CPU"
    )


if __name__ == "__main__":
    main()
