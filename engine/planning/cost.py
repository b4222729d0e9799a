"""What the parts of one decoding step cost on this machine, measured once and cached.

Verifying q tokens in one forward costs very different multiples of one token on different
hardware (a 2-core CPU pays 3-4x for 8 tokens, an H200 1.5x for 64), and so does drafting (an
EAGLE head level is a sizeable share of a target step for the fixture on this CPU, a few percent
for an 8B model on a GPU). So what pays is a property of the machine: we time the target, the
draft model, an EAGLE head level and a prompt lookup once per (models, device, dtype, threads),
keep the figures in ``~/.cache/ace_mw/`` (``ACE_MW_CACHE`` overrides; delete to re-measure), and
``planner.py`` turns them into how much to draft each step. The parts are timed round-robin, so
load from other processes skews them alike and their ratios, which decide, stay sound.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from itertools import pairwise
from pathlib import Path

import torch

from ..model.packed import run_counts
from ..model.step import Step
from ..model.transformer import Transformer

SIZES = (1, 2, 4, 8, 16, 32, 64)  # verify: up to the largest trees
DRAFT_SIZES = SIZES  # draft model and head: a token or a frontier at a time, and catch-ups
OPTIONAL_CURVES = ("draft_model", "head_level", "head_commit")  # measured when that drafter is loaded
CACHE_DIR = Path(os.environ.get("ACE_MW_CACHE", Path.home() / ".cache" / "ace_mw"))

# A first start measures for a minute or more: say so, and how far it is (a server's CLI shows it).
logger = logging.getLogger(__name__)


class CostCurve:
    """Milliseconds for one pass over q inputs (tokens, or tree nodes), linearly interpolated."""

    def __init__(self, ms: dict[int, float]):
        self.sizes = sorted(ms)
        self.ms = [ms[s] for s in self.sizes]

    def __call__(self, q: float) -> float:
        sizes, ms = self.sizes, self.ms
        if q <= sizes[0]:
            return ms[0]
        for (s0, m0), (s1, m1) in pairwise(zip(sizes, ms, strict=True)):
            if q <= s1:
                return m0 + (m1 - m0) * (q - s0) / (s1 - s0)
        return ms[-1] * q / sizes[-1]  # beyond the table: assume compute bound

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.ms, strict=True))


@dataclass(frozen=True)
class EngineCosts:
    """Milliseconds of each part of a step: verifying, and drafting with each loaded drafter."""

    verify: CostCurve  # the target over q inputs; q = 1 is a plain step
    draft_model: CostCurve | None = None  # the draft model over q tokens; one drafted token is q = 1
    head_level: CostCurve | None = None  # one EAGLE head level over q nodes, lm_head and top-k included
    head_commit: CostCurve | None = None  # the EAGLE head over q confirmed pairs (catching up), no lm_head

    @classmethod
    def load_or_measure(cls, target: Transformer, head=None, draft: Transformer | None = None) -> EngineCosts:
        w = target.embed_tokens.weight
        key = [asdict(target.config), str(w.device), str(w.dtype), target.kernels, run_counts(), SIZES, DRAFT_SIZES]
        if draft is not None:
            key.append(["draft", asdict(draft.config), str(draft.embed_tokens.weight.dtype), draft.kernels])
        if head is not None:
            key.append([type(head).__name__, asdict(head.config), str(head.fc.weight.dtype), head.taps])
        path = CACHE_DIR / f"costs-{hashlib.sha256(_key_text(key).encode()).hexdigest()[:16]}.json"
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # absent or unreadable: measure
        logger.info("measuring this machine's step costs once (cached in %s; delete it to re-measure)", path)
        started = time.perf_counter()
        costs = cls.measure(target, head, draft)
        logger.info("step costs measured in %.0f s", time.perf_counter() - started)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(costs.to_json()))
        except OSError:
            pass  # a read-only home only costs a re-measure next time
        return costs

    @classmethod
    def measure(
        cls, target: Transformer, head=None, draft: Transformer | None = None, repeats: int = 15
    ) -> EngineCosts:
        """Time every part, round-robin, and keep each one's fastest run."""
        timers = {("verify", q): run for q, run in _forward_timers(target, SIZES).items()}
        if draft is not None:
            timers.update({("draft_model", q): run for q, run in _forward_timers(draft, DRAFT_SIZES).items()})
        if head is not None:
            for (part, q), run in _head_timers(head, target).items():
                timers[part, q] = run
        by_part: dict[str, dict[int, float]] = {}
        for (part, q), ms in fastest_each(timers, target.embed_tokens.weight.device, repeats).items():
            by_part.setdefault(part, {})[q] = ms
        return cls.from_json(by_part)

    def with_head(self, other: EngineCosts) -> EngineCosts:
        """These costs with ``other``'s head curves: a second head plans against the same verify curve."""
        return replace(self, head_level=other.head_level, head_commit=other.head_commit)

    def to_json(self) -> dict:
        curves = {name: getattr(self, name) for name in ("verify", *OPTIONAL_CURVES)}
        return {k: v.as_dict() for k, v in curves.items() if v is not None}

    @classmethod
    def from_json(cls, figures: dict) -> EngineCosts:
        """The inverse of ``to_json``; raises (KeyError, TypeError, ValueError...) on anything else."""

        def curve(ms: dict) -> CostCurve:
            return CostCurve({int(q): float(t) for q, t in ms.items()})

        optional = {name: curve(figures[name]) if name in figures else None for name in OPTIONAL_CURVES}
        return cls(curve(figures["verify"]), **optional)


