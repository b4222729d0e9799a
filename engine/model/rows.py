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
padded queries, see only slot 0: finite, and thrown away. Where the native kernel runs
(``native.py``: fp32 on a CPU), the decoding rows and the rows verifying a chain of drafts attend
in one call of it instead, one query a token, each read as far as its own slot, with no mask and
no padding (a chain's token sees its row up to itself, as a decoding token does): a step with
rows verifying chains takes 0.73-0.89x the time of their masked, padded group
(``benchmarks/verify_steps.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native

# A row with more tokens than this attends alone (a prompt chunk); the rest attend together.
SHORT = 16
# What one more group of decoding rows costs a layer (its products' calls), in the cache slots
# that much time reads: a 16-row step here reads a slot of a row in about 0.1 us, a group's calls
# take about 50.
GROUP_SLOTS = 512


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
    the ``(hi - lo) * q`` padded queries (None: exactly those, in order: no scatter). ``mask`` None:
    one row's first tokens, causal (SDPA skips the blocks a causal mask hides: a prompt's first
    chunk); for one row's run of more than ``SHORT`` tokens, added to the scores (0 or -inf, built
    once a step: SDPA turned a boolean mask into that in every layer)."""

    lo: int
    hi: int
    q: int
    kv_len: int
    mask: Tensor | None  # Bool[hi - lo, 1, q, kv_len], or Float[1, 1, q, kv_len] for a long run
    tokens: Tensor  # Long[n]
    padded: Tensor | None


@dataclass(frozen=True)
class Decoding:
    """Tokens that each see their row up to their own slot (decoding, and chains of drafts),
    attended by the native kernel, one query a token: ``tokens`` are their indices into the step's
    T tokens, in order; token i reads the first ``lengths[i]`` slots of row ``rows[i]``."""

    tokens: Tensor  # Long[n]
    rows: Tensor  # Long[n], on the CPU
    lengths: Tensor  # Long[n]


@dataclass(frozen=True)
class Rows:
    """A batched step: token t runs at RoPE ``positions[t]``, its KV written to ``rows[t], slots[t]``;
    ``native``: on the native kernels (``native.py``)."""

    positions: Tensor  # Long[T]
    rows: Tensor  # Long[T]
    slots: Tensor  # Long[T]
    groups: tuple[Group | Decoding, ...]
    native: bool = False

    @classmethod
    def build(cls, spans: Sequence[Span], device: torch.device, native: bool = False) -> Rows:
        """The step that runs ``spans`` (one per sequence, distinct rows), tokens in span order;
        ``native``: it runs on the native kernels (where ``native.runs_on`` the model)."""
        counts = torch.tensor([s.q for s in spans])
        first = torch.tensor([s.start for s in spans]).repeat_interleave(counts)
        within = _within(counts)
        depths = within
        if any(s.depths is not None for s in spans):
            depths = torch.cat([torch.arange(s.q) if s.depths is None else s.depths.to("cpu") for s in spans])
        offsets = (counts.cumsum(0) - counts).tolist()
        groups = tuple(_group(part, [offsets[i] for i in ids], device, native) for ids, part in _parts(spans, native))
        rows = torch.tensor([s.row for s in spans]).repeat_interleave(counts)
        return cls((first + depths).to(device), rows.to(device), (first + within).to(device), groups, native)

    def write(self, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor) -> None:
        """The step's keys and values [T, n_kv, d] to their rows and slots."""
        cache_k[self.rows, :, self.slots] = k
        cache_v[self.rows, :, self.slots] = v

    def attend(self, q: Tensor, cache_k: Tensor, cache_v: Tensor) -> Tensor:
        """Attend ``q`` [T, heads, d] once the step's keys and values are in the cache (``write``,
        ``native.rope_write``); returns [T, heads, d].

        The query heads that share a KV head attend as one head with that many times the queries
        (``_by_kv_head``), so each cache row is read once per KV head: SDPA's ``enable_gqa`` on a
        CPU copies the keys and values for every query head (a 16-row decoding step's attention:
        1.2 -> 0.8 ms a layer here)."""
        per_kv = q.shape[1] // cache_k.shape[1]
        if len(self.groups) == 1 and self.groups[0].tokens.numel() == q.shape[0]:  # every token, in order
            return _attend(self.groups[0], q, per_kv, cache_k, cache_v)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.tokens] = _attend(g, q[g.tokens], per_kv, cache_k, cache_v)
        return out


