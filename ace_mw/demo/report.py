"""What a workload run measured, as tables, charts and files: `report.md`, `report.json`, PNGs.

Aggregate output tokens/s of a policy is the sum of its output tokens over the sum of its request
latencies (client-side, end to end, prefill included; requests run one at a time, so that sum is
the time the policy had the engine). TPOT is decode time per output token after the first: from
the client's own chunk times for streams, from the engine's reported decode time for non-streaming
responses (none where the engine reports none). Failed requests count in no figure.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ace_mw.config import GateConfig
from ace_mw.engine.prompts import CATEGORIES

from .workload import FLAKY, PREDICTABLE, TENANT_NAMES, UNPREDICTABLE

if TYPE_CHECKING:
    from .runner import Record


def static(policies: Sequence[str]) -> list[str]:
    """The static policies of a run (`always-*`): what the adaptive one is measured against."""
    return [p for p in policies if p.startswith("always-")]


CHARTS = {
    "alpha": "alpha.png",
    "tokens": "tokens_per_s.png",
    "arms": "arms.png",
}


@dataclass(frozen=True)
class PolicyRow:
    policy: str
    tokens_per_s: float | None
    median_tpot_ms: float | None
    p90_tpot_ms: float | None
    requests: int
    errors: int
    speculated: float  # share of its requests the policy sent to speculate (decision applied)
    interval: tuple[float, float] | None = None  # the 95 % bootstrap interval of tokens_per_s

    @property
    def cells(self) -> list[str]:
        return [
            self.policy,
            with_interval(self.tokens_per_s, self.interval),
            _fmt(self.median_tpot_ms, "{:.2f}"),
            _fmt(self.p90_tpot_ms, "{:.2f}"),
            str(self.requests),
            f"{self.speculated:.0%}",
        ]


POLICY_COLUMNS = [
    "policy",
    "output tokens/s [95 % interval]",
    "median TPOT ms",
    "p90 TPOT ms",
    "requests",
    "speculated",
]


def tokens_per_s(records: Iterable[Record]) -> float | None:
    """Aggregate output tokens/s: all tokens over all the time the requests took."""
    ok = [r for r in records if r.error is None]
    seconds = sum(r.latency_s for r in ok)
    return sum(r.tokens for r in ok) / seconds if seconds > 0 else None


def policy_row(policy: str, records: Sequence[Record]) -> PolicyRow:
    mine = [r for r in records if r.policy == policy]
    tpots = sorted(r.tpot_s * 1e3 for r in mine if r.error is None and r.tpot_s is not None)
    return PolicyRow(
        policy,
        tokens_per_s(mine),
        statistics.median(tpots) if tpots else None,
        _percentile(tpots, 0.9),
        len(mine),
        sum(r.error is not None for r in mine),
        sum(r.speculated for r in mine) / len(mine) if mine else 0.0,
        rate_interval(mine),
    )


def policy_rows(records: Sequence[Record], policies: Sequence[str]) -> list[PolicyRow]:
    return [policy_row(p, records) for p in policies]


def by_group(records: Sequence[Record], policies: Sequence[str], group: str) -> dict[str, dict[str, float | None]]:
    """{group value: {policy: tokens/s}} for `group` "tenant", "category" or "phase" (the flaky
    tenant's), in the workload's order."""
    order = {"tenant": TENANT_NAMES, "category": CATEGORIES, "phase": (PREDICTABLE, UNPREDICTABLE)}[group]
    seen = {getattr(r, group) for r in records}
    values = [v for v in order if v in seen]
    return {
        v: {p: tokens_per_s(r for r in records if r.policy == p and getattr(r, group) == v) for p in policies}
        for v in values
    }


def answer(rows: Sequence[PolicyRow], records: Sequence[Record], subject: str = "adaptive") -> str:
    """One line: the subject policy's tokens/s and its ratio to each static policy, with the ratio's
    95 % interval. Where that interval holds 1 the run cannot tell the two apart, and the line says
    so instead of printing a ratio that reads like a verdict. Last, its ratio to the per-tenant
    oracle (each tenant on its best static policy in hindsight: a bound, not a rival)."""
    rates = {row.policy: row.tokens_per_s for row in rows if row.tokens_per_s}
    mine = rates.get(subject)
    if mine is None:
        return f"{subject}: no completed requests"
    verdicts = []
    for other in (p for p in static([row.policy for row in rows]) if p in rates):
        low, high = ratio_interval(records, subject, other) or (0.0, math.inf)
        if low <= 1.0 <= high:
            shown = f"{low:.2f}-{high:.2f}" if math.isfinite(high) else "unknown"
            verdicts.append(f"too short to tell against {other} (95 % interval {shown})")
        else:
            verdicts.append(f"{mine / rates[other]:.2f}x {other} [{low:.2f}-{high:.2f}]")
    found = oracle(records, [row.policy for row in rows], subject)
    if found.ratio is not None:
        shown = f" [{found.interval[0]:.2f}-{found.interval[1]:.2f}]" if found.interval else ""
        verdicts.append(f"{found.ratio:.2f}x the per-tenant oracle{shown}")
    return f"{subject}: {mine:.1f} tok/s = " + ", ".join(verdicts)


BOOTSTRAP_ROUNDS = 2000


def ratio_interval(
    records: Sequence[Record], subject: str, other: str, rounds: int = BOOTSTRAP_ROUNDS
) -> tuple[float, float] | None:
    """The 95 % paired bootstrap interval of subject / other aggregate tokens/s. Every workload
    request went to each policy, so a draw resamples requests and keeps each request's pair (what
    the prompt and the machine's moment did to both). None with fewer than two complete pairs."""
    pairs: dict[int, dict[str, Record]] = {}
    for r in records:
        if r.error is None and r.policy in (subject, other):
            pairs.setdefault(r.index, {})[r.policy] = r
    return paired_interval([(p[subject], p[other]) for p in pairs.values() if len(p) == 2], rounds)


class Timed(Protocol):
    """A request or a burst: tokens out over seconds taken."""

    @property
    def tokens(self) -> int: ...

    @property
    def latency_s(self) -> float: ...


def paired_interval(pairs: Sequence[tuple[Timed, Timed]], rounds: int = BOOTSTRAP_ROUNDS) -> tuple[float, float] | None:
    """The 95 % bootstrap interval of the ratio of aggregate tokens/s, a's over b's, resampling
    the pairs whole (requests, or bursts of them). None with fewer than two pairs."""
    if len(pairs) < 2:
        return None
    draw = random.Random(0)  # the same interval for the same records
    ratios = []
    for _ in range(rounds):
        sample = [pairs[draw.randrange(len(pairs))] for _ in pairs]
        seconds_a, seconds_b = sum(a.latency_s for a, _ in sample), sum(b.latency_s for _, b in sample)
        tokens_a, tokens_b = sum(a.tokens for a, _ in sample), sum(b.tokens for _, b in sample)
        if seconds_a > 0 and seconds_b > 0 and tokens_b > 0:
            ratios.append((tokens_a / seconds_a) / (tokens_b / seconds_b))
    return _central(ratios)


def rate_interval(records: Iterable[Record], rounds: int = 1000) -> tuple[float, float] | None:
    """The 95 % bootstrap interval of aggregate tokens/s over `records` (resampled requests).
    None with fewer than two completed requests."""
    ok = [r for r in records if r.error is None]
    if len(ok) < 2:
        return None
    draw = random.Random(0)
    rates = []
    for _ in range(rounds):
        sample = [ok[draw.randrange(len(ok))] for _ in ok]
        seconds = sum(r.latency_s for r in sample)
        if seconds > 0:
            rates.append(sum(r.tokens for r in sample) / seconds)
    return _central(rates)


def _central(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    values.sort()
    return values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))]


