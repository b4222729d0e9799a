"""What a batched step costs, and how much each row of it drafts.

In a batch, speculation pays differently: a step's weights are read once for all rows, so a row
decoding alone costs nearly a whole forward, and one more row or one more draft token costs a
fraction of one; but as the batch grows the step turns compute bound and every verified draft
token costs about as much as a decoded one. So the cost table gains the batch dimension
(``BatchCosts``: a forward over B rows of q tokens, measured once per machine like ``cost.py``'s),
and each step ``plan_batch`` gives the draft tokens to the rows where they are most likely
accepted while they raise the step's expected tokens per millisecond: speculation fades out by
itself as the batch grows (TurboSpec's goodput rule, over a batch). It must beat a plain step by
``MARGIN``, as a single request's plan must.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..model import native, packed, rows, transformer
from ..model.packed import EXACT, padded_total, run_counts
from ..model.rows import Rows, Span
from ..model.transformer import Transformer
from .cost import CACHE_DIR, CostCurve, _key_text, fastest_each, logger
from .planner import MARGIN

BATCH_SIZES = (1, 2, 4, 8, 16)
ROW_TOKENS = (1, 2, 4, 8, 16)  # decoding, and verifying chains of 1, 3, 7, 15 drafts


@dataclass(frozen=True)
class BatchCosts:
    """Milliseconds of one batched forward over ``b`` rows holding ``t`` tokens in all."""

    by_rows: dict[int, CostCurve]  # rows -> ms over tokens per row
    padded: bool = False  # products run at padded row counts (packed weights): t is priced as run
    steps: dict[tuple[int, int], float] = field(default_factory=dict)  # (b, t) -> ms: steps run otherwise

    def __call__(self, b: int, t: int) -> float:
        """Linear in the rows between two measured batch sizes, at the same tokens per row; beyond
        the largest, proportional to the rows (compute bound). With ``padded``, ``t`` tokens cost
        what the row count they run at costs: one draft token over 16 decoding rows runs 32."""
        if (b, t) in self.steps:
            return self.steps[b, t]
        if self.padded and t > EXACT:  # up to EXACT tokens the table's steps ran padded as they run
            t = padded_total(t)
        q, sizes = t / b, sorted(self.by_rows)
        if b >= sizes[-1]:
            return self.by_rows[sizes[-1]](q) * b / sizes[-1]
        hi = min(s for s in sizes if s >= b)
        lo = max((s for s in sizes if s <= b), default=hi)
        if hi == lo:
            return self.by_rows[lo](q)
        w = (b - lo) / (hi - lo)
        return (1 - w) * self.by_rows[lo](q) + w * self.by_rows[hi](q)

    def with_step(self, b: int, t: int, ms: float) -> BatchCosts:
        """These costs with a step of ``b`` rows and ``t`` tokens priced at ``ms`` (a step that runs
        another way than the table's: a compiled decoding step)."""
        return replace(self, steps={**self.steps, (b, t): ms})

    def to_json(self) -> dict:
        return {str(b): curve.as_dict() for b, curve in self.by_rows.items()}

    @classmethod
    def from_json(cls, figures: dict) -> BatchCosts:
        return cls({int(b): CostCurve({int(q): float(ms) for q, ms in c.items()}) for b, c in figures.items()})

    @classmethod
    def load_or_measure(cls, target: Transformer, max_rows: int, context: int = 128) -> BatchCosts:
        """Measured once per (model, device, dtype, kernels, threads, rows) and cached beside ``cost.py``'s."""
        w = target.embed_tokens.weight
        key = [
            "batch",
            asdict(target.config),
            str(w.device),
            str(w.dtype),
            target.kernels,
            native.library_name() if native.runs_on(w) else "",
            _step_source(),
            run_counts(),
            BATCH_SIZES,
            ROW_TOKENS,
            max_rows,
        ]
        path = CACHE_DIR / f"batch-costs-{hashlib.sha256(_key_text(key).encode()).hexdigest()[:16]}.json"
        padded = target.kernels != "dense"
        try:
            return replace(cls.from_json(json.loads(path.read_text())), padded=padded)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        logger.info("measuring this machine's batched step costs once (cached in %s)", path)
        costs = replace(cls.measure(target, max_rows, context), padded=padded)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(costs.to_json()))
        except OSError:
            pass
        return costs

    @classmethod
    def measure(cls, target: Transformer, max_rows: int, context: int = 128, repeats: int = 10) -> BatchCosts:
        """B rows, each ``context`` tokens in, running q more: every (B, q) of the grid, round-robin."""
        device = target.embed_tokens.weight.device
        on_kernels = native.runs_on(target.embed_tokens.weight)
        sizes = [b for b in BATCH_SIZES if b <= max_rows] or [1]
        caches = target.batch_caches(max(sizes), context + max(ROW_TOKENS))
        ids = torch.randint(0, target.config.vocab_size, (max(sizes) * max(ROW_TOKENS),), device=device)

        def run(b: int, q: int) -> None:
            rows = Rows.build([Span(r, context, q) for r in range(b)], device, on_kernels)
            with torch.inference_mode():
                target.forward_rows(ids[: b * q], rows, caches, torch.arange(b * q, device=device))

        timers = {(b, q): (lambda b=b, q=q: run(b, q)) for b in sizes for q in ROW_TOKENS}
        ms = fastest_each(timers, device, repeats)
        return cls({b: CostCurve({q: ms[b, q] for q in ROW_TOKENS}) for b in sizes})


