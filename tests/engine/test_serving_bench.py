"""benchmarks/serving.py prints its table: our engine server and llama-server, both real processes
on loopback, at each concurrency asked for, with the ratio the targets of issue 24 are stated in."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from support.paths import ROOT

from ace_mw.demo import llamacpp

pytest.importorskip("torch")


def test_the_serving_benchmark_prints_each_server_at_each_concurrency():
    run = subprocess.run(
        [sys.executable, "benchmarks/serving.py", "--concurrency", "1", "2", "--requests-per-client", "1"]
        + ["--max-tokens", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("server "))
    rows = {(cells[0], int(cells[1])): cells[2:] for cells in (line.split() for line in lines[header + 1 :])}
    peers = ["ace-mw", "llama.cpp"] if llamacpp.server_binary() is not None else ["ace-mw"]
    assert set(rows) == {(server, clients) for server in peers for clients in (1, 2)}
    for cells in rows.values():
        tokens_per_s, *latencies = (float(c) for c in cells[:5])
        assert tokens_per_s > 0 and all(math.isfinite(v) and v >= 0 for v in latencies)
    if "llama.cpp" in peers:
        assert all(rows["ace-mw", c][5].endswith("x") for c in (1, 2))
    else:
        assert "llama-server is not built here" in run.stdout
