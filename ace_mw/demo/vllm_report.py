"""The report of `ace-mw demo --engine vllm` and `benchmarks/vllm_pools.py`: the measured data of
vllm_run.py written as report.json and rendered as the markdown tables that both print."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import vllm, vllm_run
from .vllm_run import BURSTS, POLICIES, STATIC


def table(data: Mapping[str, Any]) -> str:
    """The report's tables, in markdown."""
    rows = data["policies"]
    best_single = max(STATIC, key=lambda p: rows[p]["single_tok_s"] or 0)
    best_burst = max(STATIC, key=lambda p: rows[p]["burst_tok_s"] or 0)

    def ratio(policy: str, key: str, to: str) -> str:
        """`policy` over `to`, with the 95 % paired bootstrap interval of adaptive over `to`."""
        a, b = rows[policy][key], rows[to][key]
        if not (a and b):
            return "-"
        interval = rows[to].get("paired", {}).get("single" if key == "single_tok_s" else "bursts")
        return f"{a / b:.2f}x{_bracketed(interval)}"

    lines = [
        f"vLLM {data['vllm']} pools of ace-tiny-chat (fp32, K = {vllm.K}, {'eager' if data['eager'] else 'compiled'}), "
        f"{data['requests']} requests at one client, bursts of {', '.join(map(str, BURSTS))} clients x "
        f"{data['per_client']} requests ({data.get('burst_rounds', 1)} round(s), the order rotated), "
        f"{data['max_tokens']} tokens max, greedy; measured {data['when']} UTC.",
        "",
        "| policy | 1 client (tok/s) | bursts (tok/s) | "
        + " | ".join(f"{c} clients" for c in BURSTS)
        + " | greedy: same text as plain |",
        "|---|---|---|" + "---|" * len(BURSTS) + "---|",
    ]
    for policy in POLICIES:
        row = rows[policy]
        same, total = data["exact"][policy]
        by = [f"{row['burst_by_clients'].get(c) or 0:.1f}" for c in BURSTS]
        speeds = f"{row['single_tok_s'] or 0:.1f} | {row['burst_tok_s'] or 0:.1f}"
        lines.append(f"| {policy} | {speeds} | {' | '.join(by)} | {same}/{total} |")
    lines += [
        "",
        f"adaptive: {ratio('adaptive', 'single_tok_s', best_single)} the best static pool at one client "
        f"({best_single}), "
        f"{ratio('adaptive', 'burst_tok_s', best_burst)} under bursts ({best_burst}); "
        f"against vLLM's dynamic speculation {ratio('adaptive', 'single_tok_s', 'vllm-dynamic')} at one client and "
        f"{ratio('adaptive', 'burst_tok_s', 'vllm-dynamic')} under bursts.",
        "",
        "| tenant | phase | best static pool | its tok/s | adaptive tok/s | adaptive / best [95 % paired] |",
        "|---|---|---|---|---|---|",
    ]
    for tenant, phases in data["tenants"].items():
        for phase, name in (("single", "one client"), ("bursts", "bursts")):
            found = phases[phase]
            best, over_best, interval = found["best_static"], found["adaptive_vs_best"], found.get("interval")
            lines.append(
                f"| {tenant} | {name} | {best} | {found['tok_s'][best]:.1f} | {found['tok_s']['adaptive']:.1f} | "
                + (f"{over_best:.2f}x" if over_best is not None else "-")
                + f"{_bracketed(interval)} |"
            )
    lines += [
        "",
        "adaptive's arms: " + "; ".join(f"{phase}: {dict(counts)}" for phase, counts in data["adaptive_arms"].items()),
        "",
        "adaptive's reasons: "
        + "; ".join(f"{phase}: {dict(counts)}" for phase, counts in data.get("adaptive_reasons", {}).items()),
    ]
    return "\n".join(lines)


def _bracketed(interval: Sequence[float] | None) -> str:
    """A 95 % interval as the tables print it after a ratio, or nothing."""
    return f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""


def run(out: Path, **options: Any) -> dict[str, Any]:
    data = vllm_run.measure(**options)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "report.md").write_text("# ace-mw on real vLLM pools\n\n" + table(data) + "\n")
    return data
