"""Instructions per request of the asgi_overhead.py servers, counted by valgrind: a figure that a
busy or noisy machine cannot move (requests/s on a shared 2-core VM drift by 10-30 % between runs).

    python benchmarks/asgi_instructions.py [--variants bare floor ace_read ace_unread] [--requests 100]

Each variant's uvicorn server (the same app and middleware as asgi_overhead.py) runs under
`valgrind --tool=cachegrind`; one keep-alive client sends a warm-up, then `--requests` more
sequential requests, to a second server started the same way with 20 fewer. The difference of the
two totals, divided by the difference in requests, is the cost of one request: start-up and
shutdown cancel out. Prints it per variant and against the first variant (the bare app).
Needs valgrind (apt-get install valgrind); about a minute per variant. Under valgrind a server
answers some ten requests a second, below `gate.max_measured_per_s`, so the default `ace` reads
every response here: `ace_read` and `ace_unread` are the two costs its traffic mixes at full speed.
`--variants ace ace_redis` compares the state backends' hot paths (a redis-server is started for
it; redis-server on PATH): the fleet sync runs once a minute there, so the counts hold the
per-request work only (`asgi_overhead.py --redis` measures the sync thread's CPU at full speed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from asgi_overhead import REDIS_URL_ENV, REDIS_VARIANT, SYNC_INTERVAL_ENV, Connection, wait_listening

HERE = Path(__file__).resolve().parent
WARM_UP = 10  # requests before the counted ones: imports, first-request caches
BASELINE = 20  # requests of the shorter run


def total_instructions(variant: str, requests: int) -> int:
    """Instructions of one server process serving WARM_UP + `requests` requests, start to exit."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "valgrind.log"
        server = subprocess.Popen(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=no",
                "--cachegrind-out-file=/dev/null",
                f"--log-file={log}",
                sys.executable,
                str(HERE / "asgi_overhead.py"),
                "--serve",
                variant,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts in every run
        )
        try:
            port = wait_listening(int(server.stdout.readline()), timeout=300)
            asyncio.run(exchange(port, WARM_UP + requests))
        finally:
            server.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown; valgrind then reports
            server.wait(300)
        found = re.search(r"I\s+refs:\s+([\d,]+)", log.read_text())
        if found is None:
            raise RuntimeError(f"valgrind reported no instruction count for {variant}")
        return int(found.group(1).replace(",", ""))


async def exchange(port: int, requests: int) -> None:
    connection = await Connection(port).open()
    for _ in range(requests):
        await connection.exchange()
    connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants", nargs="+", default=["bare", "floor", "ace_read", "ace_unread"], help="asgi_overhead.py variants"
    )
    parser.add_argument("--requests", type=int, default=100, help="requests counted per variant")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: apt-get install valgrind")
    per_request = {}
    with ExitStack() as stack:
        if REDIS_VARIANT in args.variants:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from support.redis_server import RedisServer  # the tests' launcher: a free port, no persistence

            redis = RedisServer().start()
            stack.callback(redis.stop)
            os.environ[REDIS_URL_ENV] = redis.url
            os.environ[SYNC_INTERVAL_ENV] = "60"  # the longest allowed: no periodic sync while counting
        for variant in args.variants:
            short, long = (total_instructions(variant, n) for n in (BASELINE, BASELINE + args.requests))
            per_request[variant] = (long - short) / args.requests
            print(f"  {variant}: {per_request[variant] / 1e6:.3f} M instructions per request", flush=True)
    base = per_request[args.variants[0]]
    print("\nuvicorn, streaming endpoint of 100 chunks, instructions per request (valgrind)")
    print(f"{'variant':10} {'M instr':>9} {'added':>9} {'bare / variant':>15}")
    for variant, n in per_request.items():
        print(f"{variant:10} {n / 1e6:9.3f} {(n - base) / 1e6:9.3f} {base / n:15.1%}")


if __name__ == "__main__":
    main()