def with_interval(value: float | None, interval: tuple[float, float] | None, spec: str = "{:.1f}") -> str:
    """`66.3 [60.1-70.2]`, or the value alone where there is no interval."""
    if value is None:
        return "n/a"
    shown = spec.format(value)
    return f"{shown} [{spec.format(interval[0])}-{spec.format(interval[1])}]" if interval else shown


@dataclass(frozen=True)
class Oracle:
    """Per tenant, its best static policy (the one it would have been best served by, known only
    after the run) and both rates; in aggregate, the tokens/s had every tenant run its own best."""

    per_tenant: dict[str, tuple[str, float, float | None]]  # tenant -> (best static, its rate, subject's rate)
    aggregate: float | None
    subject: float | None
    # 95 % paired-bootstrap intervals of subject / oracle: per tenant, and over all tenants
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    interval: tuple[float, float] | None = None

    @property
    def ratio(self) -> float | None:
        return self.subject / self.aggregate if self.subject and self.aggregate else None


def oracle(records: Sequence[Record], policies: Sequence[str], subject: str) -> Oracle:
    """Each tenant's best static policy in hindsight, and the subject against it. The subject's
    and the oracle's responses to one request are a pair, as in `ratio_interval`."""
    rates = by_group(records, policies, "tenant")
    per_tenant: dict[str, tuple[str, float, float | None]] = {}
    by_index = {(r.index, r.policy): r for r in records if r.error is None}
    pairs: dict[str, list[tuple[Record, Record]]] = {}
    chosen: list[Record] = []
    for tenant, by_policy in rates.items():
        measured = [(rate, p) for p in static(policies) if (rate := by_policy.get(p))]
        if not measured:
            continue
        best_rate, best = max(measured)
        per_tenant[tenant] = (best, best_rate, by_policy.get(subject))
        mine = [r for r in records if r.tenant == tenant and r.policy == best]
        chosen += mine
        pairs[tenant] = [(by_index[r.index, subject], r) for r in mine if (r.index, subject) in by_index]
    mine_rate = tokens_per_s(r for r in records if r.policy == subject and r.tenant in per_tenant)
    intervals = {tenant: paired_interval(p, 1000) for tenant, p in pairs.items()}
    overall = paired_interval([pair for p in pairs.values() for pair in p])
    return Oracle(per_tenant, tokens_per_s(chosen), mine_rate, intervals, overall)


