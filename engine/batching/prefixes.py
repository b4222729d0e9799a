"""Prefix caching: a request does not compute again the first tokens of its prompt that a cache row
already holds.

Each row of the batch cache keeps the KV of every token its request ran: its prompt and what it
emitted, and still once the request ends. A new request takes the free row whose tokens share the
longest prefix with its prompt and prefills only the rest, as llama-server's slots do
(``cache_prompt``). Before each chunk of its prompt runs, a row that another row (running or free)
holds more of copies that part from it (``longest_held``): requests that arrive together compute
their shared system prompt once, in the first row to run it; copying a 100-token prefix's KV takes
microseconds, computing it tens of milliseconds.

Keyed by token ids, compared from the first. Bounded by the cache itself: what a row holds is at
most one row of ``max_num_seqs``, so it costs no memory, and it is forgotten when another request
takes the row. Where no free row shares anything, the lowest free row is taken (it keeps the
batch's slice of rows short).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


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
                n = common_prefix(self.held[candidate], prompt)
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

    def holders(self) -> Iterable[tuple[int, list[int]]]:
        """The free rows and the tokens each holds."""
        return ((row, self.held[row]) for row in self.free)


def longest_held(prompt: Sequence[int], have: int, rows: Iterable[tuple[int, Sequence[int]]]) -> tuple[int, int]:
    """(row, n): the row among ``rows`` (each with the tokens it holds) that holds the most of
    ``prompt`` beyond its first ``have`` tokens, and how many of its first tokens that is, at most all
    but the last; (-1, have) where no row holds more."""
    best, found = have, -1
    for row, held in rows:
        n = min(common_prefix(held, prompt), len(prompt) - 1)
        if n > best:
            best, found = n, row
    return found, best


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` share: a binary search over slice comparisons, which
    run in C (a 500-token prompt against a row in microseconds, not a Python loop's 30)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low], a[:high] != b[:high]
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
