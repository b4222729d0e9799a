"""README's first command: `ace-mw demo` runs the closed loop on the bundled model and writes a report.

The demo runs as a subprocess with a tiny workload (the same code as the full run); the bad-input
and Ctrl-C tests drive it against a fake upstream engine or stop it before any model loads.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import ROOT
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

pytest.importorskip("torch")
image = pytest.importorskip("matplotlib.image")

SCRIPT = Path(sys.executable).with_name("ace-mw")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ace_mw.cli"]
POLICIES = ["adaptive", "always-on", "always-off"]
CHARTS = ("alpha.png", "tokens_per_s.png", "arms.png")
# Each static policy: a ratio with its 95 % interval, or "too short to tell" where it holds 1.
VERDICT = r"(?:[\d.]+x {p} \[[\d.]+-[\d.]+\]|too short to tell against {p} \(95 % interval (?:[\d.]+-[\d.]+|unknown)\))"
# Then its ratio to the per-tenant oracle (a bound), with the paired interval where there are pairs.
ORACLE = r"[\d.]+x the per-tenant oracle(?: \[[\d.]+-[\d.]+\])?"
ANSWER = re.compile(
    rf"^adaptive: [\d.]+ tok/s = {VERDICT.format(p='always-on')}, {VERDICT.format(p='always-off')}, {ORACLE}$"
)


def demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, "demo", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line_error(run: subprocess.CompletedProcess[str], *words: str) -> str:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("ace-mw demo: error: ")
    for word in words:
        assert word in lines[0]
    return lines[0]


def policy_table(markdown: str) -> dict[str, list[str]]:
    """The first table of report.md: policy -> its cells (a rate cell may carry its interval)."""
    lines = markdown.split("\n\n")[1].splitlines()
    assert re.match(r"\| policy \| output tokens/s( \[95 % interval\])? \| median TPOT ms \| p90 TPOT ms \|", lines[0])
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("report")
    run = demo("--quick", "--requests", "3", "--max-tokens", "8", "--out", str(out))
    return run, out


def test_quick_demo_exits_0_and_ends_with_the_answer(quick):
    run, out = quick
    assert run.returncode == 0, run.stderr
    last = run.stdout.strip().splitlines()[-2:]
    assert last[0] == f"report: {out / 'report.md'} (with report.json and the charts)"
    assert ANSWER.match(last[1]), last[1]


def test_report_opens_with_the_three_policies_and_plausible_figures(quick):
    _, out = quick
    table = policy_table((out / "report.md").read_text())
    assert list(table) == POLICIES
    for cells in table.values():
        rate, median, p90 = (float(c.split()[0]) for c in cells[:3])
        assert re.fullmatch(r"[\d.]+ \[[\d.]+-[\d.]+\]", cells[0]), cells[0]
        assert all(math.isfinite(v) and v > 0 for v in (rate, median, p90))
        assert p90 >= median
    assert table["always-off"][4] == "0%"
    assert table["always-on"][4] == "100%"


def test_report_json_holds_every_request_and_always_off_never_speculated(quick):
    _, out = quick
    report = json.loads((out / "report.json").read_text())
    records = report["records"]
    assert len(records) == 3 * len(POLICIES)
    assert {(r["index"], r["policy"]) for r in records} == {(i, p) for i in range(3) for p in POLICIES}
    for r in records:
        assert r["error"] is None and r["tokens"] > 0 and r["latency_s"] > 0
        assert {"tenant", "decision", "reason", "tpot_s", "alpha", "breaker", "rolling_alpha"} <= set(r)
    off = [r for r in records if r["policy"] == "always-off"]
    assert all(r["decision"] == "off" and r["alpha"] is None for r in off)
    assert all(r["decision"] == "applied" for r in records if r["policy"] == "always-on")
    assert [row["policy"] for row in report["policies"]] == POLICIES


@pytest.mark.parametrize("chart", CHARTS)
def test_report_charts_are_real_pngs(quick, chart):
    _, out = quick
    path = out / chart
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(path).shape
    assert width >= 400 and height >= 200
    assert f"]({chart})" in (out / "report.md").read_text()


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_docs_carry_a_sample_report_opening_for_benchmarks_demo_docs_to_refresh(doc):
    text = (ROOT / doc).read_text()
    assert text.count("<!-- demo-report:begin -->") == text.count("<!-- demo-report:end -->") == 1
    sample = text.split("<!-- demo-report:begin -->\n")[1]
    assert list(policy_table("\n\n" + sample)) == POLICIES


# -- bad input: one line, exit code 2 -----------------------------------------------------------


def test_unwritable_out_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line_error(demo("--out", str(blocker / "report")), "--out", "cannot write")


def test_model_folder_without_weights_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one_line_error(demo("--model", str(tmp_path), "--out", str(tmp_path / "r")), "--model", "no model weights")


def test_missing_model_folder_is_one_line(tmp_path):
    one_line_error(demo("--model", str(tmp_path / "nope"), "--out", str(tmp_path / "r")), "--model", "not found")


def test_unreachable_upstream_is_one_line(tmp_path):
    with serve_asgi(FakeUpstream().app) as url:
        pass  # the port is closed again
    run = demo("--upstream", url, "--adapter", "vllm", "--out", str(tmp_path))
    one_line_error(run, url, "unreachable")


def test_wrong_adapter_for_the_upstream_is_one_line(tmp_path):
    vllm_like = FakeUpstream(Script(figures=figures(10, 8, 4)))
    with serve_asgi(vllm_like.app) as url:
        run = demo("--upstream", url, "--adapter", "llamacpp", "--out", str(tmp_path))
    one_line_error(run, "none of the llamacpp adapter's figures")


def test_upstream_without_adapter_is_one_line(tmp_path):
    one_line_error(demo("--upstream", "http://127.0.0.1:9", "--out", str(tmp_path)), "--adapter")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--adapter", "tgi"], ["--adapter", "tgi"]),
        (["--requests", "0"], ["--requests"]),
        (["--model", "no/such/folder"], ["--model", "not found"]),
    ],
)
def test_the_command_line_is_checked_in_process(args, words, tmp_path, capsys):
    from ace_mw.cli import main

    assert main(["demo", "--out", str(tmp_path), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ace-mw demo: error: ")
    assert all(word in lines[0] for word in words)


# -- an external engine, and Ctrl-C -------------------------------------------------------------


def test_demo_drives_an_external_engine_through_the_middleware(tmp_path):
    vllm_like = FakeUpstream(Script(figures=figures(10, 8, 4)))
    with serve_asgi(vllm_like.app) as url:
        run = demo("--upstream", url, "--adapter", "vllm", "--requests", "4", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert list(policy_table((tmp_path / "report.md").read_text())) == POLICIES
    assert len(json.loads((tmp_path / "report.json").read_text())["records"]) == 4 * len(POLICIES)
    models = {json.loads(r.body)["model"] for r in vllm_like.received}
    assert models == {"fake-model"}


def test_ctrl_c_stops_the_servers_and_keeps_what_was_measured(tmp_path):
    slow = FakeUpstream(Script(chunks=("a",) * 10, delay_s=0.01, figures=figures(10, 8, 4)))
    # An ignored SIGINT is inherited through exec (a shell ignores it in background jobs, so a CI
    # runner may start pytest that way) and Python then leaves it ignored; a handled one is reset to
    # the default. So the demo starts as from a terminal, whatever this process was started with.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with serve_asgi(slow.app) as url:
        try:
            process = subprocess.Popen(
                [*COMMAND, "demo", "--upstream", url, "--adapter", "vllm", "--requests", "20", "--out", str(tmp_path)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        assert process.stdout is not None
        line = ""
        while not line.startswith("["):  # the first progress line: some responses are in
            line = process.stdout.readline()
            assert line, process.stderr.read() if process.stderr else ""
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert time.monotonic() - started < 30
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    assert 0 < len(records) < 20 * len(POLICIES)
    assert "Interrupted" in (tmp_path / "report.md").read_text()
    assert out.strip().splitlines()[-2].startswith("report: ")
