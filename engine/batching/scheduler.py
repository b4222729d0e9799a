"""The engine's one decode loop, with continuous batching: every running request advances in one
target forward per step (``Engine.stream`` runs it with one row, a server with many).

A scheduler thread owns a static KV cache of ``max_num_seqs`` rows, one per running request
(``rows.py``: a row is a fixed region, so no block tables; with the context fixed per model and
the fixture's 6 KiB per token, eight rows of 2k tokens are 100 MB, and paging would buy room only
for longer contexts than this engine serves). Each step, iteration-level as vLLM and llama.cpp's
slots do:

1. free the rows of requests that ended or were cancelled, and admit waiting ones into free rows;
2. give prompts what the decoding rows leave of ``prefill_chunk`` tokens, at least half of them
   (chunked prefill: a long prompt never stalls the rows that are decoding);
3. let each decoding row with a drafter offer a draft, and ``plan_batch`` decide how much of
   each to verify for the most expected tokens/s of the whole batch;
4. run ONE forward over everything (chains causal, trees under their own masks and positions),
   then per row sample the first token of a finished prompt, or walk its verified chain or tree
   (the lossless rule, per row) and emit.

A request's drafter is its own: prompt lookup needs only its tokens; a draft model has a row of
its own batch cache per request, and drafts a level for all its rows in one batched forward (the
first catching each row up on what it has not run); an EAGLE head drafts each row's tree alone,
in a head cache of the request's own, from the target features this forward returns for its
tokens (a tree of at most the tokens the plan gave it: EAGLE-2/3 grow one of that budget,
EAGLE-1 cuts its static tree there).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import torch

from ace_mw.vocabulary import Algorithm

from ..drafting.drafters import Drafter, DraftTree
from ..drafting.eagle import HeadDrafter
from ..drafting.sampling import sample, verify
from ..drafting.tree import VerifyLayout
from ..generation import Asked, Chunker, GenerationResult, StreamChunk, chunks, collect
from ..model import native
from ..model.compiled import ROWS, features
from ..model.rows import Outputs, Rows, Span
from ..params import MAX_TREE_TOKENS, SamplingParams, SpecParams
from ..planning.batch import BatchCosts, DecodingTime, MeasuredPrice, RowDraft, StepOverhead, plan_batch
from ..planning.cost import fastest_each
from ..planning.planner import PROBE_SHARE
from ..text import StreamText
from .prefixes import RowPrefixes, longest_held
from .sequence import BatchSequence, LoopSteps, Step, StepSink

logger = logging.getLogger(__name__)

# A step's tokens, decoding rows' first tokens included (vLLM: a token budget): prompt chunks fill
# what those leave, at least half of them. A step of exactly this many tokens runs each projection in
# one piece (packed.py): 241 prompt tokens beside 15 decoding rows took 0.539 ms a prompt token
# here, 256 beside them 0.561 (two pieces, the smaller padded, and their outputs joined).
PREFILL_CHUNK = 256
HEAD_TREE = 10  # an EAGLE row's largest tree when the plan sizes it (the request names no total_tokens)


OMP_PAUSE_HARD = 2  # omp_pause_resource_all's kind that frees the runtime's thread pools


def release_openmp_threads() -> None:
    """Free the OpenMP threads the calling thread's torch work started (loading, measuring costs).

    The loop's steps run on a thread of their own. While another thread's OpenMP pool lives, the
    loop's parallel kernels ran a third slower on 2 threads: a one-row step 7.9 ms against 5.9 ms
    on the thread that loaded the model, and 6.1 ms once that pool was freed (this machine, oneDNN
    on libgomp). A runtime without the OpenMP 5.0 call, or a torch without OpenMP, is left alone.
    """
    pause = getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)
    if pause is not None and torch.get_num_threads() > 1:
        pause(OMP_PAUSE_HARD)


_LOOPS: weakref.WeakSet[BatchEngine] = weakref.WeakSet()  # the loops whose threads exit stops


@atexit.register
def _stop_loops() -> None:
    """End every loop's thread before the interpreter tears down: a thread that still holds an
    OpenMP pool when the runtime's destructors run can abort the process (``terminate called``)."""
    for loop in list(_LOOPS):
        loop.stop()


