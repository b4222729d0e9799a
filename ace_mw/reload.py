"""Zero-downtime configuration: which config is in force, and a config file watched for changes.

A new config is always built and validated whole first (`AceConfig` checks every field on
construction), then swapped in with one reference assignment (`AceController.update`): a request
keeps the config it was decided with, and a config that fails validation never replaces the one in
force. `ConfigRecord` says which config is in force (version, when, from where); `Rejection` keeps
the last attempt that failed, for the status page.

`ConfigFile` polls one file from a daemon thread, so nothing on the request path ever waits for
it, whatever runs the requests (an asyncio loop, a sync gRPC thread pool). Polling reads the file
(configs are small) and compares its SHA-256: a change is applied once the same new content has
been seen at two consecutive polls, so an editor's half-written save is not loaded. A saved change
is in force within two poll intervals.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import MAX_CONFIG_BYTES, AceConfig, file_format
from .errors import ConfigError

if TYPE_CHECKING:
    from .controller import AceController

logger = logging.getLogger(__name__)

DEFAULT_RELOAD_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ConfigRecord:
    """The config in force: its version (1 for the first, +1 per swap), when it was swapped in
    (wall-clock seconds) and where it came from ("code", "file:<path>", "admin")."""

    version: int
    loaded_at: float
    source: str


@dataclass(frozen=True)
class Rejection:
    """An attempt to load a config that failed validation; the previous config stayed in force."""

    at: float
    source: str
    error: str  # the ConfigError message (field path first)


class ConfigFile:
    """One TOML or JSON config file: `load` it once, then `start` polling it for a controller."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.format = file_format(self.path)  # ConfigError for an unsupported extension
        self.source = f"file:{self.path}"
        self._in_force: bytes | None = None  # SHA-256 of the content the controller runs
        self._refused: bytes | None = None  # of the content last rejected (not retried until it changes)
        self._pending: bytes | None = None  # of a changed content seen once, waiting to settle
        self._controller: AceController | None = None
        self._interval = DEFAULT_RELOAD_INTERVAL_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load(self) -> AceConfig:
        """The file's config, now (a ConfigError if it cannot be read or is invalid); its content
        is then taken as the one in force."""
        data = self._read()
        config = AceConfig.from_bytes(data, self.format, str(self.path))
        self._in_force = _digest(data)
        return config

    def start(self, controller: AceController, interval_s: float = DEFAULT_RELOAD_INTERVAL_S) -> None:
        """Poll every `interval_s` seconds from a daemon thread and apply each settled change to
        `controller` (through `controller.reload`, so a bad one is recorded and refused)."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._controller, self._interval = controller, interval_s
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"ace-mw config watcher {self.path}", daemon=True)
        self._thread.start()
        _watching.add(self)

    def stop(self) -> None:
        """Stop polling (idempotent); waits a moment for the thread (a daemon: a read stuck on a
        hung file system cannot hold up a shutdown)."""
        _watching.discard(self)
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def poll(self) -> None:
        """One look at the file: apply its content if it changed and has settled."""
        controller = self._controller
        assert controller is not None  # set by start()
        try:
            data: bytes | None = self._read()
            problem = ""
        except ConfigError as exc:  # missing (maybe mid-replace), unreadable or too large
            data, problem = None, str(exc)
        digest = _digest(data) if data is not None else b""
        if digest == self._in_force:
            self._pending = self._refused = None
            return
        if digest == self._refused:
            return
        if digest != self._pending:
            self._pending = digest  # changed since the last look: let the writer finish
            return
        self._pending = None
        if data is None:
            controller.reject(self.source, problem)
            self._refused = digest
            return
        try:
            controller.reload(lambda: AceConfig.from_bytes(data, self.format, str(self.path)), self.source)
        except ConfigError:
            self._refused = digest
        else:
            self._in_force = digest

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception:  # the watcher must outlive any surprise; the config in force stays
                logger.exception("ace-mw config watcher failed on %s", self.path)

    def _read(self) -> bytes:
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(str(self.path), f"cannot read configuration: {exc}") from exc
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(str(self.path), f"larger than {MAX_CONFIG_BYTES} bytes")
        return data


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# A forked child (gunicorn --preload, multiprocessing) inherits no threads: restart its watchers.
_watching: set[ConfigFile] = set()


def _restart_in_child() -> None:
    for watcher in list(_watching):
        if watcher._controller is not None:
            watcher.start(watcher._controller, watcher._interval)


os.register_at_fork(after_in_child=_restart_in_child)
