"""Draft head models: the shared interface every head gives the drafters (`DraftHead`) and the
EAGLE head (EAGLE-1 and EAGLE-2 use the same weights); EAGLE-3 heads are in eagle3_head.py.

The EAGLE head predicts the target's next *feature* (its final post-norm hidden state) from the current
feature and the next token's embedding; tokens come from the target's own ``lm_head``. Checkpoints
use the names of the public EAGLE heads (``fc.*``, ``layers.0.*``; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B,
``pytorch_model.bin`` or ``model.safetensors``), so users can bring the heads published for their models.
The drafters that grow trees with a head are in eagle.py, apart from the models (as vLLM keeps them).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..model.dtypes import native_bf16
from ..model.packed import linear
from ..model.step import Step
from ..model.transformer import DecoderLayer, KVCache, ModelConfig, load_weights, rope_tables


def drafting_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The precision to draft in: bf16 for an fp32 target where the hardware has native bf16 matmuls.

    A head step is bound by reading its weights and the vocabulary-sized lm_head, so half the bytes
    is close to half the time; drafts need no exactness (verification by the target keeps the output
    lossless whatever the head predicts).
    """
    if dtype != torch.float32:
        return dtype
    return torch.bfloat16 if native_bf16(device) else dtype


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
    def from_dict(cls, d: dict) -> EagleHeadConfig:
        """From a Llama-style ``config.json`` dict (a head's or its target's); ``bias`` defaults to True as in EAGLE."""
        m = ModelConfig.from_hf({"num_hidden_layers": 1, **d})
        return cls.from_model_config(m, bias=bool(d.get("bias", True)))

    @classmethod
    def from_model_config(cls, m: ModelConfig, bias: bool = True) -> EagleHeadConfig:
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
        return {"architectures": ["LlamaForCausalLM"], "bias": self.bias, **one_layer_llama(self.model_config())}


