"""How a replica's sync with Redis is doing: a breaker around Redis and what the health page says.

A failed sync backs off (exponential with jitter, up to BACKOFF_CAP_S) and marks the replica
degraded: it decides on its own state until Redis answers again. The first failure is logged, then
one warning per LOG_EVERY_S; the return is logged with how long it took. Written by the sync
thread only; `report` is read from any thread (a stale figure is harmless there).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from .redaction import describe, redact

logger = logging.getLogger("ace_mw.state.fleet")

BACKOFF_CAP_S = 10.0
LOG_EVERY_S = 60.0  # while Redis is unreachable, one warning per this many seconds


class SyncHealth:
    def __init__(self, url: str, sync_interval_s: float, clock: Callable[[], float]) -> None:
        self._url = url
        self._interval = sync_interval_s
        self._clock = clock
        self.degraded = False
        self.degraded_since: float | None = None  # wall clock
        self.last_ok: float | None = None  # local clock
        self.retry_at = 0.0
        self._last_log = 0.0
        self.syncs = 0
        self.errors = 0
        self.failed_in_a_row = 0
        self.key_errors = 0
        self.last_error: str | None = None
        self.last_sync_s: float | None = None

    def may_try(self, now: float) -> bool:
        """Whether a sync may run now: always, unless Redis is away and its backoff is not over."""
        return not self.degraded or now >= self.retry_at

    def key_failed(self, error: BaseException) -> None:
        """One key's script failed inside a sync that went through."""
        self.key_errors += 1
        self.last_error = describe(error, self._url)

    def succeeded(self, seconds: float) -> None:
        self.syncs += 1
        self.last_ok = self._clock()
        self.last_sync_s = seconds
        if self.degraded:
            logger.info(
                "ace-mw fleet state: Redis at %s is reachable again after %.1f s (%d failed syncs); "
                "the samples kept meanwhile are merged",
                redact(self._url),
                time.time() - (self.degraded_since or time.time()),
                self.failed_in_a_row,
            )
        self.degraded, self.degraded_since, self.failed_in_a_row = False, None, 0

    def failed(self, exc: BaseException) -> None:
        """Count, back off (exponential, jittered, capped), log the first failure and then once per
        LOG_EVERY_S; requests keep being decided on local state throughout."""
        now = self._clock()
        self.errors += 1
        self.failed_in_a_row += 1
        self.last_error = describe(exc, self._url)
        backoff = min(BACKOFF_CAP_S, self._interval * 2 ** min(self.failed_in_a_row - 1, 16))
        self.retry_at = now + backoff * random.uniform(0.5, 1.0)
        if not self.degraded:
            self.degraded, self.degraded_since, self._last_log = True, time.time(), now
            logger.warning(
                "ace-mw fleet state: Redis at %s unreachable (%s); deciding on this replica's own state "
                "until it returns",
                redact(self._url),
                self.last_error,
            )
        elif now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.warning(
                "ace-mw fleet state: Redis at %s still unreachable: %d failed syncs in a row (%s)",
                redact(self._url),
                self.failed_in_a_row,
                self.last_error,
            )

    def report(self, running: bool, now: float) -> dict[str, Any]:
        """The health page's figures of the sync (`running`: its thread is alive)."""
        since = self.degraded_since
        return {
            "running": running,
            "connected": running and self.last_ok is not None and not self.degraded,
            "degraded": self.degraded,
            "degraded_since": since,  # wall clock (Unix time)
            "degraded_for_s": None if since is None else round(time.time() - since, 3),
            "fleet_view_age_s": None if self.last_ok is None else round(now - self.last_ok, 3),
            "sync_interval_s": self._interval,
            "syncs": self.syncs,
            "sync_errors": self.errors,
            "failed_in_a_row": self.failed_in_a_row,
            "key_errors": self.key_errors,
            "last_error": self.last_error,
            "retry_in_s": round(max(0.0, self.retry_at - now), 3) if self.degraded else 0.0,
            "last_sync_ms": None if self.last_sync_s is None else round(self.last_sync_s * 1e3, 2),
        }
