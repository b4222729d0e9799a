"""The in-process engine: one decoding loop for plain decoding and every speculative algorithm.

Each step the planner says how much to draft (``planner.py``: whatever maximises expected tokens
per second on this machine, nothing included); a drafter proposes a tree after the root (the last
emitted token); ONE target forward verifies ``[root] + tree`` at positions ``cur_len + depth``
with the tree mask appended to the cached prefix; the lossless walk picks the accepted path; its
KV moves in place to the slots right after the prefix; a bonus token is sampled. A step that drafts
nothing, and a request with no drafter, is exactly plain decoding.
The engine owns one static KV cache, so calls must not overlap (servers serialise them).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.vocabulary import Algorithm

from .algorithms import DraftSetup, Loaded, Source, entry, missing_source
from .drafting.drafters import PLAIN, Drafter, DraftTree, Plan
from .drafting.sampling import Sampling, walk_tree
from .drafting.tree import VerifyLayout, longest_greedy_path
from .model.compiled import CompiledDecode
from .model.graphs import StaticTarget
from .model.step import Step
from .model.transformer import Transformer, resolve_dtype
from .params import EngineError, SamplingParams, SpecParams, chat_messages
from .planning.cost import EngineCosts
from .planning.planner import DraftPlanner, Menu, best_tree_expected
from .text import StreamText

logger = logging.getLogger(__name__)

MAX_TREE_TOKENS = 128
STEPS = ("auto", "eager", "static", "compiled")  # how the steps after a prefill run: Engine(steps=...)
# EAGLE-2's largest tree when the planner sizes it per step (the EAGLE-2 paper uses 48-60).
GATED_TREE_TOKENS = 64
# Prior per-token acceptance for sizing a fixed EAGLE-2 tree (self_gate off) when none is given.
EAGLE2_PRIOR_ALPHA = 0.6


@dataclass(frozen=True)
class GenerationStats:
    """Counts of one generation.

    `drafted` counts the draft positions the verifier tried: every accepted token plus, per step,
    the one rejected where the walk stopped (none when it reached the end of its branch). So
    `acceptance_rate` is the per-position acceptance probability of the EAGLE papers, comparable
    between a 4-token chain and a 60-node tree (tau = 1 + alpha + alpha^2 + ...), and it is what
    the middleware's breaker thresholds mean. `proposed` counts every draft token sent to the target
    (all tree nodes), the compute spent on drafts.
    """

    steps: int  # target verify forwards after the prefill
    drafted: int
    accepted: int
    output_tokens: int
    prompt_tokens: int
    ttft_s: float
    decode_time_s: float  # first output token to the last (the prefill never counts)
    proposed: int = 0
    plain_steps: int = 0  # verify steps that drafted nothing
    cached_prompt_tokens: int = 0  # prompt tokens whose KV a cache held already (not computed again)
    expected_speedup: float = 1.0  # the engine's estimate of tokens/s over plain decoding's

    @property
    def tpot_s(self) -> float:
        """Decode time per output token after the first."""
        return self.decode_time_s / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def plain_step_fraction(self) -> float:
        return self.plain_steps / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


class StepCounts:
    """What one request's verify steps did and when it emitted, counted as it decodes."""

    def __init__(self, start: float) -> None:
        self.start, self.first_at, self.last_at = start, 0.0, 0.0
        self.steps = self.plain_steps = self.drafted = self.accepted = self.proposed = 0

    def count(self, proposed: int, accepted: int, rejected_one: bool) -> None:
        """A step verified ``proposed`` drafts and accepted ``accepted``; ``rejected_one``: the walk
        stopped at a draft it tried (not at the end of its branch)."""
        self.steps += 1
        self.plain_steps += proposed == 0
        self.proposed += proposed
        self.drafted += accepted + rejected_one
        self.accepted += accepted

    def stats(self, output_tokens: int, prompt_tokens: int, expected_speedup: float) -> GenerationStats:
        return GenerationStats(
            steps=self.steps,
            drafted=self.drafted,
            accepted=self.accepted,
            output_tokens=output_tokens,
            prompt_tokens=prompt_tokens,
            ttft_s=self.first_at - self.start,
            decode_time_s=self.last_at - self.first_at,
            proposed=self.proposed,
            plain_steps=self.plain_steps,
            expected_speedup=expected_speedup,
        )


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, without the eos token
    prompt_tokens: int
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    stats: GenerationStats


@dataclass(frozen=True)
class Asked:
    """One request as the engine accepted it (``Engine.prepare``)."""

    prompt: list[int]
    params: SamplingParams
    sampler: Sampling
    speculative: SpecParams
    budget: int  # output tokens it may emit: max_new_tokens within the context


