"""The README's main command: the demo runs out of the box on the bundled models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo_output() -> str:
    run = subprocess.run(
        [sys.executable, "examples/demo.py", "--max-tokens", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def row(output: str, label: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith(label))
    return line[len(label) :].split()


def test_demo_applies_speculation_and_keeps_greedy_output_identical(demo_output):
    for label in (
        "team A, greedy ",
        "team A, greedy, streamed",
        "team B, greedy (draft model)",
        "team C, greedy (prompt lookup)",
    ):
        cells = row(demo_output, label)
        assert cells[:2] == ["applied", "ok"]
        assert float(cells[2]) >= 0 and float(cells[3]) >= 1  # alpha and tau came back
        assert cells[-1] == "yes"


def test_demo_gates_a_hot_request_and_honours_the_header(demo_output):
    assert row(demo_output, "team A, T=0.9")[:2] == ["gated", "temperature"]
    assert row(demo_output, "plain (header off)")[:2] == ["off", "mode_off"]
    assert row(demo_output, "team A, shadow header")[:2] == ["shadow", "ok"]
