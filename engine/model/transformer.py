"""A plain-PyTorch Llama-family decoder (Llama, Mistral, Qwen2) with a static KV cache.

Why not transformers' own model: speculative decoding verifies a *tree* of tokens at explicit
positions against a preallocated cache and then compacts the accepted path in place. A small
gpt-fast style model makes that a couple of tensor ops and keeps per-step Python overhead low.
Module names follow the Hugging Face checkpoints (after stripping ``model.``), so weights load
with no renaming, and EAGLE heads (``layers.0.*``) reuse ``DecoderLayer`` directly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..bundled import weight_files
from . import native
from .packed import PackedLinear, linear, packs, panels, reorder
from .rows import Outputs, Rows
from .step import Step

Rope = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: expected llama, mistral or qwen2")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r}: expected default, linear or llama3")
        heads = d["num_attention_heads"]
        qkv_bias = model_type == "qwen2" or bool(d.get("attention_bias", False))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            qkv_bias=qkv_bias,
            o_bias=model_type != "qwen2" and bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )


def rope_tables(config: ModelConfig, max_len: int, device="cpu", dtype=torch.float32) -> Rope:
    """cos/sin tables ``[max_len, head_dim]`` computed once; a step only indexes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1 frequency-dependent scaling (long wavelengths slowed by ``factor``)."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    return torch.where((wavelen >= old_len / high) & (wavelen <= old_len / low), mid, out)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class KVCache(nn.Module):
    """Preallocated keys/values ``[B, n_kv_heads, max_len, head_dim]``; the caller tracks the length."""

    k: Tensor  # buffers (register_buffer), declared for the type checker
    v: Tensor

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)

    def copy_slots(self, src: int, dst: int, start: int, end: int) -> None:
        """Row ``src``'s slots ``start..end`` into row ``dst`` (a prompt prefix another request ran)."""
        self.k[dst, :, start:end] = self.k[src, :, start:end]
        self.v[dst, :, start:end] = self.v[src, :, start:end]

    def move(self, row: int, src_slots: Tensor, dst_start: int) -> None:
        """Copy sequence ``row``'s ``src_slots`` to ``dst_start..`` (a verified tree's accepted path
        to the slots right after its prefix); the gather copies first, so overlap is safe."""
        dst = slice(dst_start, dst_start + src_slots.numel())
        self.k[row, :, dst] = self.k[row].index_select(1, src_slots)
        self.v[row, :, dst] = self.v[row].index_select(1, src_slots)


