"""Zero-downtime configuration: which config is in force, and a config file watched for changes.

A new config is always built and validated whole first (`AceConfig` checks every field on
construction), then swapped in with one reference assignment (`AceController.update`): a request
keeps the config it was decided with, and a config that fails validation never replaces the one in
force. `ConfigRecord` says which config is in force (version, when, from where); `Rejection` keeps
the last attempt that failed, for the status page.

`ConfigFile` polls one file from a daemon thread, so nothing on the request path ever waits for
it, whatever runs the requests (an asyncio loop, a sync gRPC thread pool). Polling reads the file
(configs are small; regular files only, opened without blocking) and compares its SHA-256. A
change is applied once the same new content has been seen at two consecutive polls and parses;
a change that looks like a save still under way (it drops a table the config in force has, or a
TOML file that does not end with a line break: what a writer stalled mid-file leaves) is held
for `HOLD_S` more, with a warning, and dropped from consideration as soon as the file changes
again. A save by rename (write aside, then move over the file) is never seen half-written; see
docs/configuration.md. `health()` says what the watcher is doing, for the status page.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config import AceConfig
from ..config_file import file_format, parse_document, read_config_file
from ..errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_RELOAD_INTERVAL_S = 1.0
HOLD_S = 10.0  # a change that looks unfinished waits at least this long (and 10 intervals)
STUCK_S = 10.0  # a poll running longer than this (and 3 intervals) shows as stuck


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


class Reloadable(Protocol):
    """What a watcher needs of whoever runs the config (`AceController`)."""

    def reload(self, load: Callable[[], AceConfig], source: str) -> ConfigRecord:
        """Build a config with `load` and swap it in; a ConfigError is recorded and raised."""

    def reject(self, source: str, error: str) -> Rejection:
        """Record a config that could not be loaded."""


class ConfigFile:
    """One TOML or JSON config file: `load` it once, then `start` polling it for a controller."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.format = file_format(self.path)  # ConfigError for an unsupported extension
        self.source = f"file:{self.path}"
        self._clock = clock
        self._in_force: bytes | None = None  # SHA-256 of the content the controller runs
        self._tables: frozenset[str] = frozenset()  # the tables of that content ("admin", "keys.<k>", ...)
        self._refused: bytes | None = None  # of the content last rejected (not retried until it changes)
        self._pending: bytes | None = None  # of a changed content, waiting to settle
        self._pending_since = 0.0  # when it was first seen (the watcher's clock)
        self._held: tuple[str, float] | None = None  # why the settled pending content waits, until when
        self._controller: Reloadable | None = None
        self._interval = DEFAULT_RELOAD_INTERVAL_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What the watcher is doing, for health(); written by the polling thread only.
        self._polls = 0
        self._last_poll_at: float | None = None  # wall clock
        self._poll_started: float | None = None  # the watcher's clock, while a poll runs
        self._failures_in_a_row = 0
        self._last_error: str | None = None

    def load(self) -> AceConfig:
        """The file's config, now (a ConfigError if it cannot be read or is invalid); its content
        is then taken as the one in force."""
        data = read_config_file(self.path)
        document = parse_document(data, self.format, str(self.path))
        config = AceConfig.from_dict(document)
        self._in_force, self._tables = _digest(data), table_paths(document)
        return config

    def start(self, controller: Reloadable, interval_s: float = DEFAULT_RELOAD_INTERVAL_S) -> None:
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
        now = self._clock()
        try:
            data: bytes | None = read_config_file(self.path)
            problem = ""
        except ConfigError as exc:  # missing (maybe mid-replace), not a regular file, unreadable, too large
            data, problem = None, str(exc)
        digest = _digest(data) if data is not None else b""
        if digest == self._in_force:
            self._pending = self._refused = self._held = None
            return
        if digest == self._refused:
            return
        if digest != self._pending:
            self._pending, self._pending_since, self._held = digest, now, None  # let the writer finish
            return
        try:
            if data is None:
                raise ConfigError(str(self.path), problem)
            document = parse_document(data, self.format, str(self.path))
        except ConfigError as exc:
            controller.reject(self.source, str(exc))
            self._pending, self._refused = None, digest
            return
        tables = table_paths(document)
        doubt = self._doubt(data, tables)
        if doubt and now < self._pending_since + self._hold_s():
            if self._held is None:
                self._held = (doubt, self._pending_since + self._hold_s())
                logger.warning(
                    "ace-mw holds the change to %s for %.0f s: %s (a save still under way?); it applies then "
                    "unless the file changes again",
                    self.path,
                    self._hold_s(),
                    doubt,
                )
            return
        self._pending = self._held = None
        try:
            controller.reload(lambda: AceConfig.from_dict(document), self.source)
        except ConfigError:
            self._refused = digest
        else:
            self._in_force, self._tables = digest, tables

    def health(self) -> dict[str, Any]:
        """The watcher as the status page shows it: whether it runs, when it last looked, a poll
        stuck on the file system, failures, and a change it holds back."""
        now = self._clock()
        started = self._poll_started
        running_for = None if started is None else now - started
        thread = self._thread
        held = self._held
        return {
            "path": str(self.path),
            "interval_s": self._interval,
            "running": thread is not None and thread.is_alive(),
            "polls": self._polls,
            "last_poll_at": self._last_poll_at,
            "stuck": running_for is not None and running_for > max(STUCK_S, 3 * self._interval),
            "poll_running_s": None if running_for is None else round(running_for, 3),
            "failures_in_a_row": self._failures_in_a_row,
            "last_error": self._last_error,
            "held": None if held is None else {"why": held[0], "applies_in_s": round(max(0.0, held[1] - now), 3)},
        }

    def _doubt(self, data: bytes, tables: frozenset[str]) -> str:
        """Why a settled change may be a save still under way ("" when it looks whole)."""
        dropped = self._tables - tables
        if dropped:
            # Named by their top-level table only: a nested name may be a raw key (keys."sk-...").
            whole = sorted(path for path in dropped if "." not in path)
            inside = sorted({path.split(".", 1)[0] for path in dropped if "." in path} - set(whole))
            named = [f"[{name}]" for name in whole] + [f"tables inside [{name}]" for name in inside]
            return "it drops " + ", ".join(named)
        if self.format == "toml" and data.strip() and not data.endswith((b"\n", b"\r")):
            return "it does not end with a line break"
        return ""

    def _hold_s(self) -> float:
        return max(HOLD_S, 10 * self._interval)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll_started = self._clock()
            try:
                self.poll()
            except Exception as exc:  # the watcher must outlive any surprise; the config in force stays
                self._failures_in_a_row += 1
                self._last_error = f"{type(exc).__name__}: {exc}"[:300]
                logger.exception("ace-mw config watcher failed on %s", self.path)
            else:
                self._failures_in_a_row = 0
            finally:
                self._polls += 1
                self._poll_started = None
                self._last_poll_at = time.time()


def table_paths(document: Any, prefix: str = "") -> frozenset[str]:
    """The dotted paths of every table in a parsed document ("admin", "keys.sha256:ab..."): a
    change that loses one may be a file cut short."""
    if not isinstance(document, Mapping):
        return frozenset()
    found: set[str] = set()
    for name, value in document.items():
        if isinstance(value, Mapping):
            path = f"{prefix}{name}"
            found.add(path)
            found |= table_paths(value, path + ".")
    return frozenset(found)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# A forked child (gunicorn --preload, multiprocessing) inherits no threads: restart its watchers.
_watching: set[ConfigFile] = set()


def _restart_in_child() -> None:
    for watcher in list(_watching):
        if watcher._controller is not None:
            watcher.start(watcher._controller, watcher._interval)


os.register_at_fork(after_in_child=_restart_in_child)
