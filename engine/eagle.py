"""EAGLE draft head in the published checkpoint format, and the EAGLE / EAGLE-2 tree drafters.

The head predicts the target's next *feature* (its final post-norm hidden state) from the current
feature and the next token's embedding; tokens come from the target's own ``lm_head``. Checkpoints
use the names of the public EAGLE heads (``fc.*``, ``layers.0.*``), so users can bring their own.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .model import DecoderLayer, KVCache, ModelConfig, load_weights, rope_tables


@dataclass(frozen=True)
class EagleHeadConfig:
    """The shape of a head: a one-layer Llama config plus ``bias`` for ``fc``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bias: bool = True
    head_dim: int | None = None
    rope_scaling: dict | None = None
    qkv_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "EagleHeadConfig":
        """From a Llama-style ``config.json`` dict (a head's or its target's); ``bias`` defaults to True as in EAGLE."""
        m = ModelConfig.from_hf({"num_hidden_layers": 1, **d})
        return cls.from_model_config(m, bias=bool(d.get("bias", True)))

    @classmethod
    def from_model_config(cls, m: ModelConfig, bias: bool = True) -> "EagleHeadConfig":
        return cls(
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads,
            vocab_size=m.vocab_size,
            rms_norm_eps=m.rms_norm_eps,
            rope_theta=m.rope_theta,
            max_position_embeddings=m.max_position_embeddings,
            bias=bias,
            head_dim=m.head_dim,
            rope_scaling=m.rope_scaling,
            qkv_bias=m.qkv_bias,
        )

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            qkv_bias=self.qkv_bias,
        )

    def to_dict(self) -> dict:
        """A Llama ``config.json`` with one layer, as the published heads ship it."""
        m = self.model_config()
        rope = {"rope_theta": m.rope_theta, "rope_type": "default", **(m.rope_scaling or {})}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "bias": self.bias,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta,
            "rope_parameters": rope,
            "attention_bias": m.qkv_bias,
            "max_position_embeddings": m.max_position_embeddings,
            "vocab_size": m.vocab_size,
        }


class EagleHead(nn.Module):
    """``fc`` over ``[embed(token_{t+1}); feature_t]`` then one decoder layer without input norm."""

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.config = config
        self._mc = config.model_config()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(self._mc, input_norm=False)])
        cos, sin = rope_tables(self._mc, self._mc.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.caches: list[KVCache] = []  # a plain list: the cache is not part of the checkpoint

    @classmethod
    def for_target(cls, target_config: ModelConfig | dict, bias: bool = True) -> "EagleHead":
        """A freshly initialised head shaped for a target (its ModelConfig or config.json dict)."""
        if isinstance(target_config, dict):
            config = dataclasses.replace(EagleHeadConfig.from_dict(target_config), bias=bias)
        else:
            config = EagleHeadConfig.from_model_config(target_config, bias=bias)
        return cls(config)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> "EagleHead":
        """Load ``config.json`` + ``pytorch_model.bin`` or ``model.safetensors``; ``embed_tokens`` is ignored.

        Whether ``fc`` has a bias is read from the weights, so heads whose config omits it still load.
        """
        path = Path(path)
        state = load_weights(path)
        state.pop("embed_tokens.weight", None)
        config = dataclasses.replace(
            EagleHeadConfig.from_dict(json.loads((path / "config.json").read_text())),
            bias="fc.bias" in state,
        )
        head = cls(config)
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{path}: not an EAGLE head in the published format ({exc})") from None
        return head.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the published format (no embedding copy)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {**self.config.to_dict(), "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if int(positions.max()) >= self.rope_cos.shape[0]:
            self._grow_rope(int(positions.max()) + 1)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if positions.dim() == 2:  # [B, T] -> broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def _grow_rope(self, length: int) -> None:
        cos, sin = rope_tables(self._mc, max(length, 2 * self.rope_cos.shape[0]),
                               self.rope_cos.device, self.rope_cos.dtype)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module,
                position_ids: Tensor | None = None) -> Tensor:
        """Teacher-forced causal pass: ``features`` [B, T, H] = f_0..f_{T-1} (target, post-norm),
        ``input_ids`` [B, T] = t_1..t_T (one ahead); returns the predicted f_1..f_T [B, T, H].

        Pair j sits at RoPE position j unless ``position_ids`` ([T] or [B, T]) says otherwise.
        """
        if position_ids is None:
            position_ids = torch.arange(features.shape[1], device=features.device)
        x = self.fc(torch.cat([embed_tokens(input_ids).to(features.dtype), features], dim=-1))
        return self.layers[0](x, self._rope(position_ids))

    # --- cached drafting path -------------------------------------------------------------------

    def setup_cache(self, max_len: int) -> None:
        """Preallocate the head's KV cache once; drafters only index into it."""
        w = self.fc.weight
        self.caches = [KVCache(1, self._mc.num_key_value_heads, max_len, self._mc.head_dim, w.dtype, w.device)]
        if max_len > self.rope_cos.shape[0]:
            self._grow_rope(max_len)

    def step(self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module, positions: Tensor,
             cache_slots: Tensor, attn_mask: Tensor | None, kv_len: int) -> Tensor:
        """Cached pass over ``q`` pairs (batch 1): writes their KV at ``cache_slots`` and attends to
        ``attn_mask`` Bool [q, kv_len] (None = causal over the cache). Returns predicted features [1, q, H]."""
        if attn_mask is None and input_ids.shape[1] > 1:
            attn_mask = torch.arange(kv_len, device=cache_slots.device) <= cache_slots[:, None]
        x = self.fc(torch.cat([embed_tokens(input_ids), features], dim=-1))
        return self.layers[0](x, self._rope(positions), attn_mask, self.caches[0], cache_slots, kv_len)