def _step_source() -> str:
    """A digest of the code that lays out and runs a batched step: what a step costs changes with
    it, so a table measured before a change to it is measured again, not trusted."""
    digest = hashlib.sha256()
    for module in (rows, transformer, packed):
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()[:16]


class MeasuredPrice:
    """What a part of a step costs here and now against what its table says: the running ratio
    (``WEIGHT`` per observation) of the milliseconds it took to the table's. A table times bare
    forwards once at start; a batched draft-model level also pays for the Python around its
    forward and for whatever else the machine does, and priced too low it drafts at a loss. Fixed
    at 1 when ``learns`` is False (a table given on purpose: a test's, an operator's)."""

    WEIGHT = 0.2
    MAX_RATIO = 20.0  # one stall (a page fault, another process) must not price drafting out for good

    def __init__(self, learns: bool = True) -> None:
        self.learns, self.ratio = learns, 1.0

    def __call__(self, table_ms: float) -> float:
        return table_ms * self.ratio

    def observe(self, table_ms: float, took_ms: float) -> None:
        if self.learns and table_ms > 0:
            self.ratio += self.WEIGHT * (min(took_ms / table_ms, self.MAX_RATIO) - self.ratio)


class StepOverhead:
    """What a step that verifies drafts costs beyond its table price, over what a plain step costs
    beyond its own: the milliseconds the table cannot see (a verifying row's layout, its walk of
    the chain), learned from the decode-only steps run here, a running mean (``WEIGHT``) of each
    kind's excess. Before chains attended on the native kernel, eight decoding rows on one core
    cost 0.55 ms more by the table with one row verifying two tokens, 1.2 ms more as run. Priced too
    low, a lookup's unlikely drafts cost more than they bring under load. An excess not seen again
    fades (``FORGET`` a plain step), so a stall cannot price drafting out for good."""

    WEIGHT = 0.1
    FORGET = 0.002  # a plain step's pull: an excess unseen for a thousand steps is mostly gone

    def __init__(self, learns: bool = True) -> None:
        self.learns = learns
        self.plain = self.drafted = 0.0  # running means of (took - table) ms

    @property
    def ms(self) -> float:
        return max(0.0, self.drafted - self.plain)

    def observe(self, drafted: bool, table_ms: float, took_ms: float) -> None:
        if not self.learns or table_ms <= 0:
            return
        excess = min(max(took_ms - table_ms, -table_ms), table_ms)  # one stall moves it a bounded step
        if drafted:
            self.drafted += self.WEIGHT * (excess - self.drafted)
        else:
            self.plain += self.WEIGHT * (excess - self.plain)
            self.drafted += self.FORGET * (self.plain - self.drafted)


