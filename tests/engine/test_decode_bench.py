"""benchmarks/decode.py prints one stream's decode speed, ours (eager and compiled) against the real
llama-server, with the ratio and the greedy agreement issue 24's single-stream target is stated in.
Outside CI a machine without llama-server skips it; on CI it must run."""

from __future__ import annotations

import os

import pytest
from support.benchmark_table import run_benchmark, table_rows

from ace_mw.demo import llamacpp

pytest.importorskip("torch")


def test_the_decode_benchmark_prints_eager_and_compiled_against_llama_cpp():
    if llamacpp.server_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(f"llama-server is missing on CI: .ci/run builds it ({llamacpp.HOW_TO_GET})")
        pytest.skip(f"llama-server is not built here: {llamacpp.HOW_TO_GET}")
    args = ["--threads", "1", "--prompts-per-category", "1", "--max-tokens", "6"]
    rows = table_rows(run_benchmark("decode.py", args), "threads")
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("1", "float32", "eager", "f32"),
        ("1", "float32", "compiled", "f32"),
    ]
    for cells in rows:
        ours_ms, llama_ms, ratio = float(cells[4]), float(cells[5]), float(cells[6].removesuffix("x"))
        assert ours_ms > 0 and llama_ms > 0 and ratio == pytest.approx(llama_ms / ours_ms, rel=0.5)
        same, prompts = (int(n) for n in cells[7].split("/"))
        assert prompts == 4 and 0 <= same <= prompts
