"""The engine's slots: as many requests at a time as the engine runs, behind a bounded FIFO.

The engine's loop (`BatchEngine`) has a row of its cache per running request, so `slots` of them
run at once (one for an `Engine`'s own loop: requests take turns). A
queue without a bound turns an overload into clients that hang for minutes; past `max_waiting`
waiting requests the server refuses at once, with 429 and a `Retry-After` of the queue's expected
wait (the moving average of how long a request holds a slot, times the rounds of requests ahead),
as OpenAI-compatible servers do.
A request whose client left while it waited keeps its place until its turn, and then costs the
engine nothing (ClientGone).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import JSONResponse

from .request import RequestError

SERVICE_SMOOTHING = 0.2  # the weight of the latest request in the moving average of service time


class QueueFull(RequestError):
    """A request beyond the queue bound: 429 with `Retry-After`."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(
            f"the engine is busy: {waiting} requests are already waiting (the server's --max-waiting); "
            f"retry after {retry_after_s} s",
            None,
            "queue_full",
            status=429,
            kind="rate_limit_error",
        )
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.to_openai_error(), status_code=self.status, headers={"retry-after": str(self.retry_after_s)}
        )


class ClientGone(RequestError):
    """The client left while its request waited for the engine: its turn passes on with no engine
    work done (499, nginx's "client closed request"; nobody is there to read it, the metrics count it)."""

    def __init__(self) -> None:
        super().__init__("the client left while it waited for the engine", None, "client_gone", status=499)


class EngineSlot:
    """The engine's slots and their waiting line. `acquire` raises QueueFull when `max_waiting`
    requests already wait, and ClientGone (the slot passed on) when the client left while it
    waited; `release` may be called from another task (a streaming body frees the engine when the
    response ends)."""

    def __init__(self, max_waiting: int, slots: int = 1) -> None:
        self._lock = anyio.Semaphore(slots)
        self.slots, self.max_waiting = slots, max_waiting
        self.waiting = 0
        self._service_s = 1.0  # until measured: a guess of one second a request

    @property
    def running(self) -> int:
        return self.slots - self._lock.value

    def retry_after_s(self) -> int:
        """The wait for the queue ahead: the requests before it, `slots` at a time."""
        return max(1, math.ceil(self._service_s * (self.waiting // self.slots + 1)))

    async def acquire(self, gone: Callable[[], Awaitable[bool]]) -> float:
        """Wait for a slot (`gone` says whether the client left meanwhile); returns when it was taken."""
        if self._lock.value == 0 and self.waiting >= self.max_waiting:
            raise QueueFull(self.waiting, self.retry_after_s())
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        if await gone():
            self._lock.release()
            raise ClientGone()
        return time.monotonic()

    def release(self, held_since: float) -> None:
        """Free a slot taken at `held_since` (what `acquire` returned)."""
        held = time.monotonic() - held_since
        self._service_s += SERVICE_SMOOTHING * (held - self._service_s)
        self._lock.release()