def oracle_table(found: Oracle, subject: str) -> str:
    rows = [
        [
            tenant,
            best,
            f"{rate:.1f}",
            _fmt(mine, "{:.1f}"),
            with_interval(mine / rate, found.intervals.get(tenant), "{:.2f}") + "x" if mine else "n/a",
        ]
        for tenant, (best, rate, mine) in found.per_tenant.items()
    ]
    if found.aggregate and found.subject:
        rows.append(
            [
                "**all**",
                "each tenant's best",
                f"{found.aggregate:.1f}",
                f"{found.subject:.1f}",
                f"**{with_interval(found.ratio, found.interval, '{:.2f}')}x**",
            ]
        )
    return markdown_table(
        [
            "tenant",
            "best static policy (oracle)",
            "its tokens/s",
            f"{subject} tokens/s",
            f"{subject} / oracle [95 % interval]",
        ],
        rows,
    )


def prior_table(priors: Sequence[Mapping[str, Any]]) -> str:
    """The pooled priors per arm (the status page's), as the warm-up left them."""
    rows = [
        [f"`{p['arm']}`", f"{p['speedup']:.2f}x", f"{p['spread']:.2f}", str(p["tenants"]), f"{p['samples']:.1f}"]
        for p in priors
    ]
    return markdown_table(["arm", "speed over plain", "spread (log)", "tenants", "samples"], rows)


def breaker_events(records: Sequence[Record], policy: str) -> list[tuple[str, float, str, int]]:
    """(tenant, at_s, "trip" | "close", index) from the breaker states after each response."""
    events = []
    before: dict[str, str] = {}
    for r in records:
        if r.policy != policy or not r.breaker:
            continue
        previous = before.get(r.tenant, "closed")
        if r.breaker == "open" and previous != "open":
            events.append((r.tenant, r.at_s, "trip", r.index))
        elif r.breaker == "closed" and previous != "closed":
            events.append((r.tenant, r.at_s, "close", r.index))
        before[r.tenant] = r.breaker
    return events


def reasons(records: Sequence[Record], policy: str, tenant: str) -> str:
    counts = Counter(r.reason or "-" for r in records if r.policy == policy and r.tenant == tenant)
    return ", ".join(f"{reason} {n}" for reason, n in counts.most_common())


# -- text -----------------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def group_table(records: Sequence[Record], policies: Sequence[str], group: str, extra: Mapping[str, str]) -> str:
    """Output tokens/s per group value and policy, each with its 95 % bootstrap interval."""
    table = by_group(records, policies, group)
    subject = policies[0]
    header = [group, *policies, *([f"{subject} decisions"] if group == "tenant" else [])]
    rows = []
    for value, rates in table.items():
        cells = []
        for p in policies:
            mine = [r for r in records if r.policy == p and getattr(r, group) == value]
            cells.append(with_interval(rates[p], rate_interval(mine)))
        row = [value, *cells]
        if group == "tenant":
            row.append(reasons(records, subject, value))
        rows.append(row)
    lines = [markdown_table(header, rows)]
    if extra:
        lines.append("\n" + "\n".join(f"- `{k}`: {v}" for k, v in extra.items()))
    return "\n".join(lines)


