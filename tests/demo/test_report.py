"""The report's headline tells the truth: every ratio with its paired-bootstrap 95 % interval, and
"too short to tell" where the interval holds 1 (a short run must not read like a verdict)."""

from __future__ import annotations

import random
import time

from ace_mw.demo import command
from ace_mw.demo.command import Plan, conditions
from ace_mw.demo.report import answer, policy_rows, ratio_interval
from ace_mw.demo.runner import Record

POLICIES = ["adaptive", "always-on", "always-off"]


def record(index: int, policy: str, latency_s: float, tokens: int = 64) -> Record:
    return Record(
        index=index,
        policy=policy,
        tenant="org",
        category="chat",
        temperature=0.0,
        stream=True,
        header=None,
        phase="",
        decision="applied",
        reason="ok",
        arm="",
        tokens=tokens,
        latency_s=latency_s,
        ttft_s=0.01,
        tpot_s=latency_s / tokens,
        tpot_source="stream",
        alpha=None,
        breaker="",
        rolling_alpha=None,
        at_s=float(index),
    )


def workload(requests: int, speed: dict[str, float], noise: float, seed: int = 1) -> list[Record]:
    """Each request to every policy; `speed` scales a policy's tokens/s, `noise` is per-response jitter."""
    draw = random.Random(seed)
    records = []
    for i in range(requests):
        base = draw.uniform(0.5, 2.0)  # prompts differ: some take four times as long as others
        for policy in POLICIES:
            records.append(record(i, policy, base / speed[policy] * draw.uniform(1 - noise, 1 + noise)))
    return records


def test_a_clear_difference_gets_a_ratio_and_an_interval_that_excludes_one():
    records = workload(60, {"adaptive": 1.3, "always-on": 0.7, "always-off": 1.0}, noise=0.1)
    low, high = ratio_interval(records, "adaptive", "always-off")
    assert 1.0 < low < 1.3 < high < 1.6
    line = answer(policy_rows(records, POLICIES), records)
    assert "x always-off [" in line and "x always-on [" in line and "too short" not in line


def test_a_run_too_short_for_a_verdict_says_so_instead_of_a_ratio():
    records = workload(4, {"adaptive": 0.97, "always-on": 0.5, "always-off": 1.0}, noise=0.3)
    line = answer(policy_rows(records, POLICIES), records)
    assert "too short to tell against always-off (95 % interval " in line
    assert "x always-off" not in line
    assert "x always-on [" in line  # a 2x difference shows even on a short run


def test_the_interval_needs_two_complete_pairs():
    records = [record(0, "adaptive", 1.0), record(0, "always-off", 1.0), record(1, "adaptive", 1.0)]
    assert ratio_interval(records, "adaptive", "always-off") is None
    assert "too short to tell against always-off (95 % interval unknown)" in answer(
        policy_rows(records, POLICIES), records
    )


def test_the_conditions_call_a_machine_busy_only_for_load_beyond_the_demos_own(monkeypatch, tmp_path):
    """The demo keeps one core busy itself: on 2 CPUs a load of 1.1 is its own, 1.9 is other work too."""
    checked = Plan(requests=1, max_tokens=8, out=tmp_path, adapter="vllm", upstream=None, folders=(None, None, None))
    records = [record(0, "adaptive", 1.0)]
    monkeypatch.setattr(command.os, "cpu_count", lambda: 2)
    said = {}
    for load in (1.1, 1.9):
        monkeypatch.setattr(command.os, "getloadavg", lambda load=load: (load, load, load))
        said[load] = conditions(checked, {}, records, POLICIES[:1], time.time(), load)
        assert f"Load average {load:.1f} at the start, {load:.1f} at the end." in said[load]
    assert "busy with other work" not in said[1.1]
    assert "busy with other work" in said[1.9]