class Decoding(Protocol):
    """What ``Engine.chunks`` reads: the tokens each step emits, and the counts at the end."""

    def steps(self) -> Iterator[list[int]]: ...

    def stats(self, output_tokens: int) -> GenerationStats: ...


@dataclass(frozen=True)
class StreamChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on the last chunk


class Engine:
    max_num_seqs = 1  # requests it decodes at once: one (its cache has one row; see batching/)

    def __init__(
        self,
        target: Transformer,
        tokenizer,
        *,
        eagle=None,
        eagle3=None,
        draft: Transformer | None = None,
        model_name: str = "model",
        max_context: int = 2048,
        eos_ids: Sequence[int] = (),
        costs: EngineCosts | None = None,
        steps: str = "auto",
    ):
        """``eagle``, ``eagle3`` and ``draft`` are what the algorithms draft with (see
        ``algorithms.py``). ``costs`` None: measured here once per machine (``cost.py``); pass them
        to decide by others. ``steps`` is how the steps after a prefill run (``STEPS``): ``"static"``
        pads them to fixed shapes over the full cache and, on a GPU, replays them as CUDA graphs
        (``graphs.py``); ``"compiled"`` compiles the one-token step and verified chains
        (``compiled.py``: faster decoding on a CPU, exact up to near-ties); ``"eager"`` runs them
        as they come; ``"auto"`` is static on a GPU, eager elsewhere."""
        if steps not in STEPS:
            raise ValueError(f"steps: expected one of {', '.join(STEPS)}, got {steps!r}")
        self.model, self.tokenizer = target, tokenizer
        for head in (eagle, eagle3):
            if head is not None:
                head.check_target(target.config)
        self.model_name, self.max_context = model_name, max_context
        self.eos_ids = frozenset(eos_ids)
        self.device = target.embed_tokens.weight.device
        if steps != "compiled":  # inductor fuses its own kernels; eager fp32 CPU steps run on oneDNN's
            for model in (target, draft):
                if model is not None:
                    model.pack()
        # Room after the context for one verify tree, so a step never needs a bounds check.
        target.setup_cache(max_context + MAX_TREE_TOKENS + 1)
        if draft is not None:
            draft.setup_cache(max_context + MAX_SPECULATIVE_TOKENS + 1)
        self.costs = costs or EngineCosts.load_or_measure(target, eagle, draft)
        # What decode steps and drafters call: the target, with static shapes, or with its steps compiled.
        on_gpu = self.device.type == "cuda"
        self.step_model: Transformer | StaticTarget | CompiledDecode = target
        if steps == "static" or (steps == "auto" and on_gpu):
            self.step_model = StaticTarget(target, use_graphs=on_gpu)
        elif steps == "compiled":
            logger.info("compiling the one-token decode step and verify chains (about 40 s the first time, cached)")
            self.step_model = compiled = CompiledDecode(target)
            compiled.warm_up()
            self.costs = self.costs.with_verify_scaled(compiled.ratio)
        self.sources: dict[Source, Loaded] = {}
        for source, model in ((Source.DRAFT_MODEL, draft), (Source.EAGLE_HEAD, eagle), (Source.EAGLE3_HEAD, eagle3)):
            if model is not None:
                self.sources[source] = Loaded(model, self.costs)
        if eagle3 is not None and costs is None:  # EAGLE-3 plans with its own head's drafting costs
            head_costs = self.costs.with_head(EngineCosts.load_or_measure(target, eagle3))
            self.sources[Source.EAGLE3_HEAD] = Loaded(eagle3, head_costs)
        # A fixed EAGLE-2 tree's size when the request names none: the best tokens/s on this machine's curve.
        expected = best_tree_expected(EAGLE2_PRIOR_ALPHA, EAGLE2_PRIOR_ALPHA, 63, 63)
        self.auto_tree_budget = max(range(1, 64), key=lambda b: (1.0 + expected[b]) / self.costs.verify(b + 1))
        self._menus: dict[tuple, Menu] = {}

    def _loaded(self, algorithm: str) -> Loaded | None:
        """What ``algorithm`` drafts with, as loaded (None: nothing loaded for it, or it needs nothing)."""
        found = entry(algorithm)
        return self.sources.get(found.source) if found is not None and found.source is not None else None

    def drafts_with(self, algorithm: str) -> Any:
        """The loaded model or head ``algorithm`` drafts with (None: nothing loaded for it, or it needs nothing)."""
        loaded = self._loaded(algorithm)
        return loaded.model if loaded is not None else None

    def costs_of(self, algorithm: str) -> EngineCosts:
        """The costs ``algorithm``'s plans are priced by: its source's, else the engine's."""
        loaded = self._loaded(algorithm)
        return loaded.costs if loaded is not None else self.costs

    def runs(self, algorithm: str) -> bool:
        """Whether this engine can run ``algorithm``: it needs nothing, or what it needs is loaded."""
        found = entry(algorithm)
        return found is None or found.source is None or found.source in self.sources

    @classmethod
    def from_pretrained(
        cls,
        target_path,
        eagle=None,
        draft=None,
        device="cpu",
        dtype: torch.dtype | str = torch.float32,
        max_context: int | None = None,
        costs: EngineCosts | None = None,
        steps: str = "auto",
    ) -> Engine:
        """Load local folders only: a target, optionally EAGLE heads and a draft model.

        ``eagle`` is a head folder or a list of them: an EAGLE-1/2 head (for ``eagle``, ``eagle_2``)
        and/or an EAGLE-3 head (for ``eagle_3``), told apart by their ``config.json``. ``dtype`` may
        be ``"auto"``: bf16 where it runs faster than fp32 (a GPU, an AMX CPU), fp32 elsewhere (see
        docs/engine.md for what lossless means in bf16)."""
        from transformers import AutoTokenizer

        path = Path(target_path)
        dtype = resolve_dtype(dtype, device)
        target = Transformer.from_pretrained(path, dtype=dtype, device=device)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        from .drafting.eagle3_head import Eagle3Head, load_draft_head
        from .drafting.eagle_head import drafting_dtype

        # Heads may draft in lower precision (verification keeps the output exact); the small
        # draft model is faster in fp32 with column-major weights than in bf16 on this CPU.
        heads = {}
        for folder in [eagle] if isinstance(eagle, (str, Path)) else list(eagle or ()):
            head = load_draft_head(folder, target.config, device, drafting_dtype(device, dtype))
            heads["eagle3" if isinstance(head, Eagle3Head) else "eagle"] = head
        draft_model = Transformer.from_pretrained(draft, dtype=dtype, device=device) if draft else None
        context = min(target.config.max_position_embeddings, max_context or 4096)
        return cls(
            target,
            tokenizer,
            **heads,
            draft=draft_model,
            model_name=path.name,
            max_context=context,
            eos_ids=_eos_ids(path, tokenizer),
            costs=costs,
            steps=steps,
        )

    def generate(
        self,
        messages_or_prompt,
        sampling: SamplingParams | None = None,
        speculative: SpecParams | None = None,
        **fields: Any,
    ) -> GenerationResult:
        """The whole output of ``stream`` at once."""
        return collect(self.stream(messages_or_prompt, sampling, speculative, **fields))

    def stream(
        self,
        messages_or_prompt,
        sampling: SamplingParams | None = None,
        speculative: SpecParams | None = None,
        **fields: Any,
    ) -> Iterator[StreamChunk]:
        """Validate now (errors raise here, not on first ``next``), then yield text as it firms up.

        ``fields`` are ``SamplingParams``' own (``max_new_tokens=32, temperature=0.7, ...``), a
        shorthand for ``sampling=SamplingParams(...)``."""
        start = time.perf_counter()
        asked = self.prepare(messages_or_prompt, sampling, speculative, fields)
        drafter, menu = self._drafter(asked.speculative, asked.sampler)
        planner = DraftPlanner(menu, gate=asked.speculative.self_gate, unseen=len(asked.prompt)) if menu else None
        decode = _Decode(self, asked.prompt, asked.sampler, drafter, start, planner)
        return self.chunks(decode, StreamText(self.tokenizer, asked.params.stops), asked.budget)

    def prepare(
        self,
        messages_or_prompt,
        sampling: SamplingParams | None,
        speculative: SpecParams | None,
        fields: dict[str, Any],
    ) -> Asked:
        """A request checked against this engine: its prompt's tokens, sampler and output budget."""
        if fields:
            if sampling is not None:
                raise TypeError("give sampling=SamplingParams(...) or its fields, not both")
            sampling = _sampling_params(fields)
        params = sampling or SamplingParams()
        prompt = self._encode(messages_or_prompt)
        if len(prompt) >= self.max_context:
            raise EngineError(
                f"prompt is {len(prompt)} tokens; this model's context is {self.max_context}",
                "messages",
                "context_length_exceeded",
            )
        budget = min(params.max_new_tokens, self.max_context - len(prompt))
        spec = speculative or SpecParams(Algorithm.BASELINE)
        return Asked(prompt, params, params.sampling(self.device), spec, budget)

    def chunks(self, decode: Decoding, text: StreamText, budget: int) -> Iterator[StreamChunk]:
        """A decoding's emitted tokens as text chunks: eos, stop strings and the budget end it."""
        ids: list[int] = []
        finish = "length"
        for step in decode.steps():
            new = []
            for token in step:
                if token in self.eos_ids:
                    finish = "stop"
                    break
                new.append(token)
                if len(ids) + len(new) == budget:
                    break
            delta, new, stopped = text.push(new)
            ids.extend(new)
            if stopped:
                finish = "stop"
            if stopped or finish == "stop" or len(ids) >= budget:
                yield StreamChunk(delta + text.flush(), new, finish, decode.stats(len(ids)))
                return
            if delta or new:
                yield StreamChunk(delta, new)

    def _encode(self, messages_or_prompt) -> list[int]:
        if isinstance(messages_or_prompt, str):
            text = messages_or_prompt
        else:
            text = self.tokenizer.apply_chat_template(
                chat_messages(messages_or_prompt), tokenize=False, add_generation_prompt=True
            )
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise EngineError("prompt is empty", "messages")
        return ids

    def _drafter(
        self, spec: SpecParams, sampling: Sampling, own_head_cache: bool = False
    ) -> tuple[Drafter | None, Menu | None]:
        """The request's drafter and the menu of plans it can run here (None, None for baseline);
        ``own_head_cache``: an EAGLE drafter gets a cache of its own (a batch row drafts beside others)."""
        k = self.speculative_k(spec)
        found = entry(spec.algorithm)
        if found is None:
            return None, None
        source = self.sources.get(found.source) if found.source is not None else None
        if found.source is not None and source is None:
            raise missing_source(spec.algorithm, found.source)
        setup = DraftSetup(
            spec=spec,
            k=k,
            tree_budget=self._tree_budget(spec),
            sampling=sampling,
            source=source,
            costs=source.costs if source is not None else self.costs,
            step_model=self.step_model,
            capacity=self.max_context + 1,
            device=self.device,
            own_head_cache=own_head_cache,
        )
        try:
            drafter, key, build = found.build(setup)
        except ValueError as exc:
            raise EngineError(str(exc), "tree_choices") from None
        if key not in self._menus:  # menus depend only on the machine's costs and the request's limits
            self._menus[key] = build()
        return drafter, self._menus[key]

    def speculative_k(self, spec: SpecParams) -> int:
        """The request's K (chain length or tree depth), its algorithm's default filled in; 0 for baseline."""
        found = entry(spec.algorithm)
        k = spec.num_speculative_tokens
        if found is not None and k is None:
            k = found.default_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise EngineError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}", "num_speculative_tokens"
            )
        return k or 0

    def _tree_budget(self, spec: SpecParams) -> int:
        if spec.total_tokens is None:
            return GATED_TREE_TOKENS if spec.self_gate else self.auto_tree_budget
        if not isinstance(spec.total_tokens, int) or not 1 <= spec.total_tokens <= MAX_TREE_TOKENS:
            raise EngineError(
                f"total_tokens must be in [1, {MAX_TREE_TOKENS}], got {spec.total_tokens!r}", "total_tokens"
            )
        return spec.total_tokens


