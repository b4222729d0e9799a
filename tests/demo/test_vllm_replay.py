"""benchmarks/vllm_replay.py replays the vLLM pools' per-request speeds through the real store: on a
report where prompt lookup is twice plain's speed for every tenant and EAGLE-3 and the draft model
are slower than plain, the policy settles on prompt lookup, and a report without per-request
results of every pool is refused; a hot tenant's requests (the temperature gate's, not the speed
policy's) are left out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import ROOT

TENANTS = ("code", "summaries", "chat", "math")
SPEED = {"plain": 100.0, "ngram": 200.0, "eagle3": 70.0, "draft": 80.0}  # tokens/s


def report(path, requests=48, tenants=TENANTS, timed=False):
    """`timed`: with vLLM's timing (reports since 2026-12-07): prompts of 20 to 600 tokens at
    0.4 ms a token of prefill, replayed with the prefill apart."""
    results = []
    for i in range(requests):
        for pool, rate in SPEED.items():
            decode = 63 / rate * (1.0 + 0.1 * ((i * 7) % 5) / 5)  # some spread over prompts
            prompt = 20 + (i * 37) % 580
            result = {"policy": pool, "phase": "single", "index": i, "tenant": tenants[i % len(tenants)], "tokens": 64}
            if timed:
                result |= {"prompt_tokens": prompt, "first_token_s": 0.0004 * prompt, "decode_s": decode}
            results.append(result | {"latency_s": decode + (0.0004 * prompt if timed else 1 / rate), "error": None})
    path.write_text(json.dumps({"results": results}))
    return path


def replay(*args):
    return subprocess.run(
        [sys.executable, "benchmarks/vllm_replay.py", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("timed", [False, True], ids=["as-the-client-timed-it", "with-vllms-timing"])
def test_the_replay_settles_on_the_pool_that_is_fastest_for_every_tenant(tmp_path, timed):
    run = replay(report(tmp_path / "report.json", timed=timed), "--seeds", "4", "--warm-rounds", "1", "3")
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert set(rows) == {"1", "3"}
    median, worst = float(rows["3"][1].rstrip("x")), float(rows["3"][3].rstrip("x"))
    assert 0.9 <= median <= 1.0 and worst >= 0.85  # prompt lookup, less what exploration costs
    ngram = float(rows["3"][rows["3"].index("ngram") + 1].rstrip(","))
    assert ngram >= 0.9 * 48


def test_a_hot_tenants_requests_are_not_replayed(tmp_path):
    run = replay(report(tmp_path / "report.json", 60, (*TENANTS, "creative")), "--seeds", "2", "--warm-rounds", "1")
    assert run.returncode == 0, run.stderr
    row = next(line for line in run.stdout.splitlines() if line.split()[:1] == ["1"] and "plain" in line)
    taken = [float(row.split()[row.split().index(pool) + 1].rstrip(",")) for pool in SPEED]
    assert sum(taken) == 48  # the four greedy tenants' 12 each, not the creative tenant's 12


def test_a_report_without_every_pool_is_refused(tmp_path):
    empty = tmp_path / "report.json"
    empty.write_text(json.dumps({"results": []}))
    run = replay(empty)
    assert run.returncode == 2 and "no report" in run.stderr
