"""The in-process engine: the loaded models, what a request asks of them, and a one-request front.

An ``Engine`` loads a target and what its algorithms draft with, checks requests (``prepare``) and
builds each request's drafter (``drafter``). Decoding itself runs in ONE loop,
``batching/scheduler.py``: each step the scheduler plans how much every row drafts (whatever
maximises expected tokens per second on this machine, nothing included), ONE target forward
verifies each row's ``[root] + tree``, the lossless walk picks the accepted path, and a bonus token
is sampled. ``Engine.stream`` and ``generate`` run on that loop with one row; a server runs it
with many (``BatchEngine``). A step that drafts nothing, and a request with no drafter, is exactly
plain decoding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.vocabulary import Algorithm

from .algorithms import DraftSetup, Loaded, Source, entry, missing_source
from .batching import BatchEngine
from .drafting.drafters import Drafter
from .generation import Asked, GenerationResult, StreamChunk, collect
from .model.compiled import DecodingStep
from .model.dtypes import resolve_dtype
from .model.transformer import Transformer
from .params import MAX_TREE_TOKENS, EngineError, SamplingParams, SpecParams, chat_messages
from .planning.batch import BatchCosts
from .planning.cost import EngineCosts
from .planning.planner import best_tree_expected

logger = logging.getLogger(__name__)

# EAGLE-2's largest tree when the planner sizes it per step (the EAGLE-2 paper uses 48-60).
GATED_TREE_TOKENS = 64
# Prior per-token acceptance for sizing a fixed EAGLE-2 tree (self_gate off) when none is given.
EAGLE2_PRIOR_ALPHA = 0.6


class Engine:
    """A loaded target and its drafters; ``generate`` and ``stream`` decode on a loop of one row."""

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
        compile_decode: bool | None = False,
    ):
        """``eagle``, ``eagle3`` and ``draft`` are what the algorithms draft with (see
        ``algorithms.py``). ``costs`` None: measured here once per machine (``cost.py``); pass them
        to decide by others. ``compile_decode``: steps where one or two rows decode plainly run
        compiled (``model/compiled.py``, for a start-up of seconds): None where that is faster than
        the eager step (on a CPU in fp32 where the eager step has no bf16 panels, ``packed.py``),
        True wherever the step runs."""
        self.model, self.tokenizer = target, tokenizer
        for head in (eagle, eagle3):
            if head is not None:
                head.check_target(target.config)
        self.model_name, self.max_context = model_name, max_context
        self.eos_ids = frozenset(eos_ids)
        self.device = target.embed_tokens.weight.device
        # Room after the context for one verify tree, so a step never needs a bounds check.
        target.setup_cache(max_context + MAX_TREE_TOKENS + 1)
        compiles = DecodingStep.supports(target) and (
            compile_decode is True or (compile_decode is None and DecodingStep.pays(target))
        )
        self.decoding_step = DecodingStep(target) if compiles else None
        for model in (target, draft):  # eager fp32 CPU projections: oneDNN's packed weights, bf16 panels
            if model is not None:
                model.pack()
        if draft is not None:
            draft.setup_cache(max_context + MAX_TREE_TOKENS + 1)
        self.costs = costs or EngineCosts.load_or_measure(target, eagle, draft)
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
        levels = self.costs.draft_model
        draft_costs = None
        if levels is not None and draft is not None:
            draft_costs = BatchCosts({1: levels}, padded=draft.kernels != "dense")
        one = BatchCosts({1: self.costs.verify}, padded=target.kernels != "dense")
        self._one = BatchEngine(self, max_num_seqs=1, costs=one, draft_costs=draft_costs)

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
        compile_decode: bool | None = None,
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
            compile_decode=compile_decode,
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
        shorthand for ``sampling=SamplingParams(...)``. Runs on the engine's loop with one row:
        calls from many threads take turns, in the order they came."""
        return self.one_row().stream(messages_or_prompt, sampling, speculative, **fields)

    def one_row(self) -> BatchEngine:
        """The loop ``stream`` runs on: one row, priced by this engine's costs."""
        return self._one

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

    def drafter(self, spec: SpecParams) -> Drafter | None:
        """The request's own drafter (None: baseline, or a draft model, whose rows the loop drafts
        for together); raises EngineError for what this engine cannot run or a bad parameter."""
        k = self.speculative_k(spec)
        found = entry(spec.algorithm)
        if found is None:
            return None
        source = self.sources.get(found.source) if found.source is not None else None
        if found.source is not None and source is None:
            raise missing_source(spec.algorithm, found.source)
        setup = DraftSetup(spec, k, self.tree_budget(spec), source, self.model, self.device)
        try:
            return found.build(setup)
        except ValueError as exc:
            raise EngineError(str(exc), "tree_choices") from None

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

    def tree_budget(self, spec: SpecParams) -> int:
        """The most tree nodes an EAGLE request verifies a step: asked for, or this engine's default."""
        if spec.total_tokens is None:
            return GATED_TREE_TOKENS if spec.self_gate else self.auto_tree_budget
        if not isinstance(spec.total_tokens, int) or not 1 <= spec.total_tokens <= MAX_TREE_TOKENS:
            raise EngineError(
                f"total_tokens must be in [1, {MAX_TREE_TOKENS}], got {spec.total_tokens!r}", "total_tokens"
            )
        return spec.total_tokens


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
