"""The target's verify-cost curve and the draft budget that maximises tokens per second.

Verifying q tokens in one forward costs very different multiples of one token on different
hardware (a 2-core CPU pays 3-4x for 8 tokens, an H200 1.5x for 64), so the best tree size is a
property of the machine. We time the target once per (model, device, dtype, threads), keep the
curve in ``~/.cache/ace_mw/``, and pick the budget b that maximises
``(1 + E[accepted | b]) / cost(b + 1)`` (b drafted tokens plus the root, one bonus token).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path

import torch

from .model import Transformer

SIZES = (1, 2, 4, 8, 16, 32, 64)
CACHE_DIR = Path(os.environ.get("ACE_MW_CACHE", Path.home() / ".cache" / "ace_mw"))


class CostCurve:
    """Milliseconds for one target forward of q tokens after a prefix, linearly interpolated."""

    def __init__(self, ms: dict[int, float]):
        self.sizes = sorted(ms)
        self.ms = [ms[s] for s in self.sizes]

    def __call__(self, q: int) -> float:
        sizes, ms = self.sizes, self.ms
        if q <= sizes[0]:
            return ms[0]
        for (s0, m0), (s1, m1) in pairwise(zip(sizes, ms, strict=True)):
            if q <= s1:
                return m0 + (m1 - m0) * (q - s0) / (s1 - s0)
        return ms[-1] * q / sizes[-1]  # beyond the table: assume compute bound

    def best_budget(self, expected_accepted: Callable[[int], float], budgets=range(1, 64)) -> int:
        """The draft size b with the most expected tokens per unit of verify cost."""
        return max(budgets, key=lambda b: (1.0 + expected_accepted(b)) / self(b + 1))

    def best_chain_length(self, alpha: float, k_max: int) -> int:
        """How many of ``k_max`` chain drafts to verify (0 = a plain step) when each is accepted
        with probability ``alpha`` given the ones before: E[accepted | k] = alpha + ... + alpha**k."""
        return max(range(k_max + 1), key=lambda k: (1.0 + sum(alpha**i for i in range(1, k + 1))) / self(k + 1))

    @classmethod
    def measure(cls, model: Transformer, prefix: int = 128, repeats: int = 10) -> CostCurve:
        """Fastest of ``repeats`` runs of each size after a warm-up, behind a ``prefix`` of context."""
        device = model.embed_tokens.weight.device
        ids = torch.randint(0, model.config.vocab_size, (1, prefix + max(SIZES)), device=device)
        ms = {}
        with torch.inference_mode():
            model(ids[:, :prefix], torch.arange(prefix, device=device), last_logits_only=True)
            for q in SIZES:
                pos = torch.arange(prefix, prefix + q, device=device)
                runs = []
                for _ in range(repeats + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    model(ids[:, prefix : prefix + q], pos)
                    _sync(device)
                    runs.append((time.perf_counter() - t0) * 1000)
                ms[q] = min(runs[1:])  # on a shared machine contention only ever adds time
        return cls(ms)

    @classmethod
    def load_or_measure(cls, model: Transformer) -> CostCurve:
        w = model.embed_tokens.weight
        key = json.dumps(
            [asdict(model.config), str(w.device), str(w.dtype), torch.get_num_threads(), torch.__version__],
            sort_keys=True,
            default=str,
        )
        path = CACHE_DIR / f"cost-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        try:
            return cls({int(q): float(v) for q, v in json.loads(path.read_text()).items()})
        except (OSError, ValueError):
            pass
        curve = cls.measure(model)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(zip(curve.sizes, curve.ms, strict=True))))
        except OSError:
            pass  # a read-only home only costs a re-measure next time
        return curve


def tree_expected_accepted(alpha: float, budget: int) -> float:
    """Expected accepted tokens of the best ``budget``-node tree when the target's next token is the
    drafter's i-th guess with probability ``alpha * (1 - alpha) ** i`` at every node.

    Siblings are exclusive, so E[accepted] is the sum over nodes of P(path accepted); the best tree
    takes the ``budget`` most probable paths, found best-first with a heap. A chain is ``alpha**i``.
    """
    total, frontier = 0.0, [-alpha]  # negated path probabilities (heapq is a min-heap)
    for _ in range(budget):
        prob = -heapq.heappop(frontier)
        total += prob
        heapq.heappush(frontier, -prob * alpha)  # its first child
        heapq.heappush(frontier, -prob * (1 - alpha))  # its next sibling, one rank further down
    return total


def _sync(device: torch.device) -> None:
    """Wait for queued kernels so a timing covers the work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
