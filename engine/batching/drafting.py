"""The drafts of one step: what each decoding row offers, how much of it the batch verifies, and
the drafting itself (the loop's step 3, ``scheduler.py``).

Each decoding row with a drafter offers a draft, priced: prompt lookup costs nothing, a draft
model's levels and an EAGLE head's passes cost what their tables say, scaled by what they were
measured to cost here (``MeasuredPrice``). A row whose drafter costs something probes
(``planner.py``): it earns credit on its plain steps and spends it on drafts offered at the
optimistic end of its acceptance. ``plan_batch`` then gives draft tokens to the rows where they
raise the step's expected tokens per millisecond; the draft model drafts a level for all its rows
in one batched forward, an EAGLE head each row's tree alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..model import native
from ..model.rows import Outputs, Rows, Span
from ..model.transformer import Transformer
from ..planning.batch import BatchCosts, DecodingTime, MeasuredPrice, RowDraft, StepOverhead, plan_batch
from ..planning.planner import PROBE_SHARE
from .sequence import BatchSequence


class StepDrafts(NamedTuple):
    """What the step's decoding rows drafted, in their order."""

    tokens: list[int]  # each row's draft tokens to verify (0: it decodes plainly)
    speedup: float  # the step's expected tokens per ms over plain steps for every decoding row
    by_model: bool  # whether the draft model ran (the step's time is then more than the table's)


