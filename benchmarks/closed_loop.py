"""Benchmark: the closed loop's policies on one mixed workload, measured in the same run.

    python benchmarks/closed_loop.py                              # 180 requests of 64 tokens
    python benchmarks/closed_loop.py --requests 48 --max-tokens 32

The demo's workload (`ace_mw.demo.workload`: six tenants with repetitive/extraction prompts, code,
chat and math from the held-out set, temperatures 0 to 1.2, a tenant whose traffic turns
unpredictable mid-run) goes through one `AceSpecDec` per policy in front of the same in-process
engine (the bundled model), request by request with the first policy rotating: `speed` (the
speed-aware gate, the default policy), `acceptance` (the first candidate while the breaker and the
temperature gate allow), `always-on` and `always-off` (see `workload.policy_config`). It prints
aggregate output tokens/s per policy with the ratios to the best static policy and to always-off,
overall and per tenant, and writes the demo's report of the four runs into --out. Target (issue 7):
speed >= 0.97x the best static policy and >= always-off. Takes the demo's flags (`--upstream` too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ace_mw.cli import add_workload_arguments
from ace_mw.errors import UsageError

POLICIES = ("speed", "acceptance", "always-on", "always-off")
STATIC = ("always-on", "always-off")
TARGET = 0.97


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def rate(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def overall_table(records: Sequence, policies: Sequence[str]) -> list[str]:
    from ace_mw.demo.report import policy_rows

    rows = policy_rows(records, policies)
    rates = {row.policy: row.tokens_per_s for row in rows}
    best = max(STATIC, key=lambda p: rates[p] or 0.0)
    lines = [
        f"{'policy':12} {'tokens/s':>9} {'vs best static':>15} {'vs always-off':>14} {'median TPOT ms':>15} "
        f"{'p90 TPOT ms':>12} {'speculated':>11}"
    ]
    for row in rows:
        median = f"{row.median_tpot_ms:.2f}" if row.median_tpot_ms is not None else "n/a"
        p90 = f"{row.p90_tpot_ms:.2f}" if row.p90_tpot_ms is not None else "n/a"
        lines.append(
            f"{row.policy:12} {rate(row.tokens_per_s):>9} {ratio(row.tokens_per_s, rates[best]):>15} "
            f"{ratio(row.tokens_per_s, rates['always-off']):>14} {median:>15} {p90:>12} {row.speculated:>11.0%}"
        )
    speed, static = rates["speed"], rates[best]
    if speed and static and rates["always-off"]:
        met = speed >= TARGET * static and speed >= rates["always-off"]
        lines.append(
            f"target: speed >= {TARGET}x the best static policy ({best}) and >= always-off: "
            f"{'met' if met else 'NOT met'} ({speed / static:.3f}x, {speed / rates['always-off']:.3f}x)"
        )
    return lines


def tenant_table(records: Sequence, policies: Sequence[str]) -> list[str]:
    from ace_mw.demo.report import by_group

    lines = [" ".join([f"{'tenant':8}", *(f"{p:>11}" for p in policies), f"{'speed/best static':>18}"])]
    for tenant, rates in by_group(records, policies, "tenant").items():
        best = max((rates[p] or 0.0) for p in STATIC)
        cells = [f"{tenant:8}", *(f"{rate(rates[p]):>11}" for p in policies), f"{ratio(rates['speed'], best):>18}"]
        lines.append(" ".join(cells))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/closed_loop.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser)
    parser.add_argument("--out", default="bench_out/closed_loop", metavar="DIR", help="report folder")
    args = parser.parse_args(argv)
    try:
        from ace_mw.demo.command import measure
        from ace_mw.demo.report import write_report

        done = measure(args, POLICIES)
    except UsageError as exc:
        print(f"closed_loop: error: {exc}", file=sys.stderr)
        return 2
    if not done.records:
        print("no responses")
        return 130 if done.interrupted else 1
    print()
    print(done.meta["conditions"])
    print("output tokens/s, all tenants:")
    print("\n".join(overall_table(done.records, POLICIES)))
    print("\noutput tokens/s per tenant:")
    print("\n".join(tenant_table(done.records, POLICIES)))
    report = write_report(done.checked.out, done.records, POLICIES, done.meta)
    print(f"\nreport: {report}")
    return 130 if done.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
