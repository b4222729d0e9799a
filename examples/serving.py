"""The one helper the examples share: serve an ASGI app with uvicorn on a given (or free) port and
say where, so a script or a test can find it."""

from __future__ import annotations

import socket

import uvicorn


def serve(app, host: str = "127.0.0.1", port: int = 0) -> None:
    """Bind and listen first (port 0 = any free port), print the URL, then serve until interrupted."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets; without it Nagle
    # and delayed ACKs hold small streamed chunks back by ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # before the line below: a client that reads it may connect at once
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
