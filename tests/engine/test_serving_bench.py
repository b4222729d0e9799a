"""benchmarks/serving.py prints its table: our engine server and llama-server, both real processes
on loopback, at each concurrency asked for, with the ratio the targets of issue 24 are stated in."""

from __future__ import annotations

import importlib.util
import math

import pytest
from support.benchmark_table import run_benchmark, table_rows

from ace_mw.demo import llamacpp

pytest.importorskip("torch")


def test_the_serving_benchmark_prints_each_server_at_each_concurrency():
    args = ["--concurrency", "1", "2", "--requests-per-client", "1", "--max-tokens", "8"]
    output = run_benchmark("serving.py", args)
    rows = {(cells[0], int(cells[1])): cells[2:] for cells in table_rows(output, "server ")}
    ours = ["ace-mw", "ace-ngram", "ace-draft", "ace-eagle", "ace-fifo"]
    transformers_cb = all(importlib.util.find_spec(name) for name in ("accelerate", "fastapi"))
    peers = [*ours, *(["hf-cb"] if transformers_cb else [])]
    peers += ["llama.cpp"] if llamacpp.server_binary() is not None else []
    assert set(rows) == {(server, clients) for server in peers for clients in (1, 2)}
    for cells in rows.values():
        tokens_per_s, *latencies = (float(c) for c in cells[:5])
        assert tokens_per_s > 0 and all(math.isfinite(v) and v >= 0 for v in latencies)
    for clients in (1, 2):  # the batching server reports the share of rows that drafted
        assert rows["ace-mw", clients][5] == "0%"
        assert all(rows[variant, clients][5].endswith("%") for variant in ("ace-ngram", "ace-draft", "ace-eagle"))
        assert rows["ace-fifo", clients][5] == "-"
    if transformers_cb:  # transformers' continuous batching on the same model: no drafting figure of ours
        assert all(rows["hf-cb", c][5] == "-" for c in (1, 2))
    else:
        assert "no transformers continuous-batching peer" in output
    if "llama.cpp" in peers:
        assert all(rows[server, c][6].endswith("x") for server in ours for c in (1, 2))
    else:
        assert "llama-server is not built here" in output
