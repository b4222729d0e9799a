"""SIGTERM as an exit that runs cleanup: the engine servers a command starts must not outlive it.

Python's default SIGTERM kills the process at once, with no `finally` and no `__exit__`, so a
demo or benchmark stopped by `kill`, `timeout` or a container runtime would leave its llama-server
and vLLM processes running (a vLLM server holds gigabytes and a core). While a server is up, the
main thread turns SIGTERM into `SystemExit(143)` (128 + 15, what the shell reports for it), which
unwinds through every context manager as Ctrl-C's KeyboardInterrupt does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_STATUS = 128 + signal.SIGTERM


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_STATUS)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit in the main thread; the previous handler after.

    A handler can only be set from the main thread: elsewhere (a test's server thread) the block
    runs as it is. A handler someone else set (not Python's default) is left alone."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