class BatchEngine:
    """The engine's decode loop: an ``Engine``'s target serving up to ``max_num_seqs`` requests at
    once (``Engine.stream`` runs one of one row).

    ``stream`` and ``generate`` take what ``Engine``'s do and may be called from many threads at
    once; a request waits for a free row in the order it came."""

    def __init__(
        self,
        engine: Any,
        max_num_seqs: int = 8,
        prefill_chunk: int = PREFILL_CHUNK,
        costs: BatchCosts | None = None,
        draft_costs: BatchCosts | None = None,
        prefix_caching: bool = True,
    ) -> None:
        """``engine``: an ``Engine`` (``engine.py``): the models, the request checks and the
        drafters this loop runs. ``costs`` (the target's) and ``draft_costs`` (the draft model's, when the engine loaded
        one): None measures them here once per machine (``planning/batch.py``), and then the draft
        model's are also priced as its levels run (``draft_price``); given, they decide as they are.
        ``prefix_caching``: a request starts in the free row that holds most of its prompt already
        (``prefixes.py``)."""
        if max_num_seqs < 1 or prefill_chunk < 1:
            raise ValueError(f"max_num_seqs and prefill_chunk must be >= 1, got {max_num_seqs}, {prefill_chunk}")
        self.engine, self.model_name = engine, engine.model_name
        self.tokenizer, self.eos_ids = engine.tokenizer, engine.eos_ids
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.target = engine.model
        self.device = engine.device
        self.row_length = engine.max_context + MAX_TREE_TOKENS + 1  # a sequence and one verified tree
        self.caches = self.target.batch_caches(max_num_seqs, self.row_length)
        self.native = native.runs_on(self.target.embed_tokens.weight)  # its batched steps on the native kernels
        self.costs = costs or BatchCosts.load_or_measure(self.target, max_num_seqs)
        self.draft = engine.drafts_with(Algorithm.DRAFT_MODEL)
        if self.draft is not None:
            self.draft_caches = self.draft.batch_caches(max_num_seqs, self.row_length)
            self.draft_native = native.runs_on(self.draft.embed_tokens.weight)
            self.draft_costs = draft_costs or BatchCosts.load_or_measure(self.draft, max_num_seqs)
        self.draft_price = MeasuredPrice(learns=draft_costs is None)
        self.head_price = MeasuredPrice(learns=costs is None)  # EAGLE rows' passes, each row alone
        self.step_overhead = StepOverhead(learns=costs is None)  # a verifying step's, beyond the table
        self.rows = RowPrefixes(max_num_seqs, prefix_caching)
        step = engine.decoding_step  # one or two rows decoding, compiled, where the engine has it
        self.decoding_step = step if step is not None and step.warm_up(self.caches) else None
        if self.decoding_step is not None:
            for n in range(1, min(ROWS, max_num_seqs) + 1):
                self.costs = self.costs.with_step(n, n, self.costs(n, n) * self._compiled_ratio(n))
        self._waiting: list[BatchSequence] = []
        self._running: list[BatchSequence] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.steps = 0
        self.speculating_rows = self.decoding_rows = 0  # over all steps: the share of rows that drafted
        release_openmp_threads()
        _LOOPS.add(self)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.caches)

    def describe(self) -> str:
        """What a server prints at start: rows, context, and the cache they were sized into."""
        return (
            f"continuous batching: {self.max_num_seqs} rows x {self.row_length} tokens, "
            f"KV cache {self.kv_cache_bytes / 2**20:.0f} MiB, prompts in chunks of {self.prefill_chunk} tokens, "
            f"prefix caching {'on' if self.rows.enabled else 'off'}"
        )

    def runs(self, algorithm: str) -> bool:
        return self.engine.runs(algorithm)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def prefix_caching(self) -> bool:
        """Whether a request starts from what a free row holds of its prompt (``prefixes.py``)."""
        return self.rows.enabled

    @prefix_caching.setter
    def prefix_caching(self, enabled: bool) -> None:
        self.rows.enabled = enabled

    # --- requests ------------------------------------------------------------------------------

    def stream(
        self,
        messages_or_prompt,
        sampling: SamplingParams | None = None,
        speculative: SpecParams | None = None,
        **fields: Any,
    ) -> Iterator[StreamChunk]:
        """As ``Engine.stream``: validate now, then yield text as the batch produces it."""
        start = time.perf_counter()
        asked = self.engine.prepare(messages_or_prompt, sampling, speculative, fields)
        return self.decode(asked, self.engine.drafter(asked.speculative), start)

    def astream(
        self,
        loop: asyncio.AbstractEventLoop,
        messages_or_prompt,
        sampling: SamplingParams | None = None,
        speculative: SpecParams | None = None,
        every_step: bool = True,
        **fields: Any,
    ) -> AsyncGenerator[StreamChunk, None]:
        """As ``stream``, read on the asyncio event loop ``loop`` (a server's): this loop's thread
        hands each step's tokens to it as the step ends, one thread hop a step, and no worker
        thread waits in between; with ``every_step`` False, all of them at the end (one hop, for a
        reader that needs no text before). Validates now, so call it off the event loop (it
        tokenizes)."""
        start = time.perf_counter()
        asked = self.engine.prepare(messages_or_prompt, sampling, speculative, fields)
        steps = LoopSteps(loop, every_step)
        sequence = self._sequence(asked, self.engine.drafter(asked.speculative), start, steps)
        self._submit(sequence)
        text = StreamText(self.engine.tokenizer, asked.params.stops)
        return self._achunks(sequence, steps.queue, Chunker(sequence, text, asked.budget, self.eos_ids))

    async def _achunks(
        self, sequence: BatchSequence, steps: asyncio.Queue[Step], chunker: Chunker
    ) -> AsyncGenerator[StreamChunk, None]:
        try:
            while (step := await steps.get()) is not None:
                if isinstance(step, BaseException):
                    raise step
                chunk = chunker.push(step)
                if chunk is not None:
                    yield chunk
                if chunker.finished:
                    return
        finally:
            self.cancel(sequence)

    def decode(self, asked: Asked, drafter: Drafter | None, start: float | None = None) -> Iterator[StreamChunk]:
        """A prepared request's text as the loop produces it, drafted by ``drafter`` (``Engine.drafter``'s,
        or any of the ``Drafter`` protocol's that proposes without a model); ``start``: when it came."""
        sequence = self._sequence(asked, drafter, time.perf_counter() if start is None else start)
        self._submit(sequence)
        return self._chunks(sequence, StreamText(self.engine.tokenizer, asked.params.stops), asked.budget)

    def _sequence(
        self, asked: Asked, drafter: Drafter | None, start: float, out: StepSink | None = None
    ) -> BatchSequence:
        """The request's sequence, its steps put into ``out`` (default: a queue ``steps()`` reads)."""
        spec = asked.speculative
        if not isinstance(drafter, HeadDrafter):
            cap = self.engine.speculative_k(spec)
        elif spec.total_tokens is None and spec.self_gate:
            cap = min(drafter.largest, HEAD_TREE)
        else:
            cap = drafter.largest
        sequence = BatchSequence(
            asked,
            drafter=drafter,
            by_model=spec.algorithm == Algorithm.DRAFT_MODEL,
            max_draft=cap,
            fixed=not spec.self_gate,
            eos_ids=self.eos_ids,
            start=start,
            head_costs=self.engine.costs_of(spec.algorithm) if isinstance(drafter, HeadDrafter) else None,
            out=out,
        )
        return sequence

    def _chunks(self, sequence: BatchSequence, text: StreamText, budget: int) -> Iterator[StreamChunk]:
        try:
            yield from chunks(sequence, text, budget, self.eos_ids)
        finally:
            self.cancel(sequence)

    def generate(
        self,
        messages_or_prompt,
        sampling: SamplingParams | None = None,
        speculative: SpecParams | None = None,
        **fields: Any,
    ) -> GenerationResult:
        """The whole output of ``stream`` at once."""
        return collect(self.stream(messages_or_prompt, sampling, speculative, **fields))

    def _submit(self, sequence: BatchSequence) -> None:
        with self._wake:
            self._waiting.append(sequence)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ace-mw-batch", daemon=True)
                self._thread.start()
            self._wake.notify()

    def cancel(self, sequence: BatchSequence) -> None:
        """Free the request's row before the next step (a no-op once it ended)."""
        with self._wake:
            sequence.cancelled = True
            self._wake.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the scheduler thread after its current step (requests still running are left as
        they are: this is for a process that is exiting)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # --- the scheduler thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._retire()
                self._admit()
                while not self._running and not self._stopped:
                    self._wake.wait()
                    self._retire()
                    self._admit()
                if self._stopped:
                    return
                running = list(self._running)
            try:
                with torch.inference_mode():
                    self.step(running)
            except Exception as exc:  # a fault fails this step's requests, never the server
                logger.exception("batched step failed")
                with self._wake:
                    for sequence in running:
                        sequence.end(exc)
                        sequence.cancelled = True
                        sequence.cache_known = False

    def _retire(self) -> None:
        for sequence in [s for s in self._running if s.cancelled or s.ended]:
            self._running.remove(sequence)
            self.rows.give_back(sequence.row, sequence.held())
            if not sequence.cancelled:
                sequence.end()
        self._waiting = [s for s in self._waiting if not s.cancelled]

    def _admit(self) -> None:
        while self._waiting and self.rows.free:
            sequence = self._waiting.pop(0)
            # an EAGLE row's head drafts from the target features of every prompt token: it runs them all
            sequence.row, sequence.prefilled = self.rows.take(sequence.tokens, reuse=sequence.head is None)
            sequence.cached = sequence.prefilled
            self._running.append(sequence)

    def step(self, running: Sequence[BatchSequence]) -> None:
        """One forward over every running request's part of this step."""
        step_started = time.perf_counter()
        decoding = [s for s in running if s.root is not None]
        prefilling: list[tuple[BatchSequence, torch.Tensor]] = []
        room = max(self.prefill_chunk - len(decoding), (self.prefill_chunk + 1) // 2)
        for s in running:
            if s.root is None and room:
                self._copy_held_prefix(s, running)
                chunk = s.prompt_chunk(room)
                prefilling.append((s, chunk))
                room -= chunk.numel()
        offers = [self._offer(s) for s in decoding]
        other_tokens = sum(c.numel() for _, c in prefilling)
        model_rows = [s for s, o in zip(decoding, offers, strict=True) if o.by_model and o.cap]
        level_ms: tuple[float, ...] = ()
        if model_rows:  # the first level runs what each row has not run yet, each further one a token a row
            n, unseen = len(model_rows), sum(len(s.tokens) - s.draft_cached for s in model_rows)
            level_ms = (self.draft_price(self.draft_costs(n, unseen)), self.draft_price(self.draft_costs(n, n)))
        drafts = plan_batch(offers, len(prefilling), other_tokens, self.costs, level_ms, self.step_overhead.ms)
        drafts = [o.cap if s.fixed else k for s, o, k in zip(decoding, offers, drafts, strict=True)]
        self._book_probes(decoding, offers, drafts, len(decoding) + len(prefilling), len(decoding) + other_tokens)
        drafting = [(s, k) for s, k in zip(decoding, drafts, strict=True) if s.by_model and k]
        if drafting:
            table_ms = self._drafting_table_ms(drafting) if self.draft_price.learns else 0.0
            started = time.perf_counter()
            self._draft_by_model(drafting)
            self.draft_price.observe(table_ms, (time.perf_counter() - started) * 1e3)
        drafts = [
            self._draft_by_head(s, o, k) if s.head is not None and k else k
            for s, o, k in zip(decoding, offers, drafts, strict=True)
        ]
        spans: list[Span] = []
        inputs: list[torch.Tensor] = []
        trees: list[tuple[DraftTree | None, list[list[int]]]] = []
        offsets: list[int] = []  # where each row's tokens start among the step's
        wanted: list[int] = []
        t = 0
        for s, k in zip(decoding, drafts, strict=True):
            assert s.root is not None
            tree = s.proposal.prefix(k) if s.proposal is not None and k else None
            root = s.prompt.new_tensor([s.root])
            if tree is None or tree.is_chain:
                spans.append(Span(s.row, s.length, 1 + k))
                trees.append((tree, [[i + 1] for i in range(k)] + [[]]))
            else:
                layout = VerifyLayout.from_parents(tree.parents)
                spans.append(Span(s.row, s.length, 1 + k, layout.positions, layout.mask))
                trees.append((tree, layout.children))
            inputs.append(root if tree is None else torch.cat([root, tree.tokens.to(root.device)]))
            offsets.append(t)
            wanted.extend(range(t, t + 1 + k))
            t += 1 + k
        for s, chunk in prefilling:
            spans.append(Span(s.row, s.prefilled, chunk.numel()))
            inputs.append(chunk)
            offsets.append(t)
            t += chunk.numel()
            if s.prefilled + chunk.numel() == s.prompt.numel():
                wanted.append(t - 1)
        taps = sorted({s.head.taps for s in running if s.head is not None})
        logits, features = self._forward(inputs, spans, wanted, taps)
        speedup = self._speedup(offers, drafts, len(prefilling), other_tokens)
        # greedy rows' argmax in one call for the step, not one per row
        argmax = logits.argmax(-1) if any(s.sampling.greedy for s in running) else None
        at = 0
        for s, k, (tree, children), offset in zip(decoding, drafts, trees, offsets[: len(decoding)], strict=True):
            mine = None if argmax is None else argmax[at : at + 1 + k]
            path, bonus = verify(s.sampling, logits[at : at + 1 + k], tree, children, mine)
            if path[-1] != len(path) - 1:  # a tree's accepted path: its KV to the slots after the prefix
                self._compact(s.row, s.length, path)
            drafted = tree.tokens.tolist() if tree is not None else []
            fed = None if s.head is None else features[s.head.taps][offset + torch.tensor(path, device=self.device)]
            s.advance([drafted[i - 1] for i in path[1:]], bonus, k, bool(children[path[-1]]), speedup, fed)
            at += 1 + k
        for (s, chunk), offset in zip(prefilling, offsets[len(decoding) :], strict=True):
            if s.head is not None:
                s.prompt_features.append(features[s.head.taps][offset : offset + chunk.numel()])
            s.prefilled += chunk.numel()
            if s.prefilled == s.prompt.numel():
                s.begin(sample(s.sampling, logits[at], None if argmax is None else argmax[at]))
                at += 1
        learns = self.step_overhead.learns and not prefilling and not drafting
        if learns and all(s.head is None for s in decoding):  # decoding and lookups alone
            verified = sum(drafts)
            table_ms = self.costs(len(decoding), len(decoding) + verified)
            self.step_overhead.observe(verified > 0, table_ms, (time.perf_counter() - step_started) * 1e3)
        self.steps += 1
        self.decoding_rows += len(decoding)
        self.speculating_rows += sum(1 for k in drafts if k)

    def _copy_held_prefix(self, s: BatchSequence, running: Sequence[BatchSequence]) -> None:
        """Before a chunk of ``s``'s prompt runs: where another row holds more of the prompt than
        ``s`` has prefilled (a system prompt another request ran, prefix caching), copy that part
        into ``s``'s row instead of computing it. Not for an EAGLE row (its head needs every
        prompt token's features)."""
        if not self.rows.enabled or s.head is not None:
            return
        holders = itertools.chain(((o.row, o.held()) for o in running if o is not s), self.rows.holders())
        source, shared = longest_held(s.tokens, s.prefilled, holders)
        if source < 0:
            return
        for cache in self.caches:
            cache.copy_slots(source, s.row, s.prefilled, shared)
        self.rows.reused += shared - s.prefilled
        s.cached += shared - s.prefilled
        s.prefilled = shared

    def _forward(
        self, inputs: Sequence[torch.Tensor], spans: Sequence[Span], wanted: list[int], taps: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, dict[tuple[int, ...], torch.Tensor]]:
        """The step's one target forward: logits at the ``wanted`` tokens, features for ``taps``. A
        step where one or two rows each run one token runs compiled where it can (``model/compiled.py``),
        rows with an EAGLE head too."""
        ids, n = torch.cat(list(inputs)).to(self.device), len(spans)
        plain = all(s.q == 1 for s in spans) and wanted == list(range(n))
        if plain and self.decoding_step is not None and self.decoding_step.runs(n, min(s.start for s in spans)):
            logits, streams = self.decoding_step(ids, [s.row for s in spans], [s.start for s in spans], self.caches)
            return logits, {tap: features(streams, tap) for tap in taps}
        at_tokens = torch.tensor(wanted, dtype=torch.long, device=self.device)
        rows = Rows.build(spans, self.device, self.native)
        outputs = None if taps else Outputs.build(spans, wanted, self.device, self.native)
        return self.target.forward_rows(ids, rows, self.caches, at_tokens, taps, outputs)

    def _compiled_ratio(self, n: int, context: int = 128, rounds: int = 10) -> float:
        """A step of ``n`` rows decoding one token each, compiled over eager, timed here in turns
        (``fastest_each``): what the plan's cost of such a step is scaled by."""
        step = self.decoding_step
        assert step is not None
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        rows, wanted = list(range(n)), torch.arange(n, device=self.device)
        eager = Rows.build([Span(r, context, 1) for r in rows], self.device, self.native)
        with torch.inference_mode():
            ms = fastest_each(
                {
                    "compiled": lambda: step(tokens, rows, [context] * n, self.caches),
                    "eager": lambda: self.target.forward_rows(tokens, eager, self.caches, wanted),
                },
                self.device,
                rounds,
            )
        return ms["compiled"] / ms["eager"]

    def _offer(self, s: BatchSequence) -> RowDraft:
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
            first, per_token = self._probe_ms(s, offer)
            if s.probe_credit >= first:
                left = s.probe_credit - first
                alpha, cap = s.acceptance.first.upper, cap if per_token <= 0 else min(cap, 1 + int(left // per_token))
        return dataclasses.replace(offer, cap=cap, alpha=alpha)

    def _probe_ms(self, s: BatchSequence, offer: RowDraft) -> tuple[float, float]:
        """A costly row's drafting, modelled alone: its first token (catching up) and each further one."""
        if not s.by_model:
            return offer.first_ms, offer.token_ms
        unseen = len(s.tokens) - s.draft_cached
        return self.draft_price(self.draft_costs(1, unseen)), self.draft_price(self.draft_costs(1, 1))

    def _book_probes(
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
                first, per_token = self._probe_ms(s, offer)
                s.probe_credit -= first + (k - 1) * per_token

    def _draft_by_head(self, s: BatchSequence, offer: RowDraft, k: int) -> int:
        """Draft the row's tree of at most ``k`` tokens with its head; how many it drafted."""
        assert s.head is not None
        started = time.perf_counter()
        s.proposal = s.head.propose_at_most(k)
        table_ms = (offer.first_ms + (k - 1) * offer.token_ms) / self.head_price.ratio
        self.head_price.observe(table_ms, (time.perf_counter() - started) * 1e3)
        return s.proposal.tokens.numel()

    def _compact(self, row: int, start: int, path: list[int]) -> None:
        """Move a row's accepted tree path (input indices after ``start``) to ``start``.."""
        src = start + torch.tensor(path, device=self.device)
        for cache in self.caches:
            cache.move(row, src, start)

    def _draft_by_model(self, rows: Sequence[tuple[BatchSequence, int]]) -> None:
        """Each row's ``k`` draft tokens from the draft model, a level for all rows per forward:
        the first runs what each row has not run yet (its root, or everything since it last
        drafted), each further one the token drafted before it."""
        assert self.draft is not None
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
            logits, _ = self.draft.forward_rows(ids, steps, self.draft_caches, at, outputs=outputs)
            for s, row_logits in zip(active, logits, strict=True):
                if s.sampling.greedy:
                    tokens[s.row].append(int(row_logits.argmax()))
                else:
                    dists[s.row].append(s.sampling.probs(row_logits))
                    tokens[s.row].append(s.sampling.sample(dists[s.row][-1]))
        for s, _ in rows:
            s.drafted(tokens[s.row], torch.stack(dists[s.row]) if dists[s.row] else None)

    def _drafting_table_ms(self, rows: Sequence[tuple[BatchSequence, int]]) -> float:
        """What the draft-model table says ``_draft_by_model(rows)`` costs: the catch-up level, then
        one token for each row still drafting per further level."""
        ms = self.draft_costs(len(rows), sum(len(s.tokens) - s.draft_cached for s, _ in rows))
        for level in range(2, max(k for _, k in rows) + 1):
            active = sum(1 for _, k in rows if k >= level)
            ms += self.draft_costs(active, active)
        return ms

    def _speedup(self, offers: Sequence[RowDraft], drafts: Sequence[int], others: int, t: int) -> float:
        """The step's expected tokens per ms over what plain steps for every decoding row would give."""
        if not offers:
            return 1.0
        n, decoding_ms = len(offers), DecodingTime(self.costs, len(offers), others, t)
        expected = n + sum(sum(o.alpha**j for j in range(1, k + 1)) for o, k in zip(offers, drafts, strict=True))
        return (expected / decoding_ms(sum(drafts), self.step_overhead.ms)) / (n / decoding_ms(0))
