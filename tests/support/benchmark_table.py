"""Runs a script under benchmarks/ as a user would and reads back the table it prints."""

from __future__ import annotations

import subprocess
import sys

from support.paths import ROOT


def run_benchmark(script: str, args: list[str], timeout_s: float = 600) -> str:
    """The script's standard output; fails on a non-zero exit, with the end of its errors."""
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def table_rows(output: str, header: str) -> list[list[str]]:
    """The cells of every line after the first one starting with ``header``."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return [line.split() for line in lines[start + 1 :]]