def _forward_timers(model: Transformer, sizes, prefix: int = 128) -> dict[int, Callable[[], object]]:
    """A forward over q tokens behind a ``prefix`` of context (the target verifying, the draft model
    drafting), shortened to fit the model's cache."""
    device = model.embed_tokens.weight.device
    prefix = min(prefix, model.max_seq_len - max(sizes))
    ids = torch.randint(0, model.config.vocab_size, (1, prefix + max(sizes)), device=device)
    with torch.inference_mode():
        model(ids[:, :prefix], torch.arange(prefix, device=device), last_logits_only=True)

    def run(q: int) -> None:
        with torch.inference_mode():
            model(ids[:, prefix : prefix + q], torch.arange(prefix, prefix + q, device=device))

    return {q: partial(run, q) for q in sizes}


def _head_timers(head, target: Transformer, prefix: int = 128) -> dict[tuple[str, int], Callable[[], object]]:
    """Behind ``prefix`` committed pairs: one head level over q frontier nodes (the head pass with a
    tree mask, the log-probs and their top-k; EAGLE scores through the target's lm_head, EAGLE-3
    through its own draft-vocabulary one), and the head catching up on q confirmed pairs (a causal
    pass, no lm_head)."""
    device, top = head.fc.weight.device, max(DRAFT_SIZES)
    head.setup_drafting(target, prefix + top)
    ids = torch.randint(0, target.config.vocab_size, (prefix + top,), device=device)
    # Inside a tree the head reads its own predictions (H wide); confirmed pairs bring the target's
    # features, one H per tapped layer for a head that taps several (EAGLE-3).
    dtype, width = target.lm_head.weight.dtype, target.config.hidden_size * max(1, len(head.taps))
    feats = torch.randn(prefix + top, head.fc.out_features, device=device, dtype=dtype)
    target_feats = torch.randn(prefix + top, width, device=device, dtype=dtype)
    slots = torch.arange(prefix + top, device=device)
    with torch.inference_mode():
        head.step(target_feats[None, :prefix], ids[None, :prefix], target.embed_tokens, Step.span(0, prefix, device))

    def level(q: int) -> None:
        at = slots[prefix : prefix + q]
        mask = torch.ones(q, prefix + q, dtype=torch.bool, device=device)
        with torch.inference_mode():
            out = head.step(feats[None, at], ids[None, at], target.embed_tokens, Step(at, at, mask, prefix + q))
            torch.topk(head.draft_logprobs(out[0]), min(q, 10), dim=-1)

    def commit(q: int) -> None:
        at = slots[prefix : prefix + q]
        with torch.inference_mode():
            head.step(target_feats[None, at], ids[None, at], target.embed_tokens, Step.span(prefix, q, device))

    timers: dict[tuple[str, int], Callable[[], object]] = {}
    for q in DRAFT_SIZES:
        timers["head_level", q], timers["head_commit", q] = partial(level, q), partial(commit, q)
    return timers


def fastest_each(runs: dict, device: torch.device, repeats: int) -> dict:
    """Milliseconds of the fastest of ``repeats`` runs of each, after a warm-up round; one round
    runs each once, so load from other processes hits them alike (contention only adds time).

    On a CPU with one torch thread all the work happens in this thread, so its CPU time is the
    clock: time spent waiting for a core that another process holds is left out.
    """
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    best = dict.fromkeys(runs, float("inf"))
    for round_ in range(repeats + 1):
        logger.info("measuring step costs: round %d of %d (%d parts)", round_ + 1, repeats + 1, len(runs))
        for name, run in runs.items():
            _sync(device)
            t0 = clock()
            run()
            _sync(device)
            if round_:
                best[name] = min(best[name], (clock() - t0) * 1000)
    return best


def _key_text(key: list) -> str:
    return json.dumps([*key, torch.get_num_threads(), torch.__version__], sort_keys=True, default=str)


def _sync(device: torch.device) -> None:
    """Wait for queued kernels so a timing covers the work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
