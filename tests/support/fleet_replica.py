"""One gateway replica for the fleet tests and benchmark: a real uvicorn process serving AceSpecDec
in front of fake engines, its state shared through Redis.

    python tests/support/fleet_replica.py CONFIG_JSON [LIFESPAN]

prints its port, then serves until terminated. LIFESPAN says how the app meets the ASGI lifespan:
"on" (default: the app runs it), "off" (`uvicorn --lifespan off`), "unsupported" (a bare app that
raises on it, under uvicorn's default `auto`), "workers" (as "on", in `uvicorn --workers 2`: two
processes, each its own replica, sharing the port). The fake engine answering a request is picked by the
developer key: keys containing "bad" get acceptance figures far below the breaker's floor, keys
containing "speed" an engine whose speculation streams slower than plain decoding, every other key
a healthy engine where speculation streams faster. Two routes of the test app itself (not of
ace-mw) let a test look inside: GET /_store (the store's snapshot and health) and GET /_spans
(every span attribute recorded).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from uvicorn.supervisors import Multiprocess

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run as a script
from ace_mw import AceConfig, AceController
from ace_mw.integrations import AceSpecDec
from support.ports import listening_socket
from support.upstream import FakeUpstream, Script, figures

CHUNKS = tuple(f"w{i} " for i in range(5))
GOOD = figures(drafted=40, accepted=36, steps=8)  # alpha 0.9
BAD = figures(drafted=40, accepted=4, steps=8)  # alpha 0.1


def build(config: dict, lifespan: str = "on") -> tuple[AceSpecDec, InMemorySpanExporter]:
    # Speculation pays on the "bad" and "good" engines (so the speed policy keeps it on and only the
    # breaker can turn it off), and costs on the "speed" engine.
    pays, costs = {"plain": 0.004, "eagle_2": 0.001}, {"plain": 0.002, "eagle_2": 0.012}
    engines = {
        "bad": FakeUpstream(Script(chunks=CHUNKS, figures=BAD, arm_delay_s=pays), name="bad"),
        "speed": FakeUpstream(Script(chunks=CHUNKS, figures=GOOD, arm_delay_s=costs), name="speed"),
        "good": FakeUpstream(Script(chunks=CHUNKS, figures=GOOD, arm_delay_s=pays), name="good"),
    }
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    controller = AceController(AceConfig.from_dict(config), tracer_provider=provider)

    async def engines_by_key(scope: Scope, receive: Receive, send: Send) -> None:
        auth = dict(scope.get("headers", ())).get(b"authorization", b"").decode()
        kind = next((k for k in ("bad", "speed") if k in auth), "good")
        await engines[kind].app(scope, receive, send)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and lifespan == "unsupported":
            raise RuntimeError("this app does not run the lifespan")
        if scope["type"] == "http" and scope["path"] == "/_store":
            store, gate = controller.store, controller.config.gate
            tenants = [
                {
                    "tenant": view.key[0],
                    "model": view.key[1],
                    "breaker": view.breaker._asdict(),
                    "arms": {label: arm._asdict() for label, arm in view.arms.items()},
                }
                for view in store.snapshot(gate, time.monotonic(), limit=10_000)
            ]
            await JSONResponse({"health": store.health(), "tenants": tenants})(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/_spans":
            spans = [dict(span.attributes or {}) | {"name": span.name} for span in exporter.get_finished_spans()]
            await JSONResponse(spans)(scope, receive, send)
        else:
            await engines_by_key(scope, receive, send)

    return AceSpecDec(app, controller=controller), exporter


def worker_app() -> AceSpecDec:
    """The app of one `--workers` process (uvicorn imports it in each: `factory=True`)."""
    return build(json.loads(os.environ["ACE_REPLICA_CONFIG"]))[0]


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    lifespan = sys.argv[2] if len(sys.argv) > 2 else "on"
    # Listening before the port is told: the parent's first request may race uvicorn's start-up.
    sock = listening_socket()
    print(sock.getsockname()[1], flush=True)
    options = {"log_level": "warning", "access_log": False, "http": "h11", "loop": "asyncio"}
    if lifespan == "workers":
        os.environ["ACE_REPLICA_CONFIG"] = sys.argv[1]
        # The workers are spawned and import this module by name: from this folder.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, (os.path.dirname(__file__), os.environ.get("PYTHONPATH")))
        )
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        config = uvicorn.Config("fleet_replica:worker_app", factory=True, workers=2, **options)
        Multiprocess(config, sockets=[sock]).run()
        return
    middleware, _ = build(json.loads(sys.argv[1]), lifespan)
    mode = {"on": "on", "off": "off", "unsupported": "auto"}[lifespan]
    uvicorn.Server(uvicorn.Config(middleware, lifespan=mode, **options)).run(sockets=[sock])


if __name__ == "__main__":
    main()
