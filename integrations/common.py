"""What the ASGI middleware and the gRPC interceptors share: building the controller, and counting
their own fail-opens."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ace_mw.config import AceConfig
from ace_mw.controller import AceController

ConfigLike = AceConfig | Mapping[str, Any] | str | os.PathLike[str]


def build_controller(
    config: ConfigLike | None, controller: AceController | None, reload_interval_s: float | None
) -> AceController:
    """One controller per middleware/interceptor unless the app shares its own (e.g. to call
    `controller.update()` at run time, or to serve HTTP and gRPC from one breaker state). A config
    file path is followed: every `reload_interval_s` seconds (None: loaded once)."""
    if controller is not None:
        if config is not None:
            raise TypeError("pass either config or controller, not both")
        return controller
    if isinstance(config, (str, os.PathLike)):
        return AceController.from_file(config, reload_interval_s=reload_interval_s)
    if config is None:
        config = AceConfig.from_dict({})
    elif isinstance(config, Mapping):
        config = AceConfig.from_dict(config)
    elif not isinstance(config, AceConfig):
        raise TypeError(f"config must be an AceConfig, a dict or a file path, got {type(config).__name__}")
    return AceController(config)


class FailOpen:
    """Logs and counts our own internal errors by stage; the caller then lets the request proceed
    unmodified. `counts` is what tests and dashboards read."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, stage: str) -> None:
        with self._lock:
            self.counts[stage] += 1
        self.logger.exception("ace-mw internal error in %s; the request proceeds unmodified", stage)

    def count(self, stage: str, what: str) -> None:
        """Count a fall-back that is not an exception here (the observer logged its own)."""
        with self._lock:
            self.counts[stage] += 1
        self.logger.warning("ace-mw %s (%s); the response went on unmodified", what, stage)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