class Drafting:
    """The drafts of a loop's steps: its target's step costs, the draft model and its batch cache
    (where the engine loaded one), and what each drafter was measured to cost here."""

    def __init__(
        self,
        costs: BatchCosts,
        draft: Transformer | None,
        draft_costs: BatchCosts | None,
        learns: bool,
        rows: int,
        row_length: int,
        device: torch.device,
    ) -> None:
        """``costs``: the target's steps, as the loop runs them; ``draft``: the draft model (a
        ``Transformer``) or None, priced by ``draft_costs`` (None: measured here, then learned as its
        levels run); ``learns``: whether the target's table was measured here, so that EAGLE passes
        and a verifying step's overhead are learned as they run."""
        self.costs, self.model, self.device = costs, draft, device
        if draft is not None:
            self.draft_caches = draft.batch_caches(rows, row_length)
            self.draft_native = native.runs_on(draft.embed_tokens.weight)
            self.draft_costs = draft_costs or BatchCosts.load_or_measure(draft, rows)
        self.draft_price = MeasuredPrice(learns=draft_costs is None)
        self.head_price = MeasuredPrice(learns=learns)  # EAGLE rows' passes, each row alone
        self.step_overhead = StepOverhead(learns=learns)  # a verifying step's, beyond the table

    def draft(self, decoding: Sequence[BatchSequence], prompts: int, prompt_tokens: int) -> StepDrafts:
        """Plan and run the drafts of ``decoding``'s rows in a step that also runs ``prompts``
        prompt chunks of ``prompt_tokens`` in all."""
        offers = [self.offer(s) for s in decoding]
        model_rows = [s for s, o in zip(decoding, offers, strict=True) if o.by_model and o.cap]
        level_ms: tuple[float, ...] = ()
        if model_rows:  # the first level runs what each row has not run yet, each further one a token a row
            n, unseen = len(model_rows), sum(len(s.tokens) - s.draft_cached for s in model_rows)
            level_ms = (self.draft_price(self.draft_costs(n, unseen)), self.draft_price(self.draft_costs(n, n)))
        planned = plan_batch(offers, prompts, prompt_tokens, self.costs, level_ms, self.step_overhead.ms)
        drafts = [o.cap if s.fixed else k for s, o, k in zip(decoding, offers, planned, strict=True)]
        self.book_probes(decoding, offers, drafts, len(decoding) + prompts, len(decoding) + prompt_tokens)
        by_model = [(s, k) for s, k in zip(decoding, drafts, strict=True) if s.by_model and k]
        if by_model:
            table_ms = self.table_ms(by_model) if self.draft_price.learns else 0.0
            started = time.perf_counter()
            self.by_model(by_model)
            self.draft_price.observe(table_ms, (time.perf_counter() - started) * 1e3)
        drafts = [
            self.by_head(s, o, k) if s.head is not None and k else k
            for s, o, k in zip(decoding, offers, drafts, strict=True)
        ]
        return StepDrafts(drafts, self.speedup(offers, drafts, prompts, prompt_tokens), bool(by_model))

    def observe_step(self, decoding: Sequence[BatchSequence], prompts: int, drafts: StepDrafts, took_ms: float) -> None:
        """Learn a verifying step's overhead from a step that took ``took_ms``: one of decoding
        rows alone (no prompt chunk), none drafting by a model or a head (their passes are priced
        apart)."""
        if not self.step_overhead.learns or prompts or drafts.by_model or any(s.head is not None for s in decoding):
            return
        verified = sum(drafts.tokens)
        table_ms = self.costs(len(decoding), len(decoding) + verified)
        self.step_overhead.observe(verified > 0, table_ms, took_ms)

    def offer(self, s: BatchSequence) -> RowDraft:
        """What a decoding row could draft, and, for an EAGLE row, what its head's passes cost.

        A row whose drafter costs something probes (``planner.py``): offered at the
        optimistic end of its acceptance, but only for the tokens its credit pays for in the worst
        case (nothing accepted), the drafter's catch-up on what it has not run included; a long
        prompt's catch-up must be earned before the row probes at all."""
        cap = s.offer()
        if s.fixed:  # drafts all it can, every step (its acceptance only prices the step's speedup)
            return RowDraft(cap, s.acceptance.first.mean if s.acceptance is not None else 0.0, s.by_model)
        if s.head is not None and cap:
            costs = s.head_costs
            if costs is None or costs.head_level is None or costs.head_commit is None:
                return RowDraft(0, 0.0)  # nothing to price its passes by: plain
            first = self.head_price(costs.head_commit(max(s.head.pending, 1)) + costs.head_level(1))
            offer = RowDraft(cap, 0.0, first_ms=first, token_ms=self.head_price(costs.head_level(cap)))
        else:
            offer = RowDraft(cap, 0.0, s.by_model)
        if s.acceptance is None or not cap:
            return offer
        alpha = s.acceptance.first.lower
        if s.drafts_at_a_cost:
            first, per_token = self.probe_ms(s, offer)
            if s.probe_credit >= first:
                left = s.probe_credit - first
                alpha, cap = s.acceptance.first.upper, cap if per_token <= 0 else min(cap, 1 + int(left // per_token))
        return dataclasses.replace(offer, cap=cap, alpha=alpha)

    def probe_ms(self, s: BatchSequence, offer: RowDraft) -> tuple[float, float]:
        """A costly row's drafting, modelled alone: its first token (catching up) and each further one."""
        if not s.by_model:
            return offer.first_ms, offer.token_ms
        unseen = len(s.tokens) - s.draft_cached
        return self.draft_price(self.draft_costs(1, unseen)), self.draft_price(self.draft_costs(1, 1))

    def book_probes(
        self, decoding: Sequence[BatchSequence], offers: Sequence[RowDraft], drafts: Sequence[int], b: int, t: int
    ) -> None:
        """A costly row's plain step earns ``PROBE_SHARE`` of its share of the step (``b`` rows,
        ``t`` tokens if all decoded plainly); a probe spends what its drafts were modelled to cost."""
        if not any(s.drafts_at_a_cost for s in decoding):
            return
        share = self.costs(b, t) / b
        for s, offer, k in zip(decoding, offers, drafts, strict=True):
            if not s.drafts_at_a_cost or s.acceptance is None or s.fixed:
                continue
            if not k:
                s.probe_credit += PROBE_SHARE * share
            elif offer.alpha > s.acceptance.first.lower:  # offered optimistically: a probe
                first, per_token = self.probe_ms(s, offer)
                s.probe_credit -= first + (k - 1) * per_token

    def by_head(self, s: BatchSequence, offer: RowDraft, k: int) -> int:
        """Draft the row's tree of at most ``k`` tokens with its head; how many it drafted."""
        assert s.head is not None
        started = time.perf_counter()
        s.proposal = s.head.propose_at_most(k)
        table_ms = (offer.first_ms + (k - 1) * offer.token_ms) / self.head_price.ratio
        self.head_price.observe(table_ms, (time.perf_counter() - started) * 1e3)
        return s.proposal.tokens.numel()

    def by_model(self, rows: Sequence[tuple[BatchSequence, int]]) -> None:
        """Each row's ``k`` draft tokens from the draft model, a level for all rows per forward:
        the first runs what each row has not run yet (its root, or everything since it last
        drafted), each further one the token drafted before it."""
        assert self.model is not None
        tokens: dict[int, list[int]] = {s.row: [] for s, _ in rows}
        dists: dict[int, list[torch.Tensor]] = {s.row: [] for s, _ in rows}
        for level in range(1, max(k for _, k in rows) + 1):
            active = [s for s, k in rows if k >= level]
            if level == 1:
                feeds = [s.tokens[s.draft_cached :] for s in active]
                spans = [Span(s.row, s.draft_cached, len(f)) for s, f in zip(active, feeds, strict=True)]
            else:
                feeds = [tokens[s.row][-1:] for s in active]
                spans = [Span(s.row, len(s.tokens) + level - 2, 1) for s in active]
            ends = [end - 1 for end in itertools.accumulate(len(f) for f in feeds)]
            ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=self.device)
            steps = Rows.build(spans, self.device, self.draft_native)
            outputs = Outputs.build(spans, ends, self.device, self.draft_native) if level == 1 else None
            at = torch.tensor(ends, dtype=torch.long, device=self.device)
            logits, _ = self.model.forward_rows(ids, steps, self.draft_caches, at, outputs=outputs)
            for s, row_logits in zip(active, logits, strict=True):
                if s.sampling.greedy:
                    tokens[s.row].append(int(row_logits.argmax()))
                else:
                    dists[s.row].append(s.sampling.probs(row_logits))
                    tokens[s.row].append(s.sampling.sample(dists[s.row][-1]))
        for s, _ in rows:
            s.drafted(tokens[s.row], torch.stack(dists[s.row]) if dists[s.row] else None)

    def table_ms(self, rows: Sequence[tuple[BatchSequence, int]]) -> float:
        """What the draft-model table says ``by_model(rows)`` costs: the catch-up level, then
        one token for each row still drafting per further level."""
        ms = self.draft_costs(len(rows), sum(len(s.tokens) - s.draft_cached for s, _ in rows))
        for level in range(2, max(k for _, k in rows) + 1):
            active = sum(1 for _, k in rows if k >= level)
            ms += self.draft_costs(active, active)
        return ms

    def speedup(self, offers: Sequence[RowDraft], drafts: Sequence[int], others: int, t: int) -> float:
        """The step's expected tokens per ms over what plain steps for every decoding row would give."""
        if not offers:
            return 1.0
        n, decoding_ms = len(offers), DecodingTime(self.costs, len(offers), others, t)
        expected = n + sum(sum(o.alpha**j for j in range(1, k + 1)) for o, k in zip(offers, drafts, strict=True))
        return (expected / decoding_ms(sum(drafts), self.step_overhead.ms)) / (n / decoding_ms(0))
