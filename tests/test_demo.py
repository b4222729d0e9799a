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


# label -> K the demo's config gives that key: a step accepts at most K drafts, so tau <= 1 + K.
APPLIED = {
    "team A, greedy ": 5,
    "team A, greedy, streamed": 5,
    "team B, greedy (draft model)": 4,
    "team C, greedy (prompt lookup)": 5,
}


def test_demo_applies_speculation_and_keeps_greedy_output_identical(demo_output):
    for label, k in APPLIED.items():
        cells = row(demo_output, label)
        assert cells[:2] == ["applied", "ok"]
        alpha, tau = float(cells[2]), float(cells[3])
        assert 0 < alpha <= 1 and 1 < tau <= 1 + k  # drafts were accepted, within what K allows
        assert cells[-1] == "yes"


def test_demo_streamed_request_reports_the_same_figures_as_the_plain_one(demo_output):
    """The same greedy request, streamed: the figures ride the last chunk instead of the body."""
    assert row(demo_output, "team A, greedy, streamed")[2:4] == row(demo_output, "team A, greedy ")[2:4]


def test_demo_gates_a_hot_request_and_honours_the_header(demo_output):
    assert row(demo_output, "team A, T=0.9")[:2] == ["gated", "temperature"]
    assert row(demo_output, "plain (header off)")[:2] == ["off", "mode_off"]
    assert row(demo_output, "team A, shadow header")[:2] == ["shadow", "ok"]
    for label in ("team A, T=0.9", "plain (header off)", "team A, shadow header"):
        # The engine decoded plainly: nothing drafted (no acceptance rate), one token per step.
        assert row(demo_output, label)[2:4] == ["-", "1.00"]
