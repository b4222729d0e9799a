"""A fleet under load: streaming clients across thousands of tenants through two AceSpecDec replicas
sharing one redis-server, next to the same app served bare; then the same while Redis is SIGKILLed
and restarted.

    python benchmarks/fleet_load.py [--seconds 10] [--clients 12] [--tenants 5000] [--cap 500]

Everything runs on loopback and stops by itself: one redis-server (started here, on a free port),
two replica processes (uvicorn, AceSpecDec in prod mode with `state.backend = "redis"`, at most
`--cap` tenants tracked each) and one bare process (the same streaming endpoint, no middleware).
Per phase, `--clients` keep-alive clients send streaming chat completions, each with a developer
key drawn at random from `--tenants`, for `--seconds`; they are spread evenly over replica A,
replica B and the bare app, so each server carries the same load. Every response is de-chunked and
compared byte for byte with the bare app's answer (the usage chunk the middleware forces is cut out
again, so they must be equal). One more client alternates sequential requests between replica A
and the bare app for the latency columns (same load, same moment). The replicas' memory (RSS) is
sampled every half second. Phase `redis-fault` kills Redis a third of the way in and restarts it
(empty) at two thirds.

Prints per phase: requests/s through the replicas, failed and corrupted responses, latency p50/p99
through a replica and bare with the difference ("added"), RSS over time, and each replica's store
health at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from asgi_overhead import wait_listening  # noqa: E402
from support.redis_server import RedisServer  # noqa: E402  (the tests' launcher: free port, no persistence)

CHUNKS = 20
PHASES = ("steady", "redis-fault")


def build_app(variant: str, redis_url: str, cap: int):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    chunk = {
        "id": "chatcmpl-load",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "load",
        "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
    }
    usage = event(
        {
            **chunk,
            "choices": [],
            "usage": {"prompt_tokens": 20, "completion_tokens": CHUNKS},
            "metrics": {
                "speculative_decoding": {"num_draft_tokens": 60, "num_accepted_draft_tokens": 45, "num_spec_steps": 12}
            },
        }
    )

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        with_usage = (body.get("stream_options") or {}).get("include_usage")

        async def stream():
            for i in range(CHUNKS):
                yield event({**chunk, "id": f"chatcmpl-load-{i}"})
            if with_usage:
                yield usage
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    if variant == "bare":
        return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    from ace_mw import AceConfig, AceController
    from ace_mw.integrations import AceSpecDec

    config = {
        "mode": "prod",
        "adapter": "ace",
        "gate": {"max_tracked_tenants": cap},
        "state": {"backend": "redis", "url": redis_url, "sync_interval_s": 1.0},
    }
    controller = AceController(AceConfig.from_dict(config))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(controller.store.health())

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/_health", health, methods=["GET"]),
        ]
    )
    return AceSpecDec(app, controller=controller)


def serve(variant: str, redis_url: str, cap: int) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    app = build_app(variant, redis_url, cap)
    uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)).run(sockets=[sock])


class Client:
    """A raw keep-alive HTTP/1.1 connection: one write per request, the chunked body read whole."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> Client:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def chat(self, key: str) -> bytes:
        payload = json.dumps(
            {"model": "load", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "stream": True}
        ).encode()
        self.writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"authorization: Bearer {key}\r\ncontent-length: {len(payload)}\r\n\r\n"
            ).encode()
            + payload
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(head[:80])
        body = bytearray()
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.reader.readexactly(size + 2)
            if not size:
                return bytes(body)
            body += data[:-2]

    async def get(self, path: str) -> dict:
        self.writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
        )
        return json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        self.writer.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def phase(name: str, args, replicas: list[tuple[int, int]], bare: int, redis: RedisServer, expected: bytes):
    keys = [f"sk-load-{i:05d}" for i in range(args.tenants)]
    stop = time.monotonic() + args.seconds
    done = {"replicas": 0, "bare": 0}
    failed = corrupted = 0
    latency: dict[str, list[float]] = {"ace": [], "bare": []}
    memory: list[tuple[float, float, float, int]] = []  # (t, RSS A, RSS B, tenants tracked by A)
    events: list[str] = []

    async def worker(port: int, kind: str) -> None:
        nonlocal failed, corrupted
        client = await Client(port).open()
        while time.monotonic() < stop:
            try:
                body = await client.chat(random.choice(keys))
            except (OSError, asyncio.IncompleteReadError, ValueError):
                failed += 1
                client.close()
                client = await Client(port).open()
                continue
            done[kind] += 1
            corrupted += body != expected
        client.close()

    async def prober() -> None:
        clients = {"ace": await Client(replicas[0][0]).open(), "bare": await Client(bare).open()}
        while time.monotonic() < stop:
            for variant, client in clients.items():
                start = time.perf_counter()
                await client.chat(random.choice(keys))
                latency[variant].append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
        for client in clients.values():
            client.close()

    async def sampler() -> None:
        start, health = time.monotonic(), await Client(replicas[0][0]).open()
        while time.monotonic() < stop:
            tracked = (await health.get("/_health"))["tracked"]
            memory.append((time.monotonic() - start, rss_mb(replicas[0][1]), rss_mb(replicas[1][1]), tracked))
            await asyncio.sleep(0.5)
        health.close()

    async def fault() -> None:
        await asyncio.sleep(args.seconds / 3)
        redis.kill()
        events.append(f"redis-server SIGKILLed at {args.seconds / 3:.1f} s")
        await asyncio.sleep(args.seconds / 3)
        redis.start()
        events.append(f"redis-server restarted (empty) at {2 * args.seconds / 3:.1f} s")

    began = time.monotonic()
    targets = [(replicas[0][0], "replicas"), (replicas[1][0], "replicas"), (bare, "bare")]
    tasks = [worker(*targets[i % 3]) for i in range(args.clients)] + [prober(), sampler()]
    if name == "redis-fault":
        tasks.append(fault())
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - began

    print(f"\n== phase {name}: {args.clients} clients, {args.tenants} tenants, 2 replicas + bare, {args.seconds:.0f} s")
    for line in events:
        print(f"   {line}")
    print(
        f"   requests: {done['replicas']} through the replicas ({done['replicas'] / elapsed:.0f}/s), "
        f"{done['bare']} bare ({done['bare'] / elapsed:.0f}/s); failed {failed}, corrupted {corrupted}"
    )
    ace, base = (sorted(latency[v]) for v in ("ace", "bare"))
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        a, b = _quantile(ace, q), _quantile(base, q)
        print(f"   latency {label}: replica {a * 1e3:6.2f} ms  bare {b * 1e3:6.2f} ms  added {(a - b) * 1e3:+6.2f} ms")
    print(f"   ({len(ace)} sequential probe requests each, interleaved, under the same load)")
    print("   over time: RSS MB of replica A / B, tenants A tracks")
    step = max(1, len(memory) // 6)
    print("   " + "  ".join(f"{t:4.1f}s {a:5.1f}/{b:5.1f} {n:5d}" for t, a, b, n in memory[::step]))
    capped = next((row for row in memory if row[3] >= args.cap), None)
    if capped is not None:
        last = memory[-1]
        print(
            f"   RSS growth after A reached the cap ({capped[0]:.1f} s, {args.cap} tenants): "
            f"A {last[1] - capped[1]:+.1f} MB, B {last[2] - capped[2]:+.1f} MB"
        )
    for i, (port, _) in enumerate(replicas):
        client = await Client(port).open()
        health = await client.get("/_health")
        client.close()
        keys_shown = ("connected", "tracked", "syncs", "sync_errors", "fleet_view_age_s", "last_sync_ms", "replicas")
        print(f"   store {'AB'[i]}: " + ", ".join(f"{k}={health[k]}" for k in keys_shown))
    return failed + corrupted


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=12, help="concurrent streaming clients")
    parser.add_argument("--tenants", type=int, default=5000, help="distinct developer keys")
    parser.add_argument("--cap", type=int, default=500, help="gate.max_tracked_tenants of each replica")
    parser.add_argument("--serve", choices=("ace", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.redis_url, args.cap)
        return
    redis = RedisServer().start()
    children = []
    try:
        for variant in ("ace", "ace", "bare"):
            cmd = [sys.executable, __file__, "--serve", variant, "--redis-url", redis.url, "--cap", str(args.cap)]
            children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ}))
        ports = [int(child.stdout.readline()) for child in children]
        for port in ports:
            wait_listening(port)
        replicas = [(ports[0], children[0].pid), (ports[1], children[1].pid)]
        expected = asyncio.run(_expected(ports[2]))
        bad = sum(asyncio.run(phase(name, args, replicas, ports[2], redis, expected)) for name in PHASES)
        print(f"\nfailed or corrupted responses in all phases: {bad}")
    finally:
        for child in children:
            child.terminate()
            child.wait(15)
        redis.stop()


async def _expected(port: int) -> bytes:
    client = await Client(port).open()
    body = await client.chat("sk-load-reference")
    client.close()
    return body


if __name__ == "__main__":
    main()
