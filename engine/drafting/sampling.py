"""Sampling and the lossless acceptance rules: ``sample`` draws a plain step's token, ``verify``
walks a verified draft.

``logits_to_probs`` is the ONE place where the target's distribution is shaped (temperature, top-k,
top-p); plain sampling and every speculative rule go through it, which is what keeps speculative
sampling distributed exactly like plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .tree import longest_greedy_path

if TYPE_CHECKING:
    from .drafters import DraftTree


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: Tensor) -> Tensor:
        return logits_to_probs(logits, self.temperature, self.top_p, self.top_k)

    def sample(self, probs: Tensor) -> int:
        """One token from a 1-D distribution (argmax when greedy)."""
        if self.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        device = self.generator.device if self.generator is not None else None
        return float(torch.rand((), generator=self.generator, device=device))


def logits_to_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Probabilities over the last dim; temperature 0 gives the one-hot argmax (greedy)."""
    logits = logits.float()
    if temperature <= 0.0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p - q))``: what is left of the target after a rejected draft from ``q``.

    If nothing is left (p <= q everywhere, only possible through rounding) ``p`` is returned.
    """
    r = (p - q).clamp_min_(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_child(p: Tensor, token: int, q: Tensor | None, sampling: Sampling) -> tuple[bool, Tensor]:
    """Try one drafted child ``token`` against the target distribution ``p`` at its parent.

    Sampled drafts (``q`` given): accept with probability ``min(1, p(x) / q(x))``, otherwise continue
    from ``norm(max(0, p - q))``. Deterministic drafts (``q`` None, i.e. one-hot): accept with
    probability ``p(x)``, otherwise zero ``x`` and renormalise. Returns (accepted, p for what follows).
    """
    px = float(p[token])
    if q is None:
        if sampling.uniform() < px:
            return True, p
        one_hot = torch.zeros_like(p)
        one_hot[token] = 1.0
        return False, residual(p, one_hot)
    qx = float(q[token])
    if qx > 0 and sampling.uniform() * qx < px:
        return True, p
    return False, residual(p, q)


def walk_tree(
    probs: Tensor, tokens: list[int], children: list[list[int]], q: Tensor | None, sampling: Sampling
) -> tuple[list[int], Tensor]:
    """The lossless tree walk (SpecInfer; a chain is the one-child case).

    ``probs`` [n+1, V] are the target's shaped distributions at every verify input (0 = root,
    i = node i - 1), ``children[i]`` the inputs whose parent is input i in draft order. From the
    root, try the children in order with ``accept_child``; recurse into the first accepted one.
    Returns the accepted path (input indices, root first) and the distribution for the bonus token.
    """
    node, path = 0, [0]
    while True:
        p = probs[node]
        for child in children[node]:
            ok, p = accept_child(p, tokens[child - 1], None if q is None else q[child - 1], sampling)
            if ok:
                break
        else:
            return path, p
        node = child
        path.append(node)


def sample(sampling: Sampling, logits: Tensor, argmax: Tensor | None = None) -> int:
    """One token from the target's logits [V], as the request samples; ``argmax``: theirs, when a
    batched step took it for every row at once."""
    if sampling.greedy:
        return int(logits.argmax() if argmax is None else argmax)
    return sampling.sample(sampling.probs(logits))


def verify(
    sampling: Sampling,
    logits: Tensor,
    tree: DraftTree | None,
    children: list[list[int]],
    argmax: Tensor | None = None,
) -> tuple[list[int], int]:
    """The lossless walk of one verified tree: the accepted path (input indices, root first) and
    the bonus token; ``logits`` [n+1, V] at the root and every node (``argmax`` [n+1]: theirs, when
    a batched step took it for every row at once)."""
    if tree is None or tree.tokens.numel() == 0:
        return [0], sample(sampling, logits[0], None if argmax is None else argmax[0])
    if sampling.greedy:
        argmax = logits.argmax(-1) if argmax is None else argmax
        path = longest_greedy_path(tree.tokens, tree.parents, argmax)
        return path, int(argmax[path[-1]])
    path, p = walk_tree(sampling.probs(logits), tree.tokens.tolist(), children, tree.q, sampling)
    return path, sampling.sample(p)
