"""Drafters propose a tree of tokens; the engine verifies it in one target forward.

One drafter object lives for one request and keeps that request's state; the heavy shared parts
(a head and its weights) are passed in. A chain is a tree whose parents are i - 1. The root of
every tree is the last emitted token, which the target has not processed yet. The loop asks a
drafter that needs no model (prompt lookup) every step and verifies what the plan pays for; an
EAGLE drafter is asked only on steps the plan gives drafts, so ``accept`` must keep a drafter
consistent across plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


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
