"""One request in the running batch: its cache row, what it has run, and where its tokens go.

The scheduler's thread advances every sequence one step at a time; the request's own thread (a
server's worker) reads the tokens each step emitted from a queue (``generation.chunks``), which
turns them into text, cut at stop strings, and the final counts.
Leaving early (a stop string, a client that went away) marks the sequence cancelled; the
scheduler frees its row before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from ..drafting.drafters import Drafter, DraftTree, Plan
from ..drafting.eagle import HeadDrafter
from ..generation import Asked, GenerationStats, StepCounts
from ..planning.cost import EngineCosts
from ..planning.planner import Acceptance

_END = None  # what the queue carries after a sequence's last step
Step = list[int] | BaseException | None  # one step's tokens, the error that ended it, or _END


class StepSink(Protocol):
    """Where the scheduler's thread puts a sequence's steps."""

    def put(self, step: Step) -> None: ...


class LoopSteps:
    """A sequence's steps for an asyncio event loop (``BatchEngine.astream``): each is handed to the
    loop as the scheduler's thread puts it, so a server's stream takes one thread hop a step; or,
    with ``every_step`` False, the tokens are held on the scheduler's thread and handed over with
    the last step, one hop a request. Each hop wakes the loop's thread, which then holds the GIL
    while the scheduler's thread waits for it: an answer read only at its end need not pay that
    a token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_step: bool = True) -> None:
        self._loop = loop
        self._held: list[int] | None = None if every_step else []
        self.queue: asyncio.Queue[Step] = asyncio.Queue()

    def put(self, step: Step) -> None:
        held = self._held
        if held is not None:
            if isinstance(step, list):
                held.extend(step)
                return
            if held:  # the end, or the error that ended it: the tokens before it first
                self._hand(held)
        self._hand(step)

    def _hand(self, step: Step) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, step)
        except RuntimeError:  # the loop is closed: nobody is left to read the stream
            pass


