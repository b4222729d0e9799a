"""Where one cached forward runs: the terms every pass after a prefill shares.

The target, the EAGLE heads and the static-shape runner all take a `Step` in place of the four
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

    def padded(self, q_padded: int, cache_len: int) -> Step:
        """The step as ``q_padded`` queries over the whole cache (static shapes): the real rows see
        what this step lets them see; padded rows take the slots after the real ones and see only
        themselves."""
        q, device = self.slots.numel(), self.slots.device
        extra = q_padded - q
        pad_slots = self.slots.max() + 1 + torch.arange(extra, device=device)
        mask = torch.zeros(q_padded, cache_len, dtype=torch.bool, device=device)
        if self.mask is None:
            mask[:q] = torch.arange(cache_len, device=device) <= self.slots[:, None]
        else:
            mask[:q, : self.kv_len] = self.mask
        mask[torch.arange(q, q_padded, device=device), pad_slots] = True
        positions = torch.cat([self.positions, self.positions[-1:].expand(extra)])
        return Step(positions, torch.cat([self.slots, pad_slots]), mask, cache_len)
