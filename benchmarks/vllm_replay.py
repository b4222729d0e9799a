"""Replay: the speed policy on the per-request speeds that `benchmarks/vllm_pools.py` measured.

    python benchmarks/vllm_replay.py bench_out/vllm-pools/report.json [more report.json ...]
    python benchmarks/vllm_replay.py --warm-rounds 1 2 3 --seeds 200 runs/*/report.json

A vLLM run takes a quarter of an hour; a change to the policy is judged here in seconds. Every
report holds, for each request at one client, what each static pool (plain, prompt lookup, EAGLE-3,
the draft model) took to answer it. The replay sends the same tenants' requests through the real
in-memory store with the vLLM benchmark's adaptive gate (decide/, state/; a simulated clock): the
store admits each request to an arm, the arm's measured speed for that request (from a report
drawn at random: the runs' own noise) is fed back as its sample, and the drafters' acceptance
feeds the breaker as vLLM reported it (prompt lookup about 0.45, the others about 0.23).
It prints what adaptive would have made of the measured phase after 1, 2, 3 rounds of warm-up,
as a ratio to prompt lookup (the best static pool at one client for every tenant), its spread
over seeds, the worst tenant, and where the requests went. One client only: bursts need the pools.
Greedy tenants only: the temperature gate holds a hot tenant's requests to plain decoding before
the speed policy sees them.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ace_mw import GateConfig, InMemoryStateStore
from ace_mw.decide.samples import SpeedSample
from ace_mw.demo.vllm_run import HOT

ARMS = {"plain": "plain", "ngram": "ngram/k4@ngram", "eagle3": "eagle_3/k4@eagle3", "draft": "draft_model/k4@draft"}
LABELS = tuple(ARMS.values())
ACCEPTANCE = {"ngram": 0.45, "eagle3": 0.24, "draft": 0.23}  # what vLLM reported on these pools
JUDGED = ("eagle3", "draft")  # the drafters the breaker judges under the speed policy (gate.breaker_judges)
SECONDS_BETWEEN = 4.0  # six policies take turns at about 0.6 s a request
# One request's answer on each pool: index -> pool -> (tokens, seconds, tenant, its speed sample).
Answer = tuple[int, float, str, SpeedSample]
Run = Mapping[int, Mapping[str, Answer]]


def load(paths: Sequence[Path]) -> list[Run]:
    runs: list[Run] = []
    for path in paths:
        rows: dict[int, dict[str, Answer]] = collections.defaultdict(dict)
        for r in json.loads(path.read_text())["results"]:
            if r["phase"] == "single" and r["policy"] in ARMS and not r["error"] and r["tenant"] not in HOT:
                rows[r["index"]][r["policy"]] = (r["tokens"], r["latency_s"], r["tenant"], _sample(r))
        complete = {i: row for i, row in rows.items() if len(row) == len(ARMS)}
        if complete:
            runs.append(complete)
    return runs


def _sample(result: Mapping[str, Any]) -> SpeedSample:
    """What the middleware learnt of the answer: its decode with the prefill apart where vLLM's
    timing was recorded (reports since 2026-12-07), else the whole request as the client timed it."""
    first, decode, prompt = result.get("first_token_s"), result.get("decode_s"), result.get("prompt_tokens")
    if first is None or decode is None or prompt is None or result["tokens"] < 2:
        return SpeedSample(result["tokens"], result["latency_s"], "engine")
    return SpeedSample(result["tokens"] - 1, decode, "engine", first, prompt)


def gate() -> GateConfig:
    """The vLLM benchmark's adaptive gate (ace_mw/demo/vllm_run.py), every response read."""
    return GateConfig(
        policy="speed", speed_min_samples=2, max_measured_per_s=math.inf, speed_counts="request", speed_half_life_s=3600
    )


Replayed = tuple[float, dict[str, float], collections.Counter[str]]


def replay(runs: Sequence[Run], warm_rounds: int, seed: int) -> Replayed:
    """(adaptive over prompt lookup in the measured round, the same per tenant, arms taken)."""
    rng = random.Random(seed)
    store, config, now = InMemoryStateStore(), gate(), 0.0
    indices = sorted(set().union(*runs))  # request i is the same prompt in every run that sent it
    half = len(indices) // 2
    ours: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    arms: collections.Counter[str] = collections.Counter()
    for round_ in range(warm_rounds + 1):
        measured = round_ == warm_rounds
        order = indices if measured else indices[half:] + indices[:half]  # the warm-up in another order
        for index in order:
            run = rng.choice([run for run in runs if index in run])
            tenant = run[index]["plain"][2]
            key = (tenant, "ace-tiny-chat")
            admission = store.admit(key, LABELS, config, now, rng.random())
            pool = list(ARMS)[admission.arm]
            tokens, seconds, _, sample = run[index][pool]
            store.record_speed(key, ARMS[pool], sample, config, now + seconds)
            if pool in JUDGED:
                store.record(key, ACCEPTANCE[pool], probe=admission.probe, gate=config, now=now + seconds)
            elif admission.probe:
                store.release(key)
            now += SECONDS_BETWEEN
            if measured:
                best = run[index]["ngram"]
                sums = ours[tenant]
                sums[0] += tokens
                sums[1] += seconds
                sums[2] += best[0]
                sums[3] += best[1]
                arms[pool] += 1
    total = [sum(s[i] for s in ours.values()) for i in range(4)]
    ratio = (total[0] / total[1]) / (total[2] / total[3])
    return ratio, {t: (s[0] / s[1]) / (s[2] / s[3]) for t, s in ours.items()}, arms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report.json files of benchmarks/vllm_pools.py")
    parser.add_argument("--warm-rounds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seeds", type=int, default=100)
    args = parser.parse_args()
    runs = load(args.reports)
    if not runs:
        print("no report with per-request results of every static pool", file=sys.stderr)
        return 2
    print(f"{len(runs)} run(s), {args.seeds} seeds; adaptive over prompt lookup in the measured round, one client")
    print(f"{'warm-up rounds':>14}  {'median':>6}  {'p10-p90':>11}  {'worst tenant':>12}  requests per arm (mean)")
    for rounds in args.warm_rounds:
        found = [replay(runs, rounds, seed) for seed in range(args.seeds)]
        ratios = sorted(r for r, _, _ in found)
        worst = statistics.median(min(t.values()) for _, t, _ in found)
        arms = sum((a for _, _, a in found), collections.Counter[str]())
        spread = f"{ratios[len(ratios) // 10]:.2f}-{ratios[len(ratios) * 9 // 10]:.2f}"
        taken = ", ".join(f"{pool} {arms[pool] / args.seeds:.1f}" for pool in ARMS)
        print(f"{rounds:>14}  {statistics.median(ratios):>5.2f}x  {spread:>11}  {worst:>11.2f}x  {taken}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
