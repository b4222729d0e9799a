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
   each to verify for the most expected tokens/s of the whole batch (``drafting.py``);
4. lay the step out (``layout.py``) and run ONE forward over everything (chains causal, trees under
   their own masks and positions), then per row sample the first token of a finished prompt, or
   walk its verified chain or tree (the lossless rule, per row) and emit.

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
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import torch

from ace_mw.vocabulary import Algorithm

from ..drafting.drafters import Drafter
from ..drafting.eagle import HeadDrafter
from ..drafting.sampling import sample, verify
from ..generation import Asked, Chunker, GenerationResult, StreamChunk, chunks, collect
from ..model import native
from ..model.compiled import ROWS, features
from ..model.rows import Outputs, Rows, Span
from ..params import MAX_TREE_TOKENS, SamplingParams, SpecParams
from ..planning.batch import BatchCosts
from ..planning.cost import fastest_each
from ..text import StreamText
from .drafting import Drafting, StepDrafts
from .layout import StepLayout
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
        drafters this loop runs. ``costs`` (the target's) and ``draft_costs`` (the draft model's,
        when the engine loaded one): None measures them here once per machine
        (``planning/batch.py``), and then the draft model's are also priced as its levels run
        (``drafting.py``); given, they decide as they are. ``prefix_caching``: a request starts in
        the free row that holds most of its prompt already (``prefixes.py``)."""
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
        table = costs or BatchCosts.load_or_measure(self.target, max_num_seqs)
        self.rows = RowPrefixes(max_num_seqs, prefix_caching)
        step = engine.decoding_step  # one or two rows decoding, compiled, where the engine has it
        self.decoding_step = step if step is not None and step.warm_up(self.caches) else None
        if self.decoding_step is not None:
            for n in range(1, min(ROWS, max_num_seqs) + 1):
                table = table.with_step(n, n, table(n, n) * self._compiled_ratio(n))
        draft = engine.drafts_with(Algorithm.DRAFT_MODEL)
        self.drafting = Drafting(table, draft, draft_costs, costs is None, max_num_seqs, self.row_length, self.device)
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
        """One step over every running request: schedule the prompts' chunks, draft, run one
        forward, then verify each decoding row and start each finished prompt."""
        started = time.perf_counter()
        decoding = [s for s in running if s.root is not None]
        prefilling = self._prompt_chunks(running, len(decoding))
        drafts = self.drafting.draft(decoding, len(prefilling), sum(c.numel() for _, c in prefilling))
        layout = StepLayout.of(decoding, drafts.tokens, prefilling)
        taps = sorted({s.head.taps for s in running if s.head is not None})
        logits, features = self._forward(layout.inputs, layout.spans, layout.wanted, taps)
        self._postprocess(decoding, drafts, prefilling, layout, logits, features)
        self.drafting.observe_step(decoding, len(prefilling), drafts, (time.perf_counter() - started) * 1e3)
        self.steps += 1
        self.decoding_rows += len(decoding)
        self.speculating_rows += sum(1 for k in drafts.tokens if k)

    def _prompt_chunks(
        self, running: Sequence[BatchSequence], decoding: int
    ) -> list[tuple[BatchSequence, torch.Tensor]]:
        """The prompt chunks this step runs: what the ``decoding`` rows leave of ``prefill_chunk``
        tokens, at least half of them, to the prompts in the order they came (each first takes
        what another row holds of it, prefix caching)."""
        prefilling: list[tuple[BatchSequence, torch.Tensor]] = []
        room = max(self.prefill_chunk - decoding, (self.prefill_chunk + 1) // 2)
        for s in running:
            if s.root is None and room:
                self._copy_held_prefix(s, running)
                chunk = s.prompt_chunk(room)
                prefilling.append((s, chunk))
                room -= chunk.numel()
        return prefilling

    def _postprocess(
        self,
        decoding: Sequence[BatchSequence],
        drafts: StepDrafts,
        prefilling: Sequence[tuple[BatchSequence, torch.Tensor]],
        layout: StepLayout,
        logits: torch.Tensor,
        features: dict[tuple[int, ...], torch.Tensor],
    ) -> None:
        """Each decoding row's verified chain or tree (the lossless rule, per row) and each
        finished prompt's first token, from the step's logits (in ``layout.wanted``'s order)."""
        # greedy rows' argmax in one call for the step, not one per row
        greedy = any(s.sampling.greedy for s in decoding) or any(s.sampling.greedy for s, _ in prefilling)
        argmax = logits.argmax(-1) if greedy else None
        at = 0
        rows = zip(decoding, drafts.tokens, layout.trees, layout.offsets[: len(decoding)], strict=True)
        for s, k, (tree, children), offset in rows:
            mine = None if argmax is None else argmax[at : at + 1 + k]
            path, bonus = verify(s.sampling, logits[at : at + 1 + k], tree, children, mine)
            if path[-1] != len(path) - 1:  # a tree's accepted path: its KV to the slots after the prefix
                self._compact(s.row, s.length, path)
            drafted = tree.tokens.tolist() if tree is not None else []
            fed = None if s.head is None else features[s.head.taps][offset + torch.tensor(path, device=self.device)]
            s.advance([drafted[i - 1] for i in path[1:]], bonus, k, bool(children[path[-1]]), drafts.speedup, fed)
            at += 1 + k
        for (s, chunk), offset in zip(prefilling, layout.offsets[len(decoding) :], strict=True):
            if s.head is not None:
                s.prompt_features.append(features[s.head.taps][offset : offset + chunk.numel()])
            s.prefilled += chunk.numel()
            if s.prefilled == s.prompt.numel():
                s.begin(sample(s.sampling, logits[at], None if argmax is None else argmax[at]))
                at += 1

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

    def _compact(self, row: int, start: int, path: list[int]) -> None:
        """Move a row's accepted tree path (input indices after ``start``) to ``start``.."""
        src = start + torch.tensor(path, device=self.device)
        for cache in self.caches:
            cache.move(row, src, start)
