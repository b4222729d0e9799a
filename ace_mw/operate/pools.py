"""What each configured pool is: asked of the pool itself, off the request path, and shown on the
status page.

An adapter whose engine can describe itself has a `probe_path` (llama.cpp: `/props`; vLLM:
`/v1/models`) and a `read_probe(payload)` that turns the answer into a few facts (llama.cpp:
whether the server honours a per-request `speculative.n_max`, its build, its model; vLLM: its
model and context) or raises ValueError for an answer that is not its engine's. A pool ejected
for failing (outliers.py) is asked again every `RETRY_S`, and its answer brings it back.
`PoolProbe` asks every pool of the config in force once, from a daemon thread,
again after a failure (every `RETRY_S`) and when the config's pools change; a request never waits
for it. It also tallies, per pool, how the responses that ran there ended, so a pool that answers
without the engine's figures (not the engine the adapter expects) shows as such.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..adapters import get_adapter
from ..config import AceConfig

RETRY_S = 5.0  # a pool that failed its probe (or is ejected) is asked again after this long
HEALTHY = {"ejected": False, "ejected_for_s": 0.0, "failures_in_a_row": 0, "ejections": 0}
TIMEOUT_S = 2.0
MAX_PROBE_BYTES = 1 << 20


class PoolProbe:
    """Per pool name: the probe's last answer (facts or error) and the outcomes of its responses."""

    def __init__(
        self,
        config: Callable[[], AceConfig],
        clock: Callable[[], float] = time.monotonic,
        *,
        ejected: Callable[[str], bool] = lambda pool: False,
        on_answer: Callable[[str], None] = lambda pool: None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._ejected = ejected  # a pool out of the loop's choices is asked again every RETRY_S
        self._on_answer = on_answer  # called with a pool whose probe was answered (it is serving)
        self._lock = threading.Lock()
        self._found: dict[str, dict[str, Any]] = {}  # pool -> {"url", "at", "facts" | "error"}
        self._outcomes: dict[str, Counter[str]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start probing (idempotent); only adapters with a `probe_path` are probed."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ace-mw pool probe", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=TIMEOUT_S + 1.0)

    def note(self, pool: str, outcome: str) -> None:
        """One response that ran on `pool` ended with the observer's `outcome`."""
        with self._lock:
            counts = self._outcomes.get(pool)
            if counts is None:
                if len(self._outcomes) >= 64:  # pools come from the config: a handful
                    return
                counts = self._outcomes[pool] = Counter()
            counts[outcome] += 1

    def report(self, health: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Per configured pool: its URL, what its probe said (or why it failed), its responses, and
        whether it is ejected (`health`: outliers.PoolHealth.report())."""
        config = self._config()
        with self._lock:
            found = {name: dict(entry) for name, entry in self._found.items()}
            outcomes = {name: dict(counts) for name, counts in self._outcomes.items()}
        now = self._clock()
        rows: dict[str, dict[str, Any]] = {}
        for name, url in config.pools.items():
            entry = found.get(name) if found.get(name, {}).get("url") == url else None
            rows[name] = {
                "url": url,
                "probed": entry is not None,
                "probed_s_ago": None if entry is None else round(now - entry["at"], 1),
                "facts": None if entry is None else entry.get("facts"),
                "error": None if entry is None else entry.get("error"),
                "responses": outcomes.get(name, {}),
                **{**HEALTHY, **(health or {}).get(name, {})},
            }
        return rows

    def _run(self) -> None:
        while not self._stop.is_set():
            config = self._config()
            adapter = get_adapter(config.adapter)
            path = getattr(adapter, "probe_path", None)
            if path:
                for name, url in config.pools.items():
                    if self._due(name, url):
                        self._probe(name, url, path, adapter)
            self._wake.wait(RETRY_S)
            self._wake.clear()

    def _due(self, pool: str, url: str) -> bool:
        with self._lock:
            entry = self._found.get(pool)
        if entry is None or entry["url"] != url:
            return True
        return ("error" in entry or self._ejected(pool)) and self._clock() - entry["at"] >= RETRY_S

    def _probe(self, pool: str, url: str, path: str, adapter: Any) -> None:
        entry: dict[str, Any] = {"url": url, "at": self._clock()}
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=TIMEOUT_S) as reply:
                payload = json.loads(reply.read(MAX_PROBE_BYTES + 1)[:MAX_PROBE_BYTES])
            entry["facts"] = dict(adapter.read_probe(payload))
        except Exception as exc:  # unreachable, not JSON, not the engine's answer: shown, never raised
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        with self._lock:
            self._found[pool] = entry
        if "facts" in entry:
            self._on_answer(pool)


def warnings(pools: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What an operator must see about probed pools: unreachable or not the engine, or answering
    every response without the figures that engine always sends."""
    found = []
    for name, row in pools.items():
        if row["error"]:
            found.append(f"pool {name} ({row['url']}): probe failed: {row['error']}")
        responses = row["responses"]
        total = sum(responses.values())
        if row["probed"] and total >= 5 and responses.get("no_figures", 0) == total:
            found.append(f"pool {name}: its last {total} responses carried none of the engine's figures")
    return found
