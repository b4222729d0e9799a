"""Where one cached forward runs: the terms every pass after a prefill shares.

The target's own forward and the EAGLE heads take a `Step` in place of the four
values that used to travel together (positions, cache slots, mask, attended length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Step:
    """``q`` tokens at RoPE ``positions``, their KV written to cache ``slots``, attending to the
    first ``kv_len`` cache slots as ``mask`` allows.

    ``mask`` None is causal over the cache: slot j is visible to the query written at slot s iff
    j <= s. A tree passes its own (ancestors-or-self, after the whole prefix).
    """

    positions: Tensor  # Long[q]
    slots: Tensor  # Long[q]
    mask: Tensor | None  # Bool[q, kv_len], True = may attend
    kv_len: int

    @classmethod
    def at(cls, positions: Tensor) -> Step:
        """Contiguous tokens, each written at the slot of its position (a prefill, a chain)."""
        return cls(positions, positions, None, int(positions[-1]) + 1)

    @classmethod
    def span(cls, start: int, q: int, device: torch.device) -> Step:
        """``q`` tokens after ``start`` cached ones."""
        slots = torch.arange(start, start + q, device=device)
        return cls(slots, slots, None, start + q)

    def causal_mask(self) -> Tensor:
        """``mask`` None written out: Bool[q, kv_len]."""
        return torch.arange(self.kv_len, device=self.slots.device) <= self.slots[:, None]
