"""Benchmark: the closed loop's policies on one mixed workload, measured in the same run.

    python benchmarks/closed_loop.py                              # 180 requests of 64 tokens
    python benchmarks/closed_loop.py --requests 48 --max-tokens 32
    python benchmarks/closed_loop.py --engine llamacpp            # real llama-server pools

The demo's workload (`ace_mw.demo.workload`: six tenants with repetitive/extraction prompts, code,
chat and math from the held-out set, temperatures 0 to 1.2, a tenant whose traffic turns
unpredictable mid-run) goes through one `AceSpecDec` per policy in front of the same engine,
request by request with the first policy rotating. In-process engine (the bundled model): `speed`
(the speed-aware gate, the default policy), `acceptance` (the first candidate while the breaker and
the temperature gate allow), `always-on` and `always-off` (see `workload.policy_config`). With
`--engine llamacpp`: `speed` against each static pool, `always-ngram` (prompt lookup), `always-draft`
(the draft model) and `always-off` (the plain pool). It prints aggregate output tokens/s per policy
with the ratios to the best static policy and to always-off, overall and per tenant, with each
tenant's best static policy (the per-tenant oracle), and writes the demo's report into --out.
Targets: speed >= 0.97x the best static policy and >= always-off (issue 7); on real pools, >= the
best static policy and >= 1.1x always-off, every tenant within 5 % of its own best (issue 23).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ace_mw.cli import add_workload_arguments
from ace_mw.errors import UsageError

POLICIES = ("speed", "acceptance", "always-on", "always-off")
POOL_POLICIES = ("speed", "always-ngram", "always-draft", "always-off")
TARGET = 0.97


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def rate(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def overall_table(records: Sequence, policies: Sequence[str]) -> list[str]:
    from ace_mw.demo.report import policy_rows, static

    rows = policy_rows(records, policies)
    rates = {row.policy: row.tokens_per_s for row in rows}
    best = max(static(policies), key=lambda p: rates[p] or 0.0)
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
    """Per tenant, every policy's rate and speed over the tenant's best static policy (the oracle)."""
    from ace_mw.demo.report import by_group, oracle

    found = oracle(records, policies, "speed")
    head = [f"{'tenant':8}", *(f"{p:>13}" for p in policies), f"{'best static':>13}", f"{'speed/best':>11}"]
    lines = [" ".join(head)]
    for tenant, rates in by_group(records, policies, "tenant").items():
        best, best_rate, _ = found.per_tenant.get(tenant, ("n/a", None, None))
        cells = [f"{tenant:8}", *(f"{rate(rates[p]):>13}" for p in policies)]
        lines.append(" ".join([*cells, f"{best:>13}", f"{ratio(rates['speed'], best_rate):>11}"]))
    lines.append(
        f"per-tenant oracle (each tenant on its best static policy): {rate(found.aggregate)} tokens/s; "
        f"speed / oracle {ratio(found.subject, found.aggregate)}"
    )
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

        policies = POOL_POLICIES if args.engine == "llamacpp" else POLICIES
        done = measure(args, policies)
    except UsageError as exc:
        print(f"closed_loop: error: {exc}", file=sys.stderr)
        return 2
    if not done.records:
        print("no responses")
        return 130 if done.interrupted else 1
    print()
    print(done.meta["conditions"])
    print("output tokens/s, all tenants:")
    print("\n".join(overall_table(done.records, policies)))
    print("\noutput tokens/s per tenant:")
    print("\n".join(tenant_table(done.records, policies)))
    report = write_report(done.checked.out, done.records, policies, done.meta)
    print(f"\nreport: {report}")
    return 130 if done.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