class Attention(nn.Module):
    """``in_features`` defaults to the hidden size; EAGLE-3's layer attends over 2H-wide inputs."""

    def __init__(self, c: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        d_in = in_features or c.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.qkv: Tensor | None  # buffers set by fuse(): q, k and v as one weight
        self.qkv_bias: Tensor | None
        self.qkv_panels: Tensor | None  # set by Transformer.pack, where it has them (packed.panels)
        self.register_buffer("qkv", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_panels", None, persistent=False)

    def fuse(self) -> None:
        """For a frozen model: one product for q, k and v instead of three. The three weights become
        views of the fused one (no extra memory; loading into them updates it)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv, self.qkv_bias = _fused(projections, "weight"), _fused(projections, "bias")

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of ``x`` [b, n, d_in] head-major: [b, heads, n, head_dim], before RoPE."""
        b, n, _ = x.shape
        if self.qkv is None:  # trainable: three products
            y = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:
            y = linear(x, self.qkv, self.qkv_bias, self.qkv_panels)
        y = y.view(b, n, -1, self.head_dim).transpose(1, 2)
        return y[:, : self.n_heads], y[:, self.n_heads : self.n_heads + self.n_kv], y[:, self.n_heads + self.n_kv :]

    def forward(
        self,
        x: Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        step: Step | Rows | None = None,
        outputs: Outputs | None = None,
    ) -> Tensor:
        """Uncached (``cache`` None) the ``q`` queries are causal among themselves; cached, they
        attend as ``step`` says (a mask None there with ``q`` > 1 means a fresh, causal sequence;
        ``Rows``: the tokens of many sequences, each in its own cache row; on the native kernels,
        ``rope`` is the whole tables, read at the step's positions). ``outputs`` (with ``Rows``): every
        token's keys and values written, the output of those tokens alone."""
        b, q_len, _ = x.shape
        if isinstance(step, Rows):
            assert cache is not None, "a batched pass writes to the batch's cache"
            q = self._write_rows(x, rope, cache, step)
            if outputs is not None:
                q, step = q[outputs.tokens], outputs.rows
            if step is None:  # no output wanted: the keys and values written, nothing to attend
                return x[:, :0]
            return self.o_proj(step.attend(q, cache.k, cache.v).reshape(1, q.shape[0], -1))
        q, k, v = self.project(x)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attn_mask = None
        if cache is not None:
            assert step is not None, "a cached pass needs the step's slots to write"
            cache.write(step.slots, k, v)
            k, v = cache.k[:, :, : step.kv_len], cache.v[:, :, : step.kv_len]
            attn_mask = step.mask
        # No mask: one query sees every cached key; several queries over a fresh sequence are causal.
        causal = attn_mask is None and q_len > 1
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, q_len, -1))

    def _write_rows(self, x: Tensor, rope: Rope, cache: KVCache, rows: Rows) -> Tensor:
        """A batched step's keys and values, RoPE'd, written to their rows and slots; returns its
        queries [T, heads, d], RoPE'd (in one native pass where ``rows`` runs on the kernels)."""
        if rows.native:
            assert self.qkv is not None, "a native step runs a frozen model"
            qkv = linear(x, self.qkv, self.qkv_bias, self.qkv_panels)
            return native.rope_write(qkv, rope, rows.positions, cache.k, cache.v, rows.rows, rows.slots, self.n_heads)
        q, k, v = self.project(x)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        rows.write(k[0].transpose(0, 1), v[0].transpose(0, 1), cache.k, cache.v)
        return q[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.gate_up: Tensor | None  # buffers set by fuse() and Transformer.pack, as Attention's
        self.gate_up_bias: Tensor | None
        self.gate_up_panels: Tensor | None
        self.register_buffer("gate_up", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.register_buffer("gate_up_panels", None, persistent=False)

    def fuse(self) -> None:
        projections = (self.gate_proj, self.up_proj)
        self.gate_up, self.gate_up_bias = _fused(projections, "weight"), _fused(projections, "bias")

    def forward(self, x: Tensor, fused: bool = False) -> Tensor:
        """``fused``: a batched step on the native kernels (``native.py``)."""
        if fused and self.gate_up is not None:
            return self.down_proj(native.silu_mul(linear(x, self.gate_up, self.gate_up_bias, self.gate_up_panels)))
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = linear(x, self.gate_up, self.gate_up_bias, self.gate_up_panels).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _fused(projections: Sequence[nn.Linear], name: str) -> Tensor | None:
    """The projections' ``name`` ("weight" or "bias") stacked along the outputs, in the layout of the
    first (row- or column-major: ``Transformer._column_major_projections``); each becomes a view of
    it. None where they have no bias."""
    parts = [getattr(p, name) for p in projections]
    if parts[0] is None:
        return None
    if parts[0].dim() == 2 and parts[0].stride(0) == 1:  # column-major: keep it so
        fused = torch.cat([w.t() for w in parts], dim=1).contiguous().t()
    else:
        fused = torch.cat(parts).contiguous()
    start = 0
    for p, part in zip(projections, parts, strict=True):
        setattr(p, name, nn.Parameter(fused[start : start + part.shape[0]], requires_grad=False))
        start += part.shape[0]
    return fused


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. ``input_norm=False`` gives EAGLE's layer 0, which has no input norm."""

    def __init__(self, c: ModelConfig, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self,
        x: Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        step: Step | Rows | None = None,
        outputs: Outputs | None = None,
    ) -> Tensor:
        """``outputs``: the output of those tokens of a batched step alone (``Outputs``)."""
        fused = isinstance(step, Rows) and step.native  # a batched step on the native kernels
        h = self.self_attn(_norm(self.input_layernorm, x, fused), rope, cache, step, outputs)
        if outputs is not None:
            x = x[:, outputs.tokens]
            if outputs.rows is None:  # no output wanted: the keys and values written, nothing more
                return x
        x = x + h
        return x + self.mlp(_norm(self.post_attention_layernorm, x, fused), fused)


def _norm(norm: nn.Module, x: Tensor, fused: bool) -> Tensor:
    """``norm(x)``, in one native pass for a batched step on the native kernels."""
    if fused and isinstance(norm, RMSNorm):
        return native.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.caches: list[KVCache] = []
        self.rope: Rope | None = None
        self.max_seq_len = 0

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> Transformer:
        """Load a local Hugging Face folder; never touches a hub."""
        path = Path(path)
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(config)
        state = {k.removeprefix("model."): v for k, v in load_weights(path).items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        if model.embed_tokens.weight.device.type == "cpu" and dtype == torch.float32:
            model._column_major_projections()
        model.fuse()
        return model

    def _column_major_projections(self) -> None:
        """Store each projection weight [out, in] as the transpose of a contiguous [in, out] matrix.

        With fp32 on CPU the few-row products of decoding and verifying then run as plain GEMMs
        instead of the transposed-B path: measured about 1.5x faster for one token, 1.2-1.4x for
        two, equal from 8 (2-core machine, fixture; bf16 gains nothing). Values are unchanged. A
        tied ``lm_head`` gets its own copy (V x H more memory): the embedding lookup needs rows.
        """
        for module in [*self.layers.modules(), self.lm_head]:
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=False)

    def fuse(self) -> None:
        """Frozen: q/k/v and gate/up as one product each (``Attention.fuse``)."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.fuse()

    def pack(self) -> bool:
        """Frozen and fused, fp32 on a CPU: every projection in oneDNN's layout (``packed.py``: 1.3-2x
        faster batched steps), and, where bf16 holds it exactly, as bf16 panels for decoding rows.
        The dense projection weights are freed; the embedding stays. Whether it packed (nothing to
        do elsewhere, or twice)."""
        if not packs(self.lm_head.weight) or isinstance(self.lm_head, PackedLinear):
            return False
        layers = cast(Sequence[DecoderLayer], self.layers)
        if layers[0].self_attn.qkv is None:  # built, not loaded: fuse first
            self.fuse()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.qkv is not None and mlp.gate_up is not None
            attn.qkv_panels, mlp.gate_up_panels = panels(attn.qkv), panels(mlp.gate_up)
            attn.qkv, mlp.gate_up = reorder(attn.qkv), reorder(mlp.gate_up)
            attn.o_proj, mlp.down_proj = PackedLinear(attn.o_proj), PackedLinear(mlp.down_proj)
            del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj  # views of the dense fused weights
        self.lm_head = PackedLinear(self.lm_head)
        return True

    @property
    def kernels(self) -> str:
        """What its projections run on, for keys of timings measured on it: "dense"; "onednn" packed;
        "onednn+panels" packed, with bf16 panels for decoding rows."""
        if not isinstance(self.lm_head, PackedLinear):
            return "dense"
        return "onednn+panels" if self.lm_head.panels is not None else "onednn"

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        w = self.embed_tokens.weight
        c = self.config
        self.caches = [
            KVCache(batch_size, c.num_key_value_heads, max_seq_len, c.head_dim, w.dtype, w.device) for _ in self.layers
        ]
        self.rope = rope_tables(c, max_seq_len, w.device, w.dtype)
        self.max_seq_len = max_seq_len

    def forward(
        self,
        input_ids: Tensor,
        at: Tensor | Step,
        last_logits_only: bool = False,
        taps: tuple[int, ...] = (),
    ) -> tuple[Tensor, Tensor]:
        """Run ``q`` tokens ``at`` a step, or at positions (contiguous tokens cached at the slots of
        their positions, causal: ``Step.at``). A tree's step brings its mask; a chain needs none.

        Returns ``(logits [1, q, V], hidden)``: hidden is the final post-norm feature [1, q, H], or with
        ``taps`` the residual streams entering those layers side by side [1, q, len(taps) * H]
        (vLLM's numbering: tap i is the input of layer i, Hugging Face's ``hidden_states[i]``).
        """
        if not self.caches or self.rope is None:
            raise RuntimeError("call setup_cache() before forward()")
        step = at if isinstance(at, Step) else Step.at(at)
        q_len = input_ids.shape[1]
        if step.mask is None and q_len > 1 and q_len != step.kv_len:
            step = replace(step, mask=step.causal_mask())  # causal over a cached prefix
        rope = (self.rope[0][step.positions], self.rope[1][step.positions])
        x = self.embed_tokens(input_ids)
        tapped: dict[int, Tensor] = {}
        for i, (layer, cache) in enumerate(zip(self.layers, self.caches, strict=True)):
            if i in taps:
                tapped[i] = x
            x = layer(x, rope, cache, step)
        hidden = self.norm(x)
        logits = self.lm_head(hidden[:, -1:] if last_logits_only else hidden)
        if taps:  # in the order asked for; a tap may repeat (vLLM's default for 6 layers is 2, 3, 3)
            return logits, torch.cat([tapped[i] for i in taps], dim=-1)
        return logits, hidden

    def batch_caches(self, rows: int, max_seq_len: int) -> list[KVCache]:
        """A static cache of ``rows`` sequences for ``forward_rows`` (the model's own stays as it is)."""
        w, c = self.embed_tokens.weight, self.config
        if self.rope is None or self.max_seq_len < max_seq_len:
            raise RuntimeError(f"call setup_cache({max_seq_len}) or longer before batch_caches()")
        return [KVCache(rows, c.num_key_value_heads, max_seq_len, c.head_dim, w.dtype, w.device) for _ in self.layers]

    def forward_rows(
        self,
        input_ids: Tensor,
        rows: Rows,
        caches: Sequence[KVCache],
        logits_at: Tensor,
        features: Sequence[tuple[int, ...]] = (),
        outputs: Outputs | None = None,
    ) -> tuple[Tensor, dict[tuple[int, ...], Tensor]]:
        """Run the T tokens ``input_ids`` [T] of many sequences in one pass (``rows.py``); returns the
        logits [n, V] of the tokens at ``logits_at`` only (a prompt chunk needs none but its last),
        and every token's features [T, F] for each tap set in ``features`` (as ``forward``'s hidden:
        () the final post-norm feature, else the inputs of those layers side by side), which an
        EAGLE head drafts from. ``outputs``: the tokens at ``logits_at`` alone (``Outputs``): without
        ``features``, the last layer runs only those."""
        assert self.rope is not None, "call setup_cache() before forward_rows()"
        rope = self.rope if rows.native else (self.rope[0][rows.positions], self.rope[1][rows.positions])
        x = self.embed_tokens(input_ids[None])
        wanted = {i for taps in features for i in taps}
        tapped: dict[int, Tensor] = {}
        last = len(self.layers) - 1
        only = outputs if not features else None
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            if i in wanted:
                tapped[i] = x[0]
            x = layer(x, rope, cache, rows, only if i == last else None)
        if only is not None:  # x: the wanted tokens alone, in order
            return self.lm_head(self.norm(x[0])), {}
        out = {taps: torch.cat([tapped[i] for i in taps], dim=-1) if taps else self.norm(x[0]) for taps in features}
        final = out[()][logits_at] if () in out else self.norm(x[0, logits_at])
        return self.lm_head(final), out


def load_weights(path) -> dict[str, Tensor]:
    """All tensors of a local checkpoint (see `weight_files`)."""
    from safetensors.torch import load_file

    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(
            load_file(f) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu", weights_only=True)
        )
    return state