def render_markdown(records: Sequence[Record], policies: Sequence[str], meta: Mapping[str, Any]) -> str:
    rows = policy_rows(records, policies)
    parts = [
        "# ace-mw demo report",
        "",
        markdown_table(POLICY_COLUMNS, (row.cells for row in rows)),
        "",
        f"**{answer(rows, records, policies[0])}**",
        "",
        meta["conditions"],
    ]
    if meta.get("interrupted"):
        parts += ["", "**Interrupted**: this is what was measured before Ctrl-C."]
    parts += ["", "## The policies", "", *(f"- `{p}`: {meta['policies'][p]}" for p in policies)]
    parts += ["", "Every figure in brackets is a 95 % bootstrap interval over the requests."]
    parts += ["", "## Per tenant: output tokens/s", "", group_table(records, policies, "tenant", meta["tenants"])]
    parts += ["", f"## {policies[0]} against the per-tenant oracle", ""]
    parts += [oracle_table(oracle(records, policies, policies[0]), policies[0])]
    if meta.get("prior_rows"):
        parts += ["", f"## The priors {policies[0]} started from (after the warm-up)", ""]
        parts += [prior_table(meta["prior_rows"])]
    parts += ["", "## Per category: output tokens/s", "", group_table(records, policies, "category", {})]
    flaky = [r for r in records if r.tenant == FLAKY]
    parts += ["", "## The flaky tenant by phase: output tokens/s", "", group_table(flaky, policies, "phase", {})]
    events = breaker_events(records, policies[0])
    parts += ["", f"## Breaker events ({policies[0]})", ""]
    parts += [f"- {at:.0f} s, request {i}: {tenant} {kind}" for tenant, at, kind, i in events] or ["- none"]
    parts += ["", meta["calibration"]]
    parts += ["", "## Charts", ""]
    parts += [f"![{name}]({file})" for name, file in CHARTS.items()]
    parts += ["", "## How it was measured", "", meta["method"], ""]
    return "\n".join(parts)


def write_report(out: Path, records: Sequence[Record], policies: Sequence[str], meta: Mapping[str, Any]) -> Path:
    """report.md, report.json and the charts into `out`; returns the report.md path."""
    out.mkdir(parents=True, exist_ok=True)
    rows = policy_rows(records, policies)
    (out / "report.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "policies": [asdict(row) for row in rows],
                "records": [asdict(r) for r in records],
            },
            indent=1,
        )
    )
    charts(out, records, policies, meta)
    path = out / "report.md"
    path.write_text(render_markdown(records, policies, meta))
    return path


# -- charts ---------------------------------------------------------------------------------------


def charts(out: Path, records: Sequence[Record], policies: Sequence[str], meta: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subject = policies[0]
    adaptive = [r for r in records if r.policy == subject]

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for tenant in dict.fromkeys(r.tenant for r in adaptive):
        mine = [r for r in adaptive if r.tenant == tenant]
        if any(r.rolling_alpha is not None for r in mine):
            alphas = [math.nan if r.rolling_alpha is None else r.rolling_alpha for r in mine]
            ax.plot([r.at_s for r in mine], alphas, marker=".", label=tenant)
    for tenant, at, kind, _ in breaker_events(records, subject):
        ax.axvline(at, color="tab:red" if kind == "trip" else "tab:green", linestyle=":", linewidth=1)
        ax.annotate(f"{tenant} {kind}", (at, 1.02), rotation=90, fontsize=7, va="bottom", ha="center")
    gate = meta.get("gate", {})
    for name, style in (("alpha_floor", "--"), ("reenable_threshold", "-.")):
        if name in gate:
            default = getattr(GateConfig(), name)
            label = f"{name} {gate[name]:g} (this demo; default {default:g})"
            ax.axhline(gate[name], color="grey", linestyle=style, linewidth=0.8, label=label)
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("rolling alpha after the response")
    ax.set_title(f"{subject}: rolling acceptance per tenant; trips (red) and closes (green)")
    ax.legend(fontsize=8, loc="lower left")
    _save(fig, out / CHARTS["alpha"])

    table = by_group(records, policies, "tenant")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(policies)
    names = list(table)
    for i, policy in enumerate(policies):
        values = [table[t][policy] or 0.0 for t in names]
        spans = [rate_interval(r for r in records if r.policy == policy and r.tenant == t) for t in names]
        errors = [
            [v - s[0] if s else 0.0 for v, s in zip(values, spans, strict=True)],
            [s[1] - v if s else 0.0 for v, s in zip(values, spans, strict=True)],
        ]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=policy, yerr=errors, capsize=2)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("output tokens/s")
    ax.set_title("output tokens/s by policy, per tenant (bars: 95 % bootstrap intervals)")
    ax.legend(fontsize=8)
    _save(fig, out / CHARTS["tokens"])

    multi = [r for r in adaptive if r.tenant == meta.get("multi_tenant", "multi")]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    labels = list(dict.fromkeys(["plain", *meta.get("multi_arms", []), *(r.arm or f"({r.reason})" for r in multi)]))
    for reason in dict.fromkeys(r.reason for r in multi):
        mine = [r for r in multi if r.reason == reason]
        ax.scatter([r.at_s for r in mine], [labels.index(r.arm or f"({r.reason})") for r in mine], label=reason)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.5, len(labels) - 0.5)
    ax.set_xlabel("seconds into the run")
    ax.set_title(f"{subject}: the arm the gate chose for the multi-candidate tenant (colour: reason)")
    if multi:
        ax.legend(fontsize=8, loc="upper right")
    _save(fig, out / CHARTS["arms"])


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)