@dataclass(frozen=True)
class Outputs:
    """The tokens of a step whose outputs it needs (``tokens``, indices into its T tokens, in order)
    and a step of those alone (``rows``; None: no token), each attending as it does in the whole
    step. The last layer runs only these: every token's keys and values are written, but a prompt
    chunk needs no layer's output but the last one's of its final token, and the rest of that layer
    (attention, output projection, MLP) is a sixth of a prompt token's work here."""

    tokens: Tensor  # Long[k]
    rows: Rows | None

    @classmethod
    def build(
        cls, spans: Sequence[Span], wanted: Sequence[int], device: torch.device, native: bool = False
    ) -> Outputs | None:
        """For the step of ``spans`` whose outputs are wanted at tokens ``wanted`` (ascending): each
        span wanted whole, at its last token only (a chain), or not at all. None where every token
        is wanted (nothing to leave out) or a span is wanted otherwise."""
        if len(wanted) == sum(span.q for span in spans):
            return None
        kept: list[Span] = []
        wanted_set, offset = set(wanted), 0
        for span in spans:
            mine = [t for t in range(offset, offset + span.q) if t in wanted_set]
            if len(mine) == span.q:
                kept.append(span)
            elif mine == [offset + span.q - 1] and span.tree is None:
                kept.append(Span(span.row, span.start + span.q - 1, 1))
            elif mine:
                return None
            offset += span.q
        tokens = torch.tensor(list(wanted), dtype=torch.long, device=device)
        return cls(tokens, Rows.build(kept, device, native) if kept else None)


def _attend(g: Group | Decoding, q: Tensor, per_kv: int, cache_k: Tensor, cache_v: Tensor) -> Tensor:
    """Group ``g``'s queries ``q`` [n, heads, d] (its tokens, in order) over its slice of the cache."""
    if isinstance(g, Decoding):
        return native.decode_attention(q, cache_k, cache_v, g.rows, g.lengths)
    if g.q == 1 and g.mask is not None:
        return _decode(g, g.mask, q, per_kv, cache_k, cache_v)
    rows, (heads, d) = g.hi - g.lo, q.shape[1:]
    if g.mask is None or g.q > SHORT:  # one row's chain (a prompt chunk): so many queries that GQA's copy is nothing
        y = F.scaled_dot_product_attention(
            q.view(1, g.q, heads, d).transpose(1, 2),
            cache_k[g.lo : g.hi, :, : g.kv_len],
            cache_v[g.lo : g.hi, :, : g.kv_len],
            attn_mask=None if g.mask is None else g.mask.to(q.dtype),
            is_causal=g.mask is None,
            enable_gqa=per_kv > 1,
        )
        return y.transpose(1, 2).reshape(g.q, heads, d)
    if g.padded is not None:
        q = q.new_zeros(rows * g.q, heads, d).index_copy_(0, g.padded, q)
    y = F.scaled_dot_product_attention(
        _by_kv_head(q.view(rows, g.q, heads, d), per_kv),
        cache_k[g.lo : g.hi, :, : g.kv_len],
        cache_v[g.lo : g.hi, :, : g.kv_len],
        attn_mask=g.mask if g.q == 1 or per_kv == 1 else g.mask.repeat(1, 1, per_kv, 1),
    )
    y = _by_query_head(y, per_kv)
    return y if g.padded is None else y[g.padded]


