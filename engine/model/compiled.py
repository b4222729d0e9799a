"""A step where one or two rows each decode one token, compiled: plain decoding of one or two streams
at the speed of their weight reads.

Why: a step that decodes one token for one row reads every weight once and does almost nothing
else, so it should take what reading the weights takes. Eager, it took 7.0 ms: oneDNN's and MKL's
one-row products stream the weights at 11-13 GB/s here, and some 400 small dispatches (norms,
RoPE, views, the cache write, the attention) cost about 2 ms more. This module writes the step as
plain tensor arithmetic (each product a multiply-and-sum over a row-major weight, which inductor
turns into one vectorised reduction that reads the weight once) and compiles it whole with
``torch.compile``. Two rows run the reductions side by side, still reading each weight once. From
three rows on, oneDNN's packed products beat the reductions, and batched steps, prompts and drafts
keep the packed eager path (``packed.py``).

The weights it reads are kept in bf16 where bf16 holds them exactly (``_stored``): a checkpoint
shipped in bf16 and served in fp32, as the fixture is, has every value in bf16 already, so the
products are the same fp32 products from half the bytes (the fixture's 84 MB of fp32 weights read
as 42 MB). On one core of this project's machine: 3.7 ms a token for one row, 4.2-4.4 for two (from
4.3-4.9 and 5.6-6.3 with fp32 copies; ``benchmarks/serving.py`` and docs/engine.md have the
end-to-end figures).

What it costs:
- memory: a row-major copy of every projection beside the packed one (the fixture: 42 MB in bf16,
  67 MB where the weights need fp32);
- start-up: each loop warms its graphs before its first request; a server's first start on one
  thread took 90 s with an empty inductor cache, 31 s once inductor's on-disk cache held them; it
  needs a C++ compiler (``g++``, or ``CXX``), and without one the loop decodes eagerly (``warm_up``
  says why);
- exactness: inductor sums in another order, so logits differ from the eager step's by about
  2e-5, and greedy output may differ from eager decoding at near-ties only, as batching's does
  (``tests/engine/test_compiled.py``).

Where the eager step's products read bf16 panels (``packed.py``: the native kernels on an AVX-512
CPU, weights that bf16 holds exactly), the eager step is the faster one, and an engine compiles
nothing unless asked (``pays``): this step took 1.21x the eager one's time for one row and 1.35x
for two, one core of this machine (``BatchEngine._compiled_ratio``, measured at a loop's start).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .dtypes import exact_bf16
from .packed import panels
from .transformer import DecoderLayer, KVCache, RMSNorm, Transformer, apply_rope

logger = logging.getLogger(__name__)

ROWS = 2  # the most rows a compiled step decodes (one graph per count)
# Rows, and positions from 1 on, that make every graph's rows and lengths symbolic; a token at
# position 0 (a one-token prompt) would compile another graph, so it runs eagerly (``runs``).
WARM_UP = (((0,), (1,)), ((1,), (2,)), ((2,), (3,)), ((0, 1), (1, 2)), ((1, 2), (2, 3)), ((2, 0), (3, 1)))


def _products(x: Tensor, weight: Tensor) -> Tensor:
    """``x`` [n, in] times a row-major ``weight`` [out, in]: n multiply-and-sums over the weight, which
    inductor fuses into one reduction that streams the weight once (a bf16 weight widened to fp32 as
    it is read: ``_stored``)."""
    return torch.stack([(weight.float() * x[i]).sum(-1) for i in range(x.shape[0])])


def _stored(weight: Tensor) -> Tensor:
    """``weight`` as the step reads it, row-major: in bf16 where bf16 holds every value exactly (a
    checkpoint shipped in bf16, as most are, loaded in fp32), else as it is. Widened as it is read,
    a bf16 value is the fp32 one, so the products are fp32's; the step reads half the bytes."""
    weight = weight.contiguous()
    narrow = exact_bf16(weight)
    return weight if narrow is None else narrow


