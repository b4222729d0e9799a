"""What the ASGI middleware and the gRPC interceptors share: building the controller, and counting
their own fail-opens with the controller's."""

from __future__ import annotations

import os
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
    """An integration's own fail-opens, counted once, where the controller counts its own
    (`AceController.fail_open`: the log, `ace.spec_decode.errors`, the status page); the caller
    then lets the request proceed unmodified. `counts` is what tests and dashboards read: the
    fail-opens of the controller and of every integration on it, by stage."""

    def __init__(self, controller: AceController) -> None:
        self.controller = controller

    def record(self, stage: str) -> None:
        self.controller.fail_open(stage)

    def count(self, stage: str, what: str) -> None:
        """A fall-back that is not an exception here (the observer logged its own)."""
        self.controller.fail_open(stage, what)

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.controller.fail_opens())

    @property
    def total(self) -> int:
        return sum(self.counts.values())
