"""Drafters propose a tree of tokens; the engine verifies it in one target forward.

One drafter object lives for one request and keeps that request's state; the heavy shared parts
(a draft model and its preallocated cache) are passed in. A chain is a tree whose parents are i - 1.
The root of every tree is the last emitted token, which the target has not processed yet.
Each step the engine's planner says how much to draft (a ``Plan``); a step it leaves plain does
not call ``propose`` at all, so ``accept`` must keep the drafter consistent across such steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..model.transformer import Transformer
from .sampling import Sampling


@dataclass(frozen=True)
class Plan:
    """How much one step drafts: ``tokens`` sent for verification (a chain's length, a tree's
    budget) grown over ``depth`` levels (draft-model steps, EAGLE head passes)."""

    tokens: int
    depth: int


PLAIN = Plan(0, 0)  # draft nothing: a plain decoding step


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # Long[n]
    parents: Tensor  # Long[n], -1 = child of the root; parents precede children
    q: Tensor | None = None  # Float[n, V]: the distribution node i was drawn from; None = deterministic

    @classmethod
    def chain(cls, tokens: Tensor, q: Tensor | None = None) -> DraftTree:
        return cls(tokens, torch.arange(-1, tokens.numel() - 1, device=tokens.device), q)

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: a chain's first links, or (parents precede children) a subtree."""
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.q is None else self.q[:n])

    @property
    def is_chain(self) -> bool:
        n = self.tokens.numel()
        return bool((self.parents == torch.arange(-1, n - 1, device=self.parents.device)).all())


class Drafter(Protocol):
    # True when proposing costs next to nothing (no model runs): the engine then asks every step,
    # verifies only what pays, and learns from the rest for free.
    cheap: bool
    # Target layers whose inputs ``reset``/``accept`` receive side by side; () (or no attribute) = the
    # final post-norm feature.
    taps: tuple[int, ...]

    def reset(self, input_ids: Tensor, hidden: Tensor) -> None:
        """``input_ids`` [L+1] = prompt + first sampled token; ``hidden`` [L, H] = prompt features."""

    def propose(self, plan: Plan) -> DraftTree:
        """Continuations of the root, at most ``plan``; an empty tree makes the step a plain decode."""

    def accept(self, tokens: Tensor, hidden: Tensor) -> None:
        """``tokens`` [m+1] emitted this step, drafted or plain; ``hidden`` [m+1, H] = the target
        features that predicted them."""


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = 3..1) and propose
    what followed it. Needs no model and no memory beyond the token history."""

    cheap = True
    taps: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, capacity: int = 4096, device="cpu"):
        self.max_ngram = max_ngram
        self.history = torch.zeros(capacity, dtype=torch.long, device=device)
        self.length = 0

    def reset(self, input_ids: Tensor, hidden: Tensor) -> None:
        self.length = 0
        self._append(input_ids)

    def accept(self, tokens: Tensor, hidden: Tensor) -> None:
        self._append(tokens)

    def _append(self, tokens: Tensor) -> None:
        end = self.length + tokens.numel()
        if end > self.history.numel():
            self.history = torch.cat([self.history, torch.zeros_like(self.history)])
            return self._append(tokens)
        self.history[self.length : end] = tokens
        self.length = end

    def propose(self, plan: Plan) -> DraftTree:
        hist = self.history[: self.length]
        for n in range(min(self.max_ngram, self.length - 1), 0, -1):
            # Windows that start early enough to have at least one token after them.
            windows = hist[:-1].unfold(0, n, 1)
            hits = (windows == hist[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return DraftTree.chain(hist[start : start + plan.tokens].clone())
        return DraftTree.chain(hist[:0].clone())


class DraftModelDrafter:
    """A small LM drafts a chain of ``plan.tokens`` tokens, keeping the distributions it sampled from.

    Its static cache never rolls back: after a step the valid length is just the committed prefix
    plus the drafted tokens that the target accepted (and that the draft had already fed itself).
    After plain steps the next proposal first catches up on every token emitted meanwhile, in one
    forward.
    """

    cheap = False
    taps: tuple[int, ...] = ()

    def __init__(self, model: Transformer, sampling: Sampling):
        self.model, self.sampling = model, sampling
        self.tokens: list[int] = []  # everything committed: prompt + emitted
        self.cached = 0  # leading entries of ``tokens`` whose KV is in the draft cache
        self.fed: list[int] | None = None  # drafted tokens of this step's proposal that went through the model

    def reset(self, input_ids: Tensor, hidden: Tensor) -> None:
        self.tokens, self.cached, self.fed = input_ids.tolist(), 0, None

    def accept(self, tokens: Tensor, hidden: Tensor) -> None:
        emitted = tokens.tolist()
        if self.fed is not None:  # this step drafted: the accepted drafts are already in the cache
            reused = 0
            while reused < min(len(emitted), len(self.fed)) and emitted[reused] == self.fed[reused]:
                reused += 1
            self.cached = len(self.tokens) + reused
            self.fed = None
        self.tokens.extend(emitted)

    def propose(self, plan: Plan) -> DraftTree:
        device = self.model.embed_tokens.weight.device
        pending = torch.tensor(self.tokens[self.cached :], dtype=torch.long, device=device)
        pos = torch.arange(self.cached, len(self.tokens), device=device)
        drafted, dists = [], []
        for _i in range(plan.tokens):
            logits, _ = self.model(pending[None], pos, last_logits_only=True)
            if self.sampling.greedy:
                token = int(logits[0, -1].argmax())
            else:
                dists.append(self.sampling.probs(logits[0, -1]))
                token = self.sampling.sample(dists[-1])
            drafted.append(token)
            pending = torch.tensor([token], device=device)
            pos = pos[-1:] + 1
        self.cached = len(self.tokens)
        self.fed = drafted[:-1]
        q = torch.stack(dists) if dists else None
        return DraftTree.chain(torch.tensor(drafted, dtype=torch.long, device=device), q)