class _Layer(NamedTuple):
    """One decoder layer's weights as the step reads them: projections row-major [out, in]."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor

    @classmethod
    def of(cls, layer: DecoderLayer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv is not None and mlp.gate_up is not None, "fuse() first"
        return cls(
            cast(RMSNorm, layer.input_layernorm).weight,
            _stored(attn.qkv),
            attn.qkv_bias,
            _stored(attn.o_proj.weight),
            layer.post_attention_layernorm.weight,
            _stored(mlp.gate_up),
            _stored(mlp.down_proj.weight),
        )


class DecodingStep:
    """A target's forward for one token in each of up to ``ROWS`` cache rows, compiled; ``__call__``
    returns their logits [n, V]."""

    def __init__(self, model: Transformer) -> None:
        """Takes row-major copies of ``model``'s projections: build it before ``Transformer.pack``."""
        c = model.config
        assert model.rope is not None, "call setup_cache() first"
        self.heads, self.kv_heads, self.head_dim, self.eps = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
        )
        self.hidden = c.hidden_size
        self.embedding = model.embed_tokens.weight
        self.cos, self.sin = model.rope
        layers = cast(Sequence[DecoderLayer], model.layers)
        if layers[0].self_attn.qkv is None:  # built, not loaded: q/k/v and gate/up as one weight each
            model.fuse()
        self.layers = [_Layer.of(layer) for layer in layers]
        self.final_norm = model.norm.weight
        self.lm_head = _stored(self.embedding if c.tie_word_embeddings else model.lm_head.weight)
        self.compiled = torch.compile(self._step, fullgraph=True, dynamic=True)

    @classmethod
    def supports(cls, model: Transformer) -> bool:
        """What this step is written for: a model in fp32 on a CPU, its projections not yet packed,
        with no biases but q/k/v's."""
        c, w = model.config, model.embed_tokens.weight
        cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
        return cpu_fp32 and model.kernels == "dense" and not (c.o_bias or c.mlp_bias)

    @staticmethod
    def pays(model: Transformer) -> bool:
        """Whether the step is faster than the eager one it stands in for: not where the eager
        step's products read bf16 panels (``packed.panels``, the module's docstring)."""
        layers = cast(Sequence[DecoderLayer], model.layers)
        return panels(layers[0].mlp.down_proj.weight) is None

    @torch.inference_mode()
    def warm_up(self, caches: Sequence[KVCache]) -> bool:
        """Compile every graph a loop over ``caches`` calls now, not in a request (writes only slots
        a prefill overwrites). False, with a warning, where it cannot compile here (most often: no
        C++ compiler for inductor): the loop then decodes eagerly."""
        try:
            for rows, positions in WARM_UP:
                if max(rows) < caches[0].k.shape[0]:
                    self(
                        torch.zeros(len(rows), dtype=torch.long, device=self.embedding.device), rows, positions, caches
                    )
        except Exception as exc:  # inductor fails in many types; the eager step is always there
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            logger.warning("decoding eagerly: cannot compile the decoding step here (%s)", reason)
            return False
        return True

    @staticmethod
    def runs(rows: int, start: int) -> bool:
        """Whether ``rows`` rows whose first token sits at ``start`` run compiled."""
        return rows <= ROWS and start >= 1

    def __call__(
        self, tokens: Tensor, rows: Sequence[int], positions: Sequence[int], caches: Sequence[KVCache]
    ) -> tuple[Tensor, Tensor]:
        """Logits [n, V] of ``tokens`` (Long[n]), token i at ``positions[i]`` of cache row ``rows[i]``,
        its KV written there; and the streams [L + 1, n, H] an EAGLE head drafts from (``features``)."""
        where = torch.tensor([list(rows), list(positions)], device=tokens.device)
        return self.compiled(tokens, list(rows), list(positions), where, [c.k for c in caches], [c.v for c in caches])

    def _step(
        self,
        tokens: Tensor,
        rows: list[int],
        positions: list[int],
        where: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
    ) -> tuple[Tensor, Tensor]:
        """``where`` holds ``rows`` and ``positions`` as a tensor: the cache write indexes with it, so
        no graph depends on which rows it writes."""
        heads, kv_heads, d, n = self.heads, self.kv_heads, self.head_dim, tokens.shape[0]
        x = F.embedding(tokens, self.embedding)
        cos, sin = self.cos[where[1]][:, None], self.sin[where[1]][:, None]
        streams = []
        for layer, k_cache, v_cache in zip(self.layers, keys, values, strict=True):
            streams.append(x)
            y = _products(F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps), layer.qkv)
            if layer.qkv_bias is not None:
                y = y + layer.qkv_bias
            y = y.view(n, -1, d)
            q, k, v = y[:, :heads], y[:, heads : heads + kv_heads], y[:, heads + kv_heads :]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[where[0], :, where[1]] = k
            v_cache[where[0], :, where[1]] = v
            attended = []
            for i in range(n):  # each row over its own cache, as far as its position
                seen_k = k_cache.select(0, rows[i]).narrow(1, 0, positions[i] + 1)
                seen_v = v_cache.select(0, rows[i]).narrow(1, 0, positions[i] + 1)
                scores = (q[i].view(kv_heads, heads // kv_heads, d) @ seen_k.transpose(-1, -2)) * d**-0.5
                attended.append((scores.softmax(-1) @ seen_v).reshape(-1))
            x = x + _products(torch.stack(attended), layer.o)
            gate, up = _products(F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps), layer.gate_up).chunk(2, -1)
            x = x + _products(F.silu(gate) * up, layer.down)
        final = F.rms_norm(x, (self.hidden,), self.final_norm, self.eps)
        return _products(final, self.lm_head), torch.stack([*streams, final])


def features(streams: Tensor, taps: tuple[int, ...]) -> Tensor:
    """What ``Transformer.forward_rows`` returns for the tap set ``taps``, from a step's streams: the
    residual streams entering those layers side by side (EAGLE-3), or for () the final post-norm
    feature (EAGLE-1/2). A step returns them all: a few kilobytes beside the weights it reads, so
    a row with an EAGLE head decodes plainly at the compiled step's speed."""
    return torch.cat([streams[i] for i in taps], dim=-1) if taps else streams[-1]