@dataclass(frozen=True)
class RowDraft:
    """One decoding row's offer: up to ``cap`` draft tokens, each next one right with ``alpha``
    (the pessimistic end of what the row has shown, as a single request plans). ``by_model``: a
    draft model would draft them after the plan (a lookup's are found already, for free). An
    EAGLE head drafts each row alone, after the plan: its first token costs ``first_ms`` (catching
    the head up, and the root's level), each further one ``token_ms`` (a level)."""

    cap: int
    alpha: float
    by_model: bool = False
    first_ms: float = 0.0
    token_ms: float = 0.0


class DecodingTime:
    """The decoding rows' share of a step where ``decoding`` rows decode or verify, beside
    ``other_rows`` prompt chunks of ``other_tokens``: the step less what the chunks add to the
    decoding rows alone (worked out once, here). Drafts pay what they add to the step, and a step
    that carries a long chunk does not make them look cheap (against the whole step, prompt lookup
    lost a twentieth to plain from 8 clients)."""

    def __init__(self, costs: BatchCosts, decoding: int, other_rows: int, other_tokens: int) -> None:
        self._costs = costs
        self._rows, self._tokens = decoding + other_rows, decoding + other_tokens
        self._chunks_ms = (
            costs(self._rows, self._tokens) - costs(decoding, decoding) if other_rows and decoding else 0.0
        )

    def __call__(self, drafted: int, overhead_ms: float = 0.0) -> float:
        """Milliseconds with ``drafted`` draft tokens in all; ``overhead_ms``: a verifying step's
        cost beyond the table (``StepOverhead``), paid once any row verifies."""
        step_ms = self._costs(self._rows, self._tokens + drafted) + (overhead_ms if drafted else 0.0)
        return step_ms - self._chunks_ms


def plan_batch(
    offers: Sequence[RowDraft],
    other_rows: int,
    other_tokens: int,
    costs: BatchCosts,
    level_ms: Sequence[float] = (),
    overhead_ms: float = 0.0,
) -> list[int]:
    """Draft tokens to verify per decoding row (0: a plain step for it), for the most expected
    tokens per millisecond of the whole step; ``other_rows`` and ``other_tokens`` are the step's
    prompt chunks, which cost time and emit nothing new (``DecodingTime``: their share of the step
    is not the decoding rows'); ``overhead_ms``: what a verifying step costs beyond the table. A
    draft model drafts a level for all its rows in one batched forward, so the j-th token of any
    model row first costs ``level_ms[j - 1]`` (the first level also catches its rows up on what
    they have not run; the last entry repeats); an EAGLE row's tokens cost what its offer says,
    for that row alone.

    A chain's j-th token adds ``alpha^j`` expected tokens, less than its predecessor, so handing
    tokens out best-first (a heap) and keeping the best prefix of that order is the best plan.
    """
    n = len(offers)
    expected, drafted, drafting_ms, levels = float(n), 0, 0.0, 0
    decoding_ms = DecodingTime(costs, n, other_rows, other_tokens)
    best_rate = (1.0 + MARGIN) * expected / decoding_ms(0)
    drafts, best = [0] * n, [0] * n
    heap = [(-o.alpha, i, 1) for i, o in enumerate(offers) if o.cap > 0 and o.alpha > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i, depth = heapq.heappop(heap)
        drafts[i] = depth
        expected -= neg_gain
        drafted += 1
        if offers[i].by_model and depth > levels:
            levels, drafting_ms = depth, drafting_ms + level_ms[min(depth, len(level_ms)) - 1]
        drafting_ms += offers[i].first_ms if depth == 1 else offers[i].token_ms
        rate = expected / (decoding_ms(drafted, overhead_ms) + drafting_ms)
        if rate > best_rate:
            best_rate, best = rate, list(drafts)
        if depth < offers[i].cap:
            heapq.heappush(heap, (neg_gain * offers[i].alpha, i, depth + 1))
    return best
