"""Shared by the overhead benchmarks: server processes per variant, the order they are measured
in, their CPU time, and the table with its paired ratios."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager


def arguments(
    description: str,
    variants: Iterable[str],
    concurrency: int,
    redis: bool = False,
    prompt: bool = False,
    stacks: Iterable[str] = (),
) -> argparse.Namespace:
    """The options both benchmarks take; `--serve VARIANT` is how a child process is started.
    With `redis`, also `--redis`: add the variant whose state lives on a redis-server; with
    `prompt`, also `--prompt-kb`: the size of the request body; with `stacks`, also `--server`:
    which of them serves (the first by default)."""
    parser = argparse.ArgumentParser(description=description)
    stacks = tuple(stacks)
    if stacks:
        parser.add_argument("--server", choices=stacks, default=stacks[0], help="the server stack under the app")
    if redis:
        parser.add_argument(
            "--redis", action="store_true", help="also measure ace_redis: AceSpecDec with state on a local redis-server"
        )
    if prompt:
        parser.add_argument(
            "--prompt-kb", type=float, default=0.0, help="pad the request's chat history to about this many KB"
        )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=tuple(variants),
        help="measure only these (the first variant, the base of every ratio, is always measured)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the variants")
    parser.add_argument(
        "--processes",
        type=int,
        default=2,
        help="server processes per variant, each measured every round: one process's memory layout "
        "(hash seed, addresses) moves its speed by several percent, so each variant pools several",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="throughput phase per variant and round")
    parser.add_argument("--concurrency", type=int, default=concurrency, help="clients in the throughput phase")
    parser.add_argument(
        "--sequential", type=int, default=100, help="sequential requests per variant and round, for the latency column"
    )
    parser.add_argument("--serve", choices=tuple(variants), help=argparse.SUPPRESS)
    return parser.parse_args()


def chosen(defaults: Sequence[str], asked: Sequence[str] | None) -> tuple[str, ...]:
    """The variants to run: `asked` (`--variants`) or `defaults`, after the base (defaults[0])."""
    rest = [v for v in (asked or defaults) if v != defaults[0]]
    return (defaults[0], *dict.fromkeys(rest))


def rotation(variants: Sequence[str], turn: int) -> list[str]:
    """The order of one turn of measurements: each turn starts one variant later, so that over the
    turns every variant holds every position equally often (a fixed order hands the first slot's
    conditions, e.g. a machine just idle, to the same variant every time)."""
    start = turn % len(variants)
    return [*variants[start:], *variants[:start]]


@contextmanager
def variant_servers(
    script: str, variants: Iterable[str], processes: int = 1
) -> Iterator[dict[str, list[tuple[int, int]]]]:
    """Run `processes` times `python <script> --serve <variant>` for each variant (each prints its
    port first); yield variant -> [(port, pid), ...], and stop them all afterwards."""
    command = [sys.executable, script, "--serve"]
    children = {
        v: [subprocess.Popen([*command, v], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        for v in variants
    }
    try:
        yield {v: [(int(child.stdout.readline()), child.pid) for child in group] for v, group in children.items()}
    finally:
        for group in children.values():
            for child in group:
                child.terminate()
                child.wait(10)


def cpu_seconds(pid: int, background: bool = False) -> float:
    """CPU time of a process, all threads, at ns resolution (Linux schedstat): robust to a busy
    machine, where requests/s are not. With `background`, only the threads other than the main
    one (which serves the requests), e.g. a state store's sync thread."""
    tasks = f"/proc/{pid}/task"
    threads = [tid for tid in os.listdir(tasks) if not (background and int(tid) == pid)]
    return sum(int(open(f"{tasks}/{tid}/schedstat").read().split()[0]) for tid in threads) / 1e9


def median_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the sample median and a distribution-free confidence interval for the
    true median at `level`, from order statistics (the count of values below the median is
    Binomial(n, 1/2)). Assumes nothing about the noise's shape; with n < 6 it is (min, max)."""
    ordered = sorted(values)
    n = len(ordered)
    # Cutting `dropped` values from each end misses the median when at most `dropped` values lie
    # below it (or above): probability 2 * P(Binomial(n, 1/2) <= dropped).
    dropped, tail = 0, 0.5**n  # tail: P(Binomial(n, 1/2) <= dropped)
    while dropped < (n - 1) // 2:
        tail_next = tail + math.comb(n, dropped + 1) * 0.5**n
        if 2 * tail_next > 1 - level:
            break
        dropped, tail = dropped + 1, tail_next
    return statistics.median(ordered), ordered[dropped], ordered[n - 1 - dropped]


def report(title: str, results: dict[str, dict[str, list[float]]], unit: str, latency: str) -> None:
    """Medians per variant, against the first variant: throughput ("rate", per second), server CPU
    per request/call ("cpu", seconds) and latency to the first byte/message ("latency", seconds).

    "paired" is the median of the per-turn ratios, each variant's rate over the base's measured in
    the same turn (same round, same process index, seconds apart), with its 95 % interval: the
    machine's speed drifts by tens of percent over seconds, and pairing cancels what the two
    measurements share. The `rate` lists must hold one entry per turn, in the same turn order."""
    medians = {v: {k: statistics.median(xs) for k, xs in data.items()} for v, data in results.items()}
    base_variant = next(iter(results))
    base = medians[base_variant]
    print(f"\n{title} (medians)")
    print(
        f"{'variant':8} {unit + '/s':>9} {'ratio':>7} {'paired [95 % CI]':>23} {'server CPU us/' + unit:>19} "
        f"{'added':>7} {latency + ' ms':>9} {'added ms':>9}"
    )
    for variant, m in medians.items():
        pairs = zip(results[variant]["rate"], results[base_variant]["rate"], strict=True)
        paired, low, high = median_interval(rate / base_rate for rate, base_rate in pairs)
        print(
            f"{variant:8} {m['rate']:9.1f} {m['rate'] / base['rate']:7.1%} "
            f"{f'{paired:.1%} [{low:.1%}, {high:.1%}]':>23} {m['cpu'] * 1e6:19.0f} "
            f"{(m['cpu'] - base['cpu']) * 1e6:7.0f} {m['latency'] * 1e3:9.3f} "
            f"{(m['latency'] - base['latency']) * 1e3:9.3f}"
        )
