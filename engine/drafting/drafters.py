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
    what followed it. Needs no model: an index from every n-gram with a token after it to where
    that token is, kept as tokens arrive, so a proposal is a few dictionary lookups however long
    the context (a batch asks every lookup row every step)."""

    taps: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, device="cpu"):
        self.max_ngram, self.device = max_ngram, device
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> the index after its latest followed occurrence

    def reset(self, input_ids: Tensor, hidden: Tensor) -> None:
        self.tokens, self.after = [], {}
        self._append(input_ids.tolist())

    def accept(self, tokens: Tensor, hidden: Tensor) -> None:
        self._append(tokens.tolist())

    def _append(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            end = len(tokens)  # the n-grams ending here are now followed by ``token``
            for n in range(1, min(self.max_ngram, end) + 1):
                self.after[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, plan: Plan) -> DraftTree:
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self.after.get(tuple(tokens[-n:]))
            if start is not None:
                return DraftTree.chain(torch.tensor(tokens[start : start + plan.tokens], device=self.device))
        return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
