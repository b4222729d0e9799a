"""Where one batched forward runs: many sequences' tokens in one pass over a cache with a row each.

Continuous batching runs, every step, a few tokens of every running sequence (one to decode, a
draft to verify, a chunk of a prompt) in ONE target forward. The projections and the MLP see all
T tokens as one flat matrix, which is what batching buys; only attention needs to know whose
token is whose. Each sequence owns one row of a static cache ``[rows, n_kv, len, head_dim]`` and
its tokens sit at explicit slots of that row, so attention reads the cache as a view (never a
gather): the short rows of a step (decoding, verifying) attend together over a slice of rows,
queries padded to the longest, and each long row (a prompt chunk) attends alone, so one prompt
never pads every decoding row to its length; rows verifying drafts attend apart from the decoding
ones for the same reason (``_parts``). Rows of a slice that run nothing this step, and
padded queries, see only slot 0: finite, and thrown away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# A row with more tokens than this attends alone (a prompt chunk); the rest attend together.
SHORT = 16


@dataclass(frozen=True)
class Span:
    """One sequence's part of a step: ``q`` tokens after the ``start`` already in cache ``row``.

    ``tree`` None: a chain (each token sees the prefix and the tokens before it). A tree brings its
    positions after ``start`` (``depths``, Long[q], 0 for the root) and its mask among the ``q``
    tokens (Bool[q, q], ancestors-or-self)."""

    row: int
    start: int
    q: int
    depths: Tensor | None = None
    tree: Tensor | None = None


@dataclass(frozen=True)
class Group:
    """Cache rows ``lo``..``hi`` that attend together, with ``q`` queries each over ``kv_len`` slots.

    ``tokens`` are the group's indices into the step's T tokens and ``padded`` where each sits in
    the ``(hi - lo) * q`` padded queries (None: exactly those, in order: no scatter)."""

    lo: int
    hi: int
    q: int
    kv_len: int
    mask: Tensor  # Bool[hi - lo, 1, q, kv_len]
    tokens: Tensor  # Long[n]
    padded: Tensor | None


@dataclass(frozen=True)
class Rows:
    """A batched step: token t runs at RoPE ``positions[t]``, its KV written to ``rows[t], slots[t]``."""

    positions: Tensor  # Long[T]
    rows: Tensor  # Long[T]
    slots: Tensor  # Long[T]
    groups: tuple[Group, ...]

    @classmethod
    def build(cls, spans: Sequence[Span], device: torch.device) -> Rows:
        """The step that runs ``spans`` (one per sequence, distinct rows), tokens in span order."""
        positions, rows, offsets = [], [], []
        t = 0
        for span in spans:
            depths = span.depths if span.depths is not None else torch.arange(span.q)
            positions.append(span.start + depths.to("cpu"))
            rows.append(torch.full((span.q,), span.row))
            offsets.append(t)
            t += span.q
        groups = [_group(part, [offsets[i] for i in ids], device) for ids, part in _parts(spans)]
        slots = torch.cat([torch.arange(s.start, s.start + s.q) for s in spans])
        return cls(torch.cat(positions).to(device), torch.cat(rows).to(device), slots.to(device), tuple(groups))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor) -> Tensor:
        """Write ``k``/``v`` [T, n_kv, d] to the cache, then attend ``q`` [T, heads, d]; returns [T, heads, d]."""
        cache_k[self.rows, :, self.slots] = k
        cache_v[self.rows, :, self.slots] = v
        out = torch.empty_like(q)
        heads, d = q.shape[1:]
        for g in self.groups:
            n = g.hi - g.lo
            mine = q[g.tokens]
            if g.padded is not None:
                mine = q.new_zeros(n * g.q, heads, d).index_copy_(0, g.padded, mine)
            y = F.scaled_dot_product_attention(
                mine.view(n, g.q, heads, d).transpose(1, 2),
                cache_k[g.lo : g.hi, :, : g.kv_len],
                cache_v[g.lo : g.hi, :, : g.kv_len],
                attn_mask=g.mask,
                enable_gqa=cache_k.shape[1] != heads,
            )
            y = y.transpose(1, 2).reshape(n * g.q, heads, d)
            out[g.tokens] = y if g.padded is None else y[g.padded]
        return out


def _parts(spans: Sequence[Span]) -> list[tuple[list[int], list[Span]]]:
    """Which spans attend together (indices, spans): every row that runs one token (decoding) in one
    group; the rows that verify drafts in another when they fill most of the rows between them, else
    each alone; a prompt chunk alone. A group pads every row of its range to its longest span, so a
    row verifying ten drafts beside fifteen decoding ones would cost the step eleven queries a row."""
    single = [i for i, s in enumerate(spans) if s.q == 1]
    several = [i for i, s in enumerate(spans) if 1 < s.q <= SHORT]
    parts = [[i] for i, s in enumerate(spans) if s.q > SHORT]
    if single:
        parts.append(single)
    rows = [spans[i].row for i in several]
    if several and 2 * len(several) >= max(rows) - min(rows) + 1:
        parts.append(several)
    else:
        parts += [[i] for i in several]
    return [(ids, [spans[i] for i in ids]) for ids in parts]


def _group(spans: Sequence[Span], offsets: Sequence[int], device: torch.device) -> Group:
    lo, hi = min(s.row for s in spans), max(s.row for s in spans) + 1
    q = max(s.q for s in spans)
    kv_len = max(s.start + s.q for s in spans)
    mask = torch.zeros(hi - lo, 1, q, kv_len, dtype=torch.bool)
    mask[:, :, :, 0] = True  # idle rows and padded queries: slot 0 only
    keys = torch.arange(kv_len)
    tokens, padded = [], []
    for span, offset in zip(spans, offsets, strict=True):
        r = span.row - lo
        mask[r, 0, : span.q] = keys <= torch.arange(span.start, span.start + span.q)[:, None]
        if span.tree is not None:
            mask[r, 0, : span.q, span.start : span.start + span.q] = span.tree.to("cpu")
        tokens.append(torch.arange(offset, offset + span.q))
        padded.append(r * q + torch.arange(span.q))
    flat = torch.cat(padded)
    dense = flat.numel() == (hi - lo) * q and bool((flat == torch.arange(flat.numel())).all())
    return Group(lo, hi, q, kv_len, mask.to(device), torch.cat(tokens).to(device), None if dense else flat.to(device))
