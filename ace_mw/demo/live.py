"""The demo's live view: the terminal never sits silent.

Before the run a spinner names the current step (loading the model, timing the verify-cost curve,
warming up, calibrating); during it a progress bar over the responses and a small table per
tenant: the adaptive policy's decisions by reason, the arm it ran last, the rolling alpha and the
breaker state, plus each policy's output tokens/s so far. Where stdout is not a terminal (a log, a
pipe) the same goes out as plain lines: each step, then about twenty progress lines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .report import tokens_per_s
from .runner import Record
from .workload import TENANTS


@dataclass
class View:
    """What the terminal shows: a spinner with the current step, then a progress bar over the
    responses and a table per tenant: the decisions of the first (adaptive) policy, the arm it ran
    last, its rolling alpha and breaker."""

    console: Console
    policies: Sequence[str]
    records: list[Record] = field(default_factory=list)
    step: str = "starting"
    progress: Progress = field(init=False)
    task: Any = None

    def __post_init__(self) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("starting", total=None)
        self.every = 1

    def __rich__(self) -> RenderableType:
        if not self.records:
            return self.progress
        rates = " · ".join(f"{p} {_rate(self.records, p)}" for p in self.policies)
        return Group(self.progress, self.table(), Text(f"output tokens/s so far: {rates}", style="dim"))

    def phase(self, text: str) -> None:
        self.step = text
        self.progress.update(self.task, description=text)
        if not self.console.is_terminal:
            print(text, flush=True)

    def start(self, total: int) -> None:
        self.progress.update(self.task, total=total, completed=0)
        self.every = max(1, total // 20)
        self.phase(f"{total // len(self.policies)} requests x {len(self.policies)} policies")

    def record(self, record: Record) -> None:
        self.records.append(record)
        self.progress.advance(self.task)
        done = len(self.records)
        if not self.console.is_terminal and (done % self.every == 0):
            rates = " ".join(f"{p} {_rate(self.records, p)}" for p in self.policies)
            print(f"[{done}/{self.progress.tasks[0].total}] tokens/s so far: {rates}", flush=True)

    def table(self) -> Table:
        table = Table(box=None, pad_edge=False, title_justify="left")
        subject = self.policies[0]  # the adaptive policy
        for column in ("tenant", "sent", f"{subject} decisions", "arm", "rolling α", "breaker"):
            table.add_column(column)
        mine = [r for r in self.records if r.policy == subject]
        for tenant in TENANTS:
            rows = [r for r in mine if r.tenant == tenant.name]
            if not rows:
                continue
            last = rows[-1]
            reasons = Counter(r.reason for r in rows).most_common(4)
            breaker = last.breaker.upper() if last.breaker in ("open", "half_open") else last.breaker or "-"
            table.add_row(
                tenant.name,
                str(len(rows)),
                " · ".join(f"{reason} {n}" for reason, n in reasons),
                last.arm or "-",
                f"{last.rolling_alpha:.2f}" if last.rolling_alpha is not None else "-",
                f"[red]{breaker}[/red]" if breaker.isupper() else breaker,
            )
        return table


def _rate(records: Sequence[Record], policy: str) -> str:
    rate = tokens_per_s(r for r in records if r.policy == policy)
    return f"{rate:.1f}" if rate is not None else "-"
