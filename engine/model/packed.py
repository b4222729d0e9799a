"""A frozen fp32 model's projections in oneDNN's blocked weight layout, for decoding on a CPU.

Why: ``F.linear`` on a CPU calls MKL's sgemm, which runs the few-row products of batched decoding
far below the memory's speed on this project's AMD EPYC machines (MKL takes its generic path
there). The fixture's projections took, one thread, per step: 5.2 ms for one row, 11.7 for 8 and
15.3 for 16 rows with MKL; 5.6, 5.9 and 8.1 ms with oneDNN's kernels on weights reordered once into
their layout (``torch.ops.mkldnn._reorder_linear_weight``, as inductor's CPU freezing does), and a
256-token prefill chunk 99 ms instead of 116. So a batch of 8 rows costs about what one row does,
as weight reads say it should. One row alone is about 6 % slower; every batch from two rows up is
1.3-2x faster.

Decoding rows read bf16 panels instead, where bf16 holds the weights exactly (a checkpoint shipped
in bf16, as most are) and the native kernels run (``native.panel_linear``, AVX-512): a step's
products read half the bytes, each weight widened exactly to the fp32 it is, with fp32 products
and sums. One thread, the fixture's projections for a step (``benchmarks/panels.py``): 2.27 ms
against oneDNN's 5.94 for one row, 4.81 against 7.97 for 8, 8.32 against 10.22 for 16. A prompt
chunk (more than ``PANEL_ROWS`` rows) runs oneDNN's, at the core's fp32 peak already.

Exactness: against MKL's products the logits differ by about 1e-5 (another summation order), which
moves greedy output only at near-ties, as any change of kernel does; batched rows keep matching
their solo decoding up to the same near-ties (``tests/engine/test_batching.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import native
from .dtypes import exact_bf16

# The row counts a packed product runs at: pieces of WIDE rows or multiples of it up to PIECE (a
# prompt chunk in one piece: a 256-token chunk's products took 60 ms here in one piece, 68 in four of
# 64), then the rest: every count up to EXACT (decoding steps), at least SMALLEST, then multiples of
# STRIDE. SMALLEST: oneDNN's kernels for 1-3 rows ran slower here than its 4-row one (a step's
# projections, 1 thread: 5.8, 6.3 and 5.4 ms for 1, 2 and 3 rows, 5.0 for 4), so fewer rows run
# padded to 4. No piece pads by more than STRIDE - 1 rows.
SMALLEST, EXACT, STRIDE, WIDE, PIECE = 4, 16, 16, 64, 256


def pieces(n: int) -> list[int]:
    """The pieces a product over ``n`` rows runs in, in order: multiples of ``WIDE`` while they
    fit (each at most ``PIECE``), then the rest."""
    sizes = []
    while n >= WIDE:
        sizes.append(min(PIECE, n // WIDE * WIDE))
        n -= sizes[-1]
    return sizes + [n] if n else sizes


def padded_rows(n: int) -> int:
    """The row count a piece of ``n`` rows runs at."""
    if n <= EXACT:
        return max(n, SMALLEST)
    return -(-n // STRIDE) * STRIDE


def run_counts() -> list[int]:
    """Every row count a product runs at: part of the key of timings taken here."""
    return sorted({padded_rows(size) for n in range(1, PIECE + 1) for size in pieces(n)})


def padded_total(n: int) -> int:
    """The rows a product over ``n`` rows runs at: its pieces, each padded."""
    return sum(padded_rows(size) for size in pieces(n))


PANEL_ROWS = EXACT  # a product of at most this many rows reads bf16 panels where it has them


def panels(weight: Tensor) -> Tensor | None:
    """``weight`` [out, in] as ``native.panel_linear`` reads it, bf16 panels [out / 16, in, 16], where
    bf16 holds every value exactly, the rows come in panels and the kernel runs here; else None."""
    out, width = weight.shape
    narrow = exact_bf16(weight) if out % native.PANEL == 0 and native.has_panels() else None
    if narrow is None:
        return None
    return narrow.view(out // native.PANEL, native.PANEL, width).transpose(1, 2).contiguous()


def packs(weight: Tensor) -> bool:
    """Whether projections like ``weight`` run faster packed: fp32 on a CPU with oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def reorder(weight: Tensor) -> Tensor:
    """``weight`` [out, in] in oneDNN's layout: an opaque tensor only ``linear`` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, panels: Tensor | None = None) -> Tensor:
    """``F.linear``, for a dense weight or one ``reorder`` packed: at most ``PANEL_ROWS`` rows on its
    bf16 ``panels`` where it has them, else packed, in ``pieces``, each padded to ``padded_rows`` of
    its count.

    Why: oneDNN builds and caches a kernel per (weight shape, row count), holding memory that grows
    with the row count (about 0.6 MiB each for a few rows, several MiB for hundreds; its cache keeps
    1,024). A server's steps run every row count there is, and a 10-minute soak grew by 40 MiB a
    minute. With the counts fixed, the kernels are 19 per weight shape, built once (the fixture's
    five shapes: 48 MiB more resident memory after every length from 1 to 300, none after a second
    pass)."""
    if not weight.is_mkldnn:
        return nn.functional.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # a step that wants no logits
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    if panels is not None and rows.shape[0] <= PANEL_ROWS:
        out = native.panel_linear(rows, panels)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])
    outs, start = [], 0
    for n in pieces(rows.shape[0]):
        piece = rows[start : start + n]
        start += n
        size = padded_rows(n)
        if size != n:
            piece = torch.cat([piece, piece.new_zeros(size - n, piece.shape[1])])
        outs.append(torch.ops.mkldnn._linear_pointwise(piece, weight, bias, "none", [], "")[:n])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight ``reorder`` packed, with its bf16 ``panels`` where it has
    them (so it stands wherever one does)."""

    def __init__(self, dense: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight to throw away
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.panels: Tensor | None
        self.register_buffer("panels", panels(dense.weight))
        self.register_buffer("weight", reorder(dense.weight.detach()))
        self.register_buffer("bias", None if dense.bias is None else dense.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.panels)