class _Decode:
    """One request's decoding state over the engine's shared static cache."""

    def __init__(
        self,
        engine: Engine,
        prompt: list[int],
        sampling: Sampling,
        drafter: Drafter | None,
        start: float,
        planner: DraftPlanner | None = None,
    ):
        self.model, self.sampling, self.drafter, self.planner = engine.step_model, sampling, drafter, planner
        # The target features the drafter reads; a drafter that declares none reads the final ones.
        self.taps: tuple[int, ...] = getattr(drafter, "taps", ())
        self.device = engine.device
        self.prompt = torch.tensor(prompt, dtype=torch.long, device=self.device)
        self.counts = StepCounts(start)

    def steps(self) -> Iterator[list[int]]:
        """Yield the tokens emitted by the prefill, then by each verify step.

        Inference mode wraps each step, never a ``yield``: it is thread-local, and a server may
        resume this generator on another thread.
        """
        root = self._prefill()
        self.counts.first_at = self.counts.last_at = time.perf_counter()
        yield [root]
        cur_len = self.prompt.numel()
        while True:
            emitted = self._step(root, cur_len)
            cur_len += len(emitted)
            root = emitted[-1]
            self.counts.last_at = time.perf_counter()
            yield emitted

    @torch.inference_mode()
    def _prefill(self) -> int:
        n = self.prompt.numel()
        logits, hidden = self.model(self.prompt[None], Step.span(0, n, self.device), True, self.taps)
        root = self._sample(logits[0, -1])
        if self.drafter is not None:
            self.drafter.reset(torch.cat([self.prompt, self.prompt.new_tensor([root])]), hidden[0])
        return root

    def _draft(self) -> tuple[Plan, DraftTree | None, DraftTree | None]:
        """This step's plan, the tree to verify (None: a plain step) and the proposal to learn from."""
        if self.drafter is None or self.planner is None:
            return PLAIN, None, None
        if self.drafter.cheap:  # ask every step, verify only the part that pays, learn from all of it
            proposal = self.drafter.propose(self.planner.menu.largest)
            plan = self.planner.choose(cap=proposal.tokens.numel(), probe=False)
            return plan, (proposal.prefix(plan.tokens) if plan.tokens else None), proposal
        plan = self.planner.choose()
        if plan == PLAIN:
            return plan, None, None
        tree = self.drafter.propose(plan)
        return plan, tree, tree

    @torch.inference_mode()
    def _step(self, root: int, cur_len: int) -> list[int]:
        plan, tree, proposal = self._draft()
        n = 0 if tree is None else tree.tokens.numel()
        inputs = self.prompt.new_tensor([root])
        at = Step.span(cur_len, n + 1, self.device)
        children: list[list[int]] = [[]]
        if tree is not None and n:
            inputs = torch.cat([inputs, tree.tokens])
            if tree.is_chain:  # causal over the prefix: the model's mask-free fast path
                children = [[i + 1] for i in range(n)] + [[]]
            else:
                layout = VerifyLayout.from_parents(tree.parents)
                positions = cur_len + layout.positions.to(self.device)
                at = Step(positions, at.slots, layout.attention_mask(cur_len).to(self.device), at.kv_len)
                children = layout.children
        logits, hidden = self.model(inputs[None], at, taps=self.taps)
        path, bonus = verify(self.sampling, logits[0], tree, children)
        if path[-1] != len(path) - 1:  # the accepted path is not already contiguous after the prefix
            self.model.compact_cache(at.slots[path], cur_len)
        drafted = tree.tokens.tolist() if tree is not None and n else []
        accepted = [drafted[i - 1] for i in path[1:]]
        self.counts.count(n, len(accepted), bool(children[path[-1]]))
        emitted = accepted + [bonus]
        if self.planner is not None:
            self.planner.record(plan, len(emitted))
            if proposal is not None and proposal.tokens.numel():
                self.planner.observe(proposal, emitted)
        if self.drafter is not None:
            self.drafter.accept(self.prompt.new_tensor(emitted), hidden[0, path])
        return emitted

    def _sample(self, logits: Tensor) -> int:
        return sample(self.sampling, logits)

    def stats(self, output_tokens: int) -> GenerationStats:
        speedup = self.planner.expected_speedup if self.planner is not None else 1.0
        return self.counts.stats(output_tokens, self.prompt.numel(), speedup)


