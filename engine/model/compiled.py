"""One row's one-token step, compiled: plain decoding of a single stream at the speed of its weight reads.

Why: a step that decodes one token for one row reads every weight once and does almost nothing
else, so it should take what reading the weights takes (the fixture's 84 MB: about 3.3 ms on one
core of this project's machine, 25 GB/s). Eager, it took 7.0 ms: oneDNN's and MKL's one-row
products stream the weights at 11-13 GB/s here, and some 400 small dispatches (norms, RoPE, views,
the cache write, the attention) cost about 2 ms more. This module writes the step as plain tensor
arithmetic (each product a multiply-and-sum over a row-major weight, which inductor turns into one
vectorised reduction that reads the weight once) and compiles it whole with ``torch.compile``:
3.9 ms on one thread, 2.4-2.7 ms on two (``benchmarks/serving.py`` and docs/engine.md have the
end-to-end figures). Batched steps, prompts and drafts keep the packed eager path
(``packed.py``): their products read each weight once for many rows already.

What it costs:
- memory: a row-major copy of every projection beside the packed one (the fixture: 67 MB);
- start-up: about 30 s of compiling at the first start on a 2-core machine, about 6 s once
  inductor's on-disk cache holds it; it needs a C++ compiler (``g++``, or ``CXX``), and without one
  the engine decodes eagerly (``warm_up`` says why);
- exactness: inductor sums in another order, so logits differ from the eager step's by about
  2e-5, and greedy output may differ from eager decoding at near-ties only, as batching's does
  (``tests/engine/test_compiled.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .transformer import DecoderLayer, KVCache, RMSNorm, Transformer, apply_rope

logger = logging.getLogger(__name__)

# Two lengths make the attended length symbolic; row 0 and the others compile apart (the cache write's
# overlap check), and position 0 would compile a third graph: a step there runs eagerly (``runs``).
WARM_UP_POSITIONS = (1, 2)


def _product(x: Tensor, weight: Tensor) -> Tensor:
    """``x`` [in] times a row-major ``weight`` [out, in]: one reduction that streams the weight."""
    return (weight * x).sum(-1)


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
            attn.qkv.contiguous(),
            attn.qkv_bias,
            attn.o_proj.weight.contiguous(),
            layer.post_attention_layernorm.weight,
            mlp.gate_up.contiguous(),
            mlp.down_proj.weight.contiguous(),
        )


class OneTokenStep:
    """A target's forward for one token of one cache row, compiled; ``__call__`` returns its logits [1, V]."""

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
        self.lm_head = self.embedding if c.tie_word_embeddings else model.lm_head.weight.contiguous()
        self.compiled = torch.compile(self._step, fullgraph=True, dynamic=True)

    @classmethod
    def supports(cls, model: Transformer) -> bool:
        """What this step is written for: a model in fp32 on a CPU, its projections not yet packed,
        with no biases but q/k/v's."""
        c, w = model.config, model.embed_tokens.weight
        cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
        return cpu_fp32 and model.kernels == "dense" and not (c.o_bias or c.mlp_bias)

    @torch.inference_mode()
    def warm_up(self, caches: Sequence[KVCache]) -> bool:
        """Compile every graph a loop over ``caches`` calls now, not in a request (writes only slots
        a prefill overwrites). False, with a warning, where it cannot compile here (most often: no
        C++ compiler for inductor): the loop then decodes eagerly."""
        token = torch.zeros(1, dtype=torch.long, device=self.embedding.device)
        try:
            for row in sorted({0, caches[0].k.shape[0] - 1}):
                for position in WARM_UP_POSITIONS:
                    self(token, row, position, caches)
        except Exception as exc:  # inductor fails in many types; the eager step is always there
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            logger.warning("decoding eagerly: cannot compile the one-token step here (%s)", reason)
            return False
        return True

    @staticmethod
    def runs(position: int) -> bool:
        """Whether a token at ``position`` runs compiled (the first of a sequence runs eagerly)."""
        return position >= WARM_UP_POSITIONS[0]

    def __call__(self, token: Tensor, row: int, position: int, caches: Sequence[KVCache]) -> Tensor:
        """Logits [1, V] of ``token`` (Long[1]) at ``position`` of cache ``row``, its KV written there."""
        return self.compiled(token, row, position, [c.k for c in caches], [c.v for c in caches])[None]

    def _step(self, token: Tensor, row: int, position: int, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(token, self.embedding)[0]
        cos, sin = self.cos.narrow(0, position, 1)[0], self.sin.narrow(0, position, 1)[0]
        for layer, k_cache, v_cache in zip(self.layers, keys, values, strict=True):
            y = _product(F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps), layer.qkv)
            if layer.qkv_bias is not None:
                y = y + layer.qkv_bias
            y = y.view(-1, d)
            q, k, v = y[:heads], y[heads : heads + kv_heads], y[heads + kv_heads :]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_row, v_row = k_cache.select(0, row), v_cache.select(0, row)
            k_row.narrow(1, position, 1).copy_(k[:, None])
            v_row.narrow(1, position, 1).copy_(v[:, None])
            keys_seen, values_seen = k_row.narrow(1, 0, position + 1), v_row.narrow(1, 0, position + 1)
            scores = (q.view(kv_heads, heads // kv_heads, d) @ keys_seen.transpose(-1, -2)) * d**-0.5
            x = x + _product((scores.softmax(-1) @ values_seen).reshape(-1), layer.o)
            gate, up = _product(F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps), layer.gate_up).chunk(2)
            x = x + _product(F.silu(gate) * up, layer.down)
        return _product(F.rms_norm(x, (self.hidden,), self.final_norm, self.eps), self.lm_head)