class BatchSequence:
    """A request's decoding inside the batch (a ``generation.Decoding``)."""

    def __init__(
        self,
        asked: Asked,
        *,
        drafter: Drafter | None,
        by_model: bool,
        max_draft: int,
        fixed: bool,
        eos_ids: frozenset[int],
        start: float,
        head_costs: EngineCosts | None = None,
        out: StepSink | None = None,
    ) -> None:
        """``drafter``: the request's own; an EAGLE drafter (``head``) has a head cache of its own,
        is fed the target's features of every token this row runs and is priced by ``head_costs``
        (its source's); any other proposes from the tokens alone (prompt lookup). ``by_model``: the
        loop drafts for it with the draft model. ``max_draft``: the most draft tokens a step
        verifies; ``fixed``: that many every step (``SpecParams.self_gate`` off), else what the
        plan says. ``out``: where its steps go (default: a queue that ``steps()`` reads)."""
        self.prompt = torch.tensor(asked.prompt, dtype=torch.long)
        self.sampling, self.by_model, self.fixed = asked.sampler, by_model, fixed
        self.head = drafter if isinstance(drafter, HeadDrafter) else None
        self.drafter = None if self.head is not None else drafter
        self.head_costs = head_costs
        self.prompt_features: list[Tensor] = []  # an EAGLE row's, chunk by chunk, until it begins
        # A row whose drafter costs something to run (a draft model, a head) learns only when it
        # drafts: while it has credit it is offered at the optimistic end of its acceptance (a probe).
        self.probe_credit = 0.0
        self.acceptance = Acceptance() if drafter is not None or by_model else None
        # What it committed (prompt + emitted); a draft-model row's: how much of it is in its row of
        # the draft model's cache, and the drafts of this step that went through the draft model.
        self.tokens: list[int] = list(asked.prompt)
        self.draft_cached = 0
        self.fed: list[int] = []
        self.budget, self.max_draft, self.eos_ids = asked.budget, max_draft, eos_ids
        self.ended = False  # an eos was emitted, or the budget reached
        self.row = -1  # its cache row once admitted
        self.prefilled = 0  # prompt tokens in the cache
        self.cached = 0  # of them, those its row held already (prefix caching)
        self.cache_known = True  # False once a failed step left its row's content unknown
        self.length = 0  # tokens in the cache (prompt, then emitted) once decoding
        self.root: int | None = None  # the last emitted token, not yet run: decoding has begun
        self.emitted = 0
        self.proposal: DraftTree | None = None  # this step's lookup, verified in part or not at all
        self.cancelled = False
        self.out: StepSink = out if out is not None else queue.SimpleQueue()
        self.counts = StepCounts(start)
        self.speedup_sum = 0.0  # the step's expected tokens/s over a plain step's, summed over its steps

    # --- the scheduler's side ---------------------------------------------------------------

    @property
    def drafts_at_a_cost(self) -> bool:
        """Its drafter runs a model (a draft model, a head): it learns only when it drafts."""
        return self.by_model or self.head is not None

    def prompt_chunk(self, budget: int) -> Tensor:
        """The next at most ``budget`` prompt tokens to run."""
        return self.prompt[self.prefilled : self.prefilled + budget]

    def offer(self) -> int:
        """Draft tokens this step could verify, within the budget left: what the lookup found, or
        what the draft model may draft (after the plan)."""
        room = self.budget - self.emitted - 1
        if self.by_model or self.head is not None:
            return min(self.max_draft, room)
        if self.drafter is None:
            return 0
        self.proposal = self.drafter.propose(Plan(self.max_draft, self.max_draft))
        return min(self.proposal.tokens.numel(), room)

    def drafted(self, tokens: list[int], q: Tensor | None) -> None:
        """The draft model drafted ``tokens`` (from distributions ``q``; None: greedy), having run
        everything committed and all but the last draft."""
        self.draft_cached = len(self.tokens)
        self.fed = tokens[:-1]
        self.proposal = DraftTree.chain(torch.tensor(tokens, dtype=torch.long), q)

    def begin(self, first: int) -> None:
        """The prompt is in the cache and ``first`` sampled from its last token."""
        self.length, self.root = self.prompt.numel(), first
        self.tokens.append(first)
        with_first = torch.cat([self.prompt, self.prompt.new_tensor([first])])
        if self.drafter is not None:
            self.drafter.reset(with_first, torch.empty(0))
        if self.head is not None:
            self.head.reset(with_first.to(self.prompt_features[0].device), torch.cat(self.prompt_features))
            self.prompt_features = []
        self.counts.first_at = self.counts.last_at = time.perf_counter()
        self._emit([first])

    def advance(
        self,
        accepted: list[int],
        bonus: int,
        verified: int,
        rejected: bool,
        speedup: float,
        features: Tensor | None = None,
    ) -> None:
        """One verify step ran ``verified`` drafts after the root and took ``accepted`` and ``bonus``
        (``rejected``: a draft below the last accepted token was not); ``features`` are the
        target's at the root and the accepted tokens, for an EAGLE row's head."""
        emitted = [*accepted, bonus]
        self.counts.count(verified, len(accepted), rejected)
        self.speedup_sum += speedup
        self.length += len(emitted)
        self.root = bonus
        if self.acceptance is not None:
            if self.proposal is not None and self.proposal.tokens.numel():
                self.acceptance.learn(self.proposal, emitted)
            self.acceptance.fade()
        if self.drafter is not None:
            self.drafter.accept(torch.tensor(emitted), torch.empty(0))
        if self.head is not None:
            assert features is not None, "an EAGLE row learns from the target's features"
            self.head.accept(torch.tensor(emitted, device=features.device), features)
        if self.by_model:
            if self.proposal is not None:  # drafted: its cache holds the drafts that match what was emitted
                reused = 0
                while reused < min(len(emitted), len(self.fed)) and emitted[reused] == self.fed[reused]:
                    reused += 1
                self.draft_cached = len(self.tokens) + reused
            self.fed = []
        self.tokens.extend(emitted)
        self.proposal = None
        self.counts.last_at = time.perf_counter()
        self._emit(emitted)

    def _emit(self, tokens: list[int]) -> None:
        self.emitted += len(tokens)
        self.ended = self.emitted >= self.budget or not self.eos_ids.isdisjoint(tokens)
        self.out.put(tokens)

    def held(self) -> list[int]:
        """The tokens whose KV its row holds: the prompt as far as it ran, then what it emitted
        (all but the last, not run yet)."""
        if not self.cache_known:
            return []
        return self.tokens[: self.length if self.root is not None else self.prefilled]

    def end(self, error: BaseException | None = None) -> None:
        self.out.put(error if error is not None else _END)

    # --- the request's side -----------------------------------------------------------------

    def steps(self) -> Iterator[list[int]]:
        """The tokens of each step as the scheduler runs them (from the default queue); leaving
        early cancels the sequence."""
        out = self.out
        assert isinstance(out, queue.SimpleQueue), "a sequence with a sink of its own is read there"
        try:
            while (item := out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled = True

    def stats(self, output_tokens: int) -> GenerationStats:
        steps = self.counts.steps
        stats = self.counts.stats(output_tokens, self.prompt.numel(), self.speedup_sum / steps if steps else 1.0)
        return dataclasses.replace(stats, cached_prompt_tokens=self.cached)