def collect(chunks: Iterator[StreamChunk]) -> GenerationResult:
    """A stream's chunks as one result."""
    text: list[str] = []
    ids: list[int] = []
    last = None
    for last in chunks:
        text.append(last.text)
        ids.extend(last.token_ids)
    # a stream always ends with a chunk that has both
    assert last is not None and last.finish_reason is not None and last.stats is not None
    return GenerationResult("".join(text), ids, last.stats.prompt_tokens, last.finish_reason, last.stats)


def verify(
    sampling: Sampling, logits: Tensor, tree: DraftTree | None, children: list[list[int]]
) -> tuple[list[int], int]:
    """The lossless walk of one verified tree: the accepted path (input indices, root first) and
    the bonus token; ``logits`` [n+1, V] at the root and every node."""
    if tree is None or tree.tokens.numel() == 0:
        return [0], sample(sampling, logits[0])
    if sampling.greedy:
        argmax = logits.argmax(-1)
        path = longest_greedy_path(tree.tokens, tree.parents, argmax)
        return path, int(argmax[path[-1]])
    path, p = walk_tree(sampling.probs(logits), tree.tokens.tolist(), children, tree.q, sampling)
    return path, sampling.sample(p)


def sample(sampling: Sampling, logits: Tensor) -> int:
    """One token from the target's logits [V], as the request samples."""
    if sampling.greedy:
        return int(logits.argmax())
    return sampling.sample(sampling.probs(logits))


def _sampling_params(given: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**given)
    except TypeError:
        known = ", ".join(f.name for f in fields(SamplingParams) if f.init)
        raise TypeError(f"unknown sampling fields {sorted(given)}; SamplingParams has {known}") from None


def _eos_ids(path: Path, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((path / name).read_text()).get("eos_token_id")
        except OSError:
            continue
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)
