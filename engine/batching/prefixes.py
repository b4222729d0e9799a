"""Prefix caching: a request starts where a free cache row already holds the first tokens of its prompt.

Each row of the batch cache keeps, once its request ends, the KV of every token that request ran:
its prompt and what it emitted. A new request takes the free row whose tokens share the longest
prefix with its prompt and prefills only the rest, as llama-server's slots do (``cache_prompt``): a
shared system prompt, or the earlier turns of a conversation, is not computed again.

Keyed by token ids, compared from the first. Bounded by the cache itself: what a row holds is at
most one row of ``max_num_seqs``, so it costs no memory, and it is forgotten when another request
takes the row. Where no free row shares anything, the lowest free row is taken (it keeps the
batch's slice of rows short).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class RowPrefixes:
    """The free rows of a batch cache and the tokens each still holds."""

    def __init__(self, rows: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.free = list(range(rows))  # a heap
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.reused = 0  # prompt tokens not recomputed, over all requests

    def take(self, prompt: Sequence[int], reuse: bool = True) -> tuple[int, int]:
        """A free row for ``prompt`` and how many of its first tokens that row holds already: at most
        all but the last, which must run for the first output's logits (0 when ``reuse`` is off)."""
        row, shared = self.free[0], 0
        if self.enabled and reuse:
            for candidate in self.free:
                n = _common_prefix(self.held[candidate], prompt)
                if n > shared or (n == shared and candidate < row):
                    row, shared = candidate, n
        self.free.remove(row)
        heapq.heapify(self.free)
        self.held[row] = []
        shared = min(shared, len(prompt) - 1)
        self.reused += shared
        return row, shared

    def give_back(self, row: int, held: list[int]) -> None:
        """``row`` is free again, holding the KV of ``held`` (nothing, where the row's content is unknown)."""
        self.held[row] = held if self.enabled else []
        heapq.heappush(self.free, row)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