def one_layer_llama(m: ModelConfig) -> dict:
    """The Llama part of a head's ``config.json`` (both EAGLE formats ship one)."""
    rope = {"rope_theta": m.rope_theta, "rope_type": "default", **(m.rope_scaling or {})}
    return {
        "model_type": "llama",
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


class DraftHead(nn.Module):
    """What every head format shares for drafting: RoPE tables, a preallocated KV cache and the
    interface the tree drafters call (``step``, ``draft_logprobs``, ``to_target``, ``taps``).

    Drafting state is non-persistent, so never part of a checkpoint, but counted with the head's
    memory and moved by ``.to()``. The target itself is only weakly referenced.
    """

    taps: tuple[int, ...] = ()  # target layers whose inputs feed the head; () = the final post-norm feature
    fc: nn.Linear  # the input projection every format has
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self._mc = mc
        cos, sin = rope_tables(mc, mc.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.cache: KVCache | None = None
        self._drafting_for: weakref.ref | None = None

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens ``draft_logprobs`` scores (its last dim)."""
        raise NotImplementedError

    def save_pretrained(self, path) -> None:
        """Write the head in its published format."""
        raise NotImplementedError

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Target token ids of draft-vocabulary ids (identity when the head drafts the full vocabulary)."""
        return draft_ids

    def check_target(self, target_config: ModelConfig) -> None:
        """Raise ValueError naming the first tensor whose shape does not fit ``target_config``."""
        raise NotImplementedError

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Drafting positions never exceed the cache slots, which ``setup_drafting`` sized the tables
        for; training passes call ``_fit_rope`` first."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if positions.dim() == 2:  # [B, T] -> broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def _fit_rope(self, positions: Tensor) -> None:
        if int(positions.max()) >= self.rope_cos.shape[0]:
            self._grow_rope(int(positions.max()) + 1)

    def _grow_rope(self, length: int) -> None:
        cos, sin = rope_tables(
            self._mc, max(length, 2 * self.rope_cos.shape[0]), self.rope_cos.device, self.rope_cos.dtype
        )
        self.rope_cos, self.rope_sin = cos, sin

    def setup_drafting(self, target, max_len: int) -> None:
        """Preallocate the head's KV cache for ``target``; a no-op when already set up for it with
        room for ``max_len``."""
        ready = self._drafting_for is not None and self._drafting_for() is target
        if ready and self.cache is not None and self.cache.k.shape[2] >= max_len:
            return
        self.cache = self.drafting_cache(max_len)
        if max_len > self.rope_cos.shape[0]:
            self._grow_rope(max_len)
        self._borrow(target)
        self._drafting_for = weakref.ref(target)

    def drafting_cache(self, max_len: int) -> KVCache:
        """A KV cache of one sequence for ``step``: the head's own, or a batch row's drafter's."""
        w = self.fc.weight
        return KVCache(1, self._mc.num_key_value_heads, max_len, self._mc.head_dim, w.dtype, w.device)

    def _borrow(self, target) -> None:
        """Take what the head uses of the target at drafting time (EAGLE-1: its lm_head)."""

    @staticmethod
    def _causal(at: Step, q_len: int) -> Step:
        """A mask None = causal over the cache: written out when several queries sit behind a cached prefix."""
        return dataclasses.replace(at, mask=at.causal_mask()) if at.mask is None and q_len > 1 else at

    def step(
        self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module, at: Step, cache: KVCache | None = None
    ) -> Tensor:
        """Cached pass over ``q`` pairs (batch 1) ``at`` a step, in ``cache`` (None: the head's own).
        ``features`` are the target's (as ``taps`` asks) for committed pairs, the head's own
        predictions inside a tree. Returns predicted features [1, q, H]."""
        raise NotImplementedError

    def draft_logprobs(self, predicted: Tensor) -> Tensor:
        """Log-probs [q, draft_vocab_size] of the next token from predicted features [q, H]."""
        raise NotImplementedError


class EagleHead(DraftHead):
    """``fc`` over ``[embed(token_{t+1}); feature_t]`` then one decoder layer without input norm."""

    rope_cos: Tensor  # buffers (register_buffer), declared for the type checker
    rope_sin: Tensor
    lm_head_copy: Tensor | None

    def __init__(self, config: EagleHeadConfig):
        super().__init__(config.model_config())
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(self._mc, input_norm=False)])
        self.register_buffer("lm_head_copy", None, persistent=False)  # the target's lm_head in our dtype
        self._borrowed_lm_head: Tensor | None = None  # the target's own weight when no copy is needed

    @classmethod
    def for_target(cls, target_config: ModelConfig | dict, bias: bool = True) -> EagleHead:
        """A freshly initialised head shaped for a target (its ModelConfig or config.json dict)."""
        if isinstance(target_config, dict):
            config = dataclasses.replace(EagleHeadConfig.from_dict(target_config), bias=bias)
        else:
            config = EagleHeadConfig.from_model_config(target_config, bias=bias)
        return cls(config)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> EagleHead:
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
        config = {**self.config.to_dict(), "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch.")}
        save_head(self, config, path)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    def check_target(self, target_config: ModelConfig) -> None:
        h, v = target_config.hidden_size, target_config.vocab_size
        expect_shape(self.fc.weight, "fc.weight", (h, 2 * h), "[hidden, 2 x hidden] of the target")
        if self.config.vocab_size != v:
            raise ValueError(f"EAGLE head: vocab_size {self.config.vocab_size} but the target's lm_head has {v} rows")

    def forward(
        self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module, position_ids: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced causal pass: ``features`` [B, T, H] = f_0..f_{T-1} (target, post-norm),
        ``input_ids`` [B, T] = t_1..t_T (one ahead); returns the predicted f_1..f_T [B, T, H].

        Pair j sits at RoPE position j unless ``position_ids`` ([T] or [B, T]) says otherwise.
        """
        if position_ids is None:
            position_ids = torch.arange(features.shape[1], device=features.device)
        self._fit_rope(position_ids)
        return self.layers[0](self._fuse(features, input_ids, embed_tokens), self._rope(position_ids))

    def _fuse(self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module) -> Tensor:
        return self.fc(torch.cat([embed_tokens(input_ids), features], dim=-1).to(self.fc.weight.dtype))

    # --- cached drafting path -------------------------------------------------------------------

    def _borrow(self, target) -> None:
        """The target's ``lm_head`` in the head's dtype (drafting may run in a cheaper precision than
        the target: losslessness does not depend on the drafts)."""
        lm = target.lm_head.weight.detach()
        w = self.fc.weight
        if lm.dtype != w.dtype and lm.is_mkldnn:  # packed (model/packed.py): back to rows first
            lm = lm.to_dense()
        self.lm_head_copy = lm.to(w.dtype).contiguous() if lm.dtype != w.dtype else None
        self._borrowed_lm_head = lm if self.lm_head_copy is None else None

    def step(
        self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module, at: Step, cache: KVCache | None = None
    ) -> Tensor:
        at = self._causal(at, input_ids.shape[1])
        x = self._fuse(features, input_ids, embed_tokens)
        return self.layers[0](x, self._rope(at.positions), self.cache if cache is None else cache, at)

    def draft_logprobs(self, predicted: Tensor) -> Tensor:
        """Through the target's lm_head: the draft vocabulary is the target's."""
        weight = self.lm_head_copy if self.lm_head_copy is not None else self._borrowed_lm_head
        if weight is None:
            raise RuntimeError("call setup_drafting() before drafting")
        return torch.log_softmax(linear(predicted, weight).float(), dim=-1)


def expect_shape(tensor: Tensor, name: str, shape: tuple[int, ...], meaning: str) -> None:
    """Reject a head tensor that does not fit the target, naming it."""
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"draft head does not fit the target: {name} is {list(tensor.shape)}, expected {list(shape)} ({meaning})"
        )


def save_head(head: nn.Module, config: dict, path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (persistent state only)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
