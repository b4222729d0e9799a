"""Real servers on loopback for the integration tests: uvicorn in a thread, gRPC sync and aio."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent import futures
from contextlib import asynccontextmanager, contextmanager

import grpc
import uvicorn

from ace_mw.integrations import generation_pb2_grpc

from .ports import listening_socket

# The HTTP stack the test servers run, named rather than uvicorn's "auto" (which would switch to
# httptools and uvloop wherever they happen to be installed, and their limits differ: h11 refuses
# a request head over 16 KB, httptools takes it).
SERVER_STACK = {"http": "h11", "loop": "asyncio"}


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


@contextmanager
def serve_asgi(app, lifespan: str = "off", port: int = 0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 (a free port, or `port`) in a thread; yield its base URL."""
    sock = listening_socket(port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan=lifespan, log_level="critical", access_log=False, **SERVER_STACK)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def serve_grpc(servicer, interceptors: Sequence[grpc.ServerInterceptor] = ()) -> Iterator[str]:
    """A sync grpc server with the example Generation service; yield its target address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=list(interceptors))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(5)


@asynccontextmanager
async def serve_grpc_aio(
    servicer, interceptors: Sequence[grpc.aio.ServerInterceptor] = (), **options
) -> AsyncIterator[str]:
    """The same on grpc.aio, in the running event loop (`options` go to grpc.aio.server)."""
    server = grpc.aio.server(interceptors=list(interceptors), **options)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
