"""benchmarks/closed_loop.py prints its table: four policies measured in one run, with the ratios
the target is stated in. Driven here against a fake upstream engine (the real engine's figures are
the benchmark's business, not a test's)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support.paths import ROOT
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

pytest.importorskip("torch")


def test_closed_loop_benchmark_prints_every_policy_with_its_ratios(tmp_path):
    engine = FakeUpstream(Script(figures=figures(10, 8, 4)))
    with serve_asgi(engine.app) as url:
        run = subprocess.run(
            [sys.executable, "benchmarks/closed_loop.py", "--upstream", url, "--adapter", "vllm", "--requests", "4"]
            + ["--out", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("policy ")))
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in lines[header + 1 : header + 5]}
    assert list(rows) == ["speed", "acceptance", "always-on", "always-off"]
    number = r"\d+\.\d+"
    for policy, cells in rows.items():
        # tokens/s with its interval, then speed's ratio to it with the paired interval
        versus = "" if policy == "speed" else rf" +{number}x \[{number}-{number}\]"
        assert re.match(rf"{number} \[{number}-{number}\]{versus} ", cells), cells
    assert any(line.startswith("target: speed >= every static policy in aggregate: ") for line in lines)
    assert any(line.startswith("target: speed >= 0.97x the per-tenant oracle: ") for line in lines)
    assert any(line.startswith("target: no tenant below 0.95x its best static policy: ") for line in lines)
    oracle = next(line for line in lines if line.startswith("per-tenant oracle"))
    assert re.search(rf"speed / oracle {number}x \[{number}-{number}\]", oracle), oracle
    tenants = lines[lines.index("output tokens/s per tenant:") + 2 :]
    assert {
        line.split()[0] for line in tenants if line and not line.startswith(("report", "target", "per-tenant"))
    } >= {"org", "flaky"}
    assert (tmp_path / "report.md").exists()