def _decode(g: Group, mask: Tensor, q: Tensor, per_kv: int, cache_k: Tensor, cache_v: Tensor) -> Tensor:
    """Rows that each run one query (decoding): two batched products with the cache as the long
    operand (the scores as keys x queries, so no product packs a copy of the keys; SDPA's kernel
    reads them at a third of the speed for four queries a KV head), the mask applied between."""
    rows, (heads, d) = g.hi - g.lo, q.shape[1:]
    if g.padded is not None:
        q = q.new_zeros(rows, heads, d).index_copy_(0, g.padded, q)
    queries = (q * d**-0.5).view(rows, heads // per_kv, per_kv, d)
    keys, values = cache_k[g.lo : g.hi, :, : g.kv_len], cache_v[g.lo : g.hi, :, : g.kv_len]
    scores = torch.matmul(keys, queries.transpose(-1, -2)).transpose(-1, -2)  # [rows, n_kv, per_kv, kv_len]
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    y = torch.matmul(weights, values).view(rows, heads, d)
    return y if g.padded is None else y[g.padded]


def _by_kv_head(q: Tensor, per_kv: int) -> Tensor:
    """Queries [n, q, heads, d] as [n, n_kv, per_kv * q, d]: the ``per_kv`` heads of each KV head
    (head h reads KV head h // per_kv) side by side, head-major, so query i of head j sits at
    j * q + i and a group's mask [n, 1, q, kv] repeated ``per_kv`` times covers them."""
    n, length, heads, d = q.shape
    return q.view(n, length, heads // per_kv, per_kv, d).permute(0, 2, 3, 1, 4).reshape(n, heads // per_kv, -1, d)


def _by_query_head(y: Tensor, per_kv: int) -> Tensor:
    """``_by_kv_head``'s output [n, n_kv, per_kv * q, d] back as [n * q, heads, d]."""
    n, kv, rows, d = y.shape
    length = rows // per_kv
    return y.view(n, kv, per_kv, length, d).permute(0, 3, 1, 2, 4).reshape(n * length, kv * per_kv, d)


def _parts(spans: Sequence[Span], native: bool) -> list[tuple[list[int], list[Span]]]:
    """Which spans attend together (indices, spans): the rows that run one token (decoding) in runs
    of neighbouring rows (``_runs_by_length``; all in one where the native kernel runs, with the
    rows verifying chains); the rows
    that verify drafts together when they fill most of the rows between them, else each alone; a
    prompt chunk alone. A group pads every row of its range to its longest span, so a
    row verifying ten drafts beside fifteen decoding ones would cost the step eleven queries a row."""
    single = [i for i, s in enumerate(spans) if (_chain(s) if native else s.q == 1)]
    several = [i for i, s in enumerate(spans) if 1 < s.q <= SHORT and i not in single]
    parts = [[i] for i, s in enumerate(spans) if s.q > SHORT]
    parts += ([single] if single else []) if native else _runs_by_length(spans, single)
    rows = [spans[i].row for i in several]
    if several and 2 * len(several) >= max(rows) - min(rows) + 1:
        parts.append(several)
    else:
        parts += [[i] for i in several]
    return [(ids, [spans[i] for i in ids]) for ids in parts]


def _runs_by_length(spans: Sequence[Span], decoding: list[int]) -> list[list[int]]:
    """The decoding rows (indices of ``spans``) in runs of neighbouring cache rows that attend
    together, each over its own longest row: the fewest cache slots read (rows of a run, idle or
    not, times its longest), a run costing ``GROUP_SLOTS`` more. Rows hold requests of any length
    side by side, so one group would read every row as far as the longest."""
    order = sorted(decoding, key=lambda i: spans[i].row)
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        last, longest, best[j] = spans[order[j - 1]].row, 0, -1
        for i in range(j - 1, -1, -1):
            longest = max(longest, spans[order[i]].start + 1)
            cost = best[i] + GROUP_SLOTS + (last - spans[order[i]].row + 1) * longest
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(order)
    while j:
        runs.append(sorted(order[cut[j] : j]))  # in step order, as the step's tokens are
        j = cut[j]
    return runs[::-1]


def _chain(span: Span) -> bool:
    """A token decoding, or a short chain of drafts verifying: each of its tokens sees its row up
    to its own slot, which is what the native kernel's queries do, one query a token."""
    return span.q == 1 or (span.tree is None and span.q <= SHORT)


def _within(counts: Tensor) -> Tensor:
    """Each token's index within its span, for spans of ``counts`` tokens laid end to end."""
    ends = counts.cumsum(0)
    return torch.arange(int(ends[-1])) - (ends - counts).repeat_interleave(counts)


def _group(spans: Sequence[Span], offsets: Sequence[int], device: torch.device, native: bool) -> Group | Decoding:
    """Built with a few whole-tensor operations, not some per span: a 16-row step is built in 0.2 ms, not 0.7."""
    if native and all(_chain(s) for s in spans):  # one query a token, each over its row up to its slot
        counts = torch.tensor([s.q for s in spans])
        within = _within(counts)
        tokens = torch.tensor(offsets).repeat_interleave(counts) + within
        rows = torch.tensor([s.row for s in spans]).repeat_interleave(counts)
        lengths = torch.tensor([s.start + 1 for s in spans]).repeat_interleave(counts) + within
        return Decoding(tokens.to(device), rows, lengths)
    lo, hi = min(s.row for s in spans), max(s.row for s in spans) + 1
    q = max(s.q for s in spans)
    kv_len = max(s.start + s.q for s in spans)
    if len(spans) == 1 and spans[0].start == 0 and spans[0].tree is None:  # causal: no mask to build
        return Group(lo, hi, q, kv_len, None, torch.arange(offsets[0], offsets[0] + q, device=device), None)
    if q == 1:
        return _decoding_group(spans, offsets, lo, hi, kv_len, device)
    rows = torch.tensor([s.row for s in spans]) - lo
    counts = torch.tensor([s.q for s in spans])
    starts = torch.tensor([s.start for s in spans])
    keys, queries = torch.arange(kv_len), torch.arange(q)
    sees = keys <= (starts[:, None] + queries)[..., None]  # [spans, q, kv_len]: causal over the row
    sees &= (queries < counts[:, None])[..., None] | (keys == 0)  # padded queries: slot 0 only
    mask = torch.zeros(hi - lo, 1, q, kv_len, dtype=torch.bool)
    mask[:, :, :, 0] = True  # idle rows: slot 0 only
    mask[rows, 0] = sees
    for r, span in zip(rows.tolist(), spans, strict=True):
        if span.tree is not None:
            mask[r, 0, : span.q, span.start : span.start + span.q] = span.tree.to("cpu")
    if q > SHORT:  # one row alone (``_parts``): the mask added to its scores
        mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    within = _within(counts)
    tokens = torch.tensor(offsets).repeat_interleave(counts) + within
    flat = (rows * q).repeat_interleave(counts) + within
    dense = flat.numel() == (hi - lo) * q and bool((flat == torch.arange(flat.numel())).all())
    return Group(lo, hi, q, kv_len, mask.to(device), tokens.to(device), None if dense else flat.to(device))


def _decoding_group(
    spans: Sequence[Span], offsets: Sequence[int], lo: int, hi: int, kv_len: int, device: torch.device
) -> Group:
    """``_group`` of rows that run one token each: each sees its row up to its own slot, an idle row
    slot 0 only (the mask of the general case, in a third of its operations)."""
    rows = [s.row - lo for s in spans]
    seen = torch.zeros(hi - lo, dtype=torch.long)
    seen[rows] = torch.tensor([s.start for s in spans])
    mask = (torch.arange(kv_len) <= seen[:, None]).view(hi - lo, 1, 1, kv_len)
    padded = None if rows == list(range(hi - lo)) else torch.tensor(rows, device=device)
    return Group(lo, hi, 1, kv_len, mask.to(device), torch.tensor(offsets, device=device), padded)
