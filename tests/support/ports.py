"""Free loopback ports for the real servers the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a server that binds it itself, in another process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening_socket(port: int = 0) -> socket.socket:
    """A bound, listening TCP socket on 127.0.0.1, to hand to uvicorn: connections that arrive
    before it serves wait in the backlog instead of being refused. IPPROTO_TCP explicitly: asyncio
    sets TCP_NODELAY only on such sockets; without it Nagle and delayed ACKs hold small streamed
    chunks back by ~40 ms."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock
