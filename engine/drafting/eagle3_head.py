"""EAGLE-3 draft head in the published layout (vLLM's and SGLang's ``LlamaForCausalLMEagle3``).

Where an EAGLE-1 head predicts the target's final feature and borrows its lm_head, an EAGLE-3 head
reads several target layers at once and predicts tokens itself:

- ``fc`` [H, 3H] fuses the residual streams entering three target layers (low, mid, high: ``taps``);
- ``midlayer`` is one Llama decoder layer whose attention takes ``[input_layernorm(embed(token));
  hidden_norm(hidden)]``, 2H wide, and whose residual is the (un-normed) hidden;
- ``norm`` + ``lm_head`` score a *draft vocabulary* (the most frequent tokens), mapped back to the
  target's ids through the buffer ``d2t`` (target id = draft id + d2t[draft id]); ``t2d`` marks the
  target ids that are in it.

A committed pair feeds ``fc(target features)``; deeper in a draft tree the head feeds its own output
(H wide, no ``fc``), which is what training-time test (``unroll``) teaches it to do. The tree drafters
of ``eagle.py`` run it unchanged (``DraftHead`` interface), so drafting and losslessness are EAGLE-2's.

Which target layers feed the head: ``eagle_aux_hidden_state_layer_ids`` (top level or in
``eagle_config``) in vLLM's numbering, where id i is the input of layer i (Hugging Face's
``hidden_states[i]``); without it, vLLM's default ``(2, L // 2, L - 3)`` for an L-layer target.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..model.step import Step
from ..model.transformer import MLP, Attention, KVCache, ModelConfig, RMSNorm, apply_rope, load_weights
from .eagle_head import DraftHead, EagleHead, expect_shape, one_layer_llama, save_head

ARCHITECTURE = "LlamaForCausalLMEagle3"
TAPS_KEY = "eagle_aux_hidden_state_layer_ids"


def is_eagle3_config(config: dict) -> bool:
    """An EAGLE-3 head announces itself by its architecture name (``LlamaForCausalLMEagle3`` and kin)."""
    return any("eagle3" in str(a).lower() for a in config.get("architectures") or ())


def load_draft_head(path, target_config: ModelConfig, device="cpu", dtype=torch.float32) -> DraftHead:
    """An EAGLE-1/2 or EAGLE-3 head, told apart by its ``config.json``, checked against the target:
    a head that does not fit is rejected here, with the offending tensor named."""
    config = json.loads((Path(path) / "config.json").read_text())
    if is_eagle3_config(config):
        head: DraftHead = Eagle3Head.from_pretrained(path, device, dtype, target_layers=target_config.num_hidden_layers)
    else:
        head = EagleHead.from_pretrained(path, device, dtype)
    try:
        head.check_target(target_config)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return head


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's low/mid/high default when a head does not name its layers."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    """A one-layer Llama config (``layer``; its vocab_size is the target's) plus the EAGLE-3 keys."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None: the head's own hidden size
    taps: tuple[int, ...] | None = None  # None: default_taps of the target
    norm_before_residual: bool = False  # speculators' variant: the residual is the normed hidden
    fc_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        layer = ModelConfig.from_hf({**d, "num_hidden_layers": 1})
        taps = d.get(TAPS_KEY) or (d.get("eagle_config") or {}).get(TAPS_KEY)
        return cls(
            layer=layer,
            draft_vocab_size=d.get("draft_vocab_size") or layer.vocab_size,
            target_hidden_size=d.get("target_hidden_size"),
            taps=tuple(int(i) for i in taps) if taps else None,
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            fc_bias=bool(d.get("bias", False)),
        )

    def to_dict(self) -> dict:
        """The published ``config.json``."""
        d = {
            "architectures": [ARCHITECTURE],
            **one_layer_llama(self.layer),
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "bias": self.fc_bias,
        }
        if self.target_hidden_size is not None:
            d["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.taps is not None:
            d["eagle_config"] = {"use_aux_hidden_state": True, TAPS_KEY: list(self.taps)}
        return d


class Eagle3Layer(nn.Module):
    """The ``midlayer``: a Llama block whose attention reads [normed embedding ; normed hidden]."""

    def __init__(self, c: ModelConfig, norm_before_residual: bool = False):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, in_features=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.norm_before_residual = norm_before_residual

    def attention_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(the 2H-wide attention input, the residual)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, residual: Tensor, attended: Tensor) -> Tensor:
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, hidden, rope, cache: KVCache | None = None, at: Step | None = None) -> Tensor:
        x, residual = self.attention_input(embeds, hidden)
        return self.finish(residual, self.self_attn(x, rope, cache, at))


class Eagle3Head(DraftHead):
    d2t: Tensor
    t2d: Tensor

    def __init__(self, config: Eagle3Config, taps: tuple[int, ...]):
        super().__init__(config.layer)
        self.config = config
        self.taps = taps
        h = config.layer.hidden_size
        self.fc = nn.Linear(len(taps) * (config.target_hidden_size or h), h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config.layer, config.norm_before_residual)
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.layer.vocab_size, dtype=torch.bool))

    @classmethod
    def for_target(cls, target_config: dict, draft_ids: Tensor, taps: tuple[int, ...] | None = None) -> Eagle3Head:
        """A fresh head for a target (its config.json dict) drafting the target ids ``draft_ids``."""
        base = Eagle3Config.from_dict({**target_config, "draft_vocab_size": int(draft_ids.numel())})
        taps = tuple(taps) if taps else default_taps(target_config["num_hidden_layers"])
        head = cls(dataclasses.replace(base, taps=taps), taps)
        head.set_draft_vocabulary(draft_ids)
        return head

    def set_draft_vocabulary(self, draft_ids: Tensor) -> None:
        """``draft_ids``: the target ids the head drafts, in draft-id order."""
        ids = draft_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, target_layers: int | None = None) -> Eagle3Head:
        """Load a published EAGLE-3 head. ``target_layers`` resolves the default taps when the config
        names none. ``layers.0.*`` is read as ``midlayer.*``; a shipped ``embed_tokens`` is ignored
        (the target's embedding is shared, as vLLM does)."""
        path = Path(path)
        config = Eagle3Config.from_dict(json.loads((path / "config.json").read_text()))
        weights = load_weights(path)
        state = {k.removeprefix("model.").replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
        state.pop("embed_tokens.weight", None)
        config = dataclasses.replace(config, fc_bias="fc.bias" in state)
        if config.taps is not None:
            taps = config.taps
        elif target_layers is not None:
            taps = default_taps(target_layers)
        else:
            raise ValueError(f"{path}: the head names no target layers ({TAPS_KEY}); pass target_layers")
        head = cls(config, taps)
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{path}: not an EAGLE-3 head in the published layout ({exc})") from None
        return head.to(device=device, dtype=dtype).eval()  # d2t and t2d keep their integer dtypes

    def save_pretrained(self, path) -> None:
        dtype = str(self.fc.weight.dtype).removeprefix("torch.")
        save_head(self, {**self.config.to_dict(), "torch_dtype": dtype}, path)

    # --- the DraftHead interface ------------------------------------------------------------------

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def check_target(self, target_config: ModelConfig) -> None:
        h, v, layers = target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
        bad = [i for i in self.taps if not 0 <= i < layers]
        if bad:
            raise ValueError(f"EAGLE-3 head: {TAPS_KEY} {list(self.taps)} name layers outside 0..{layers - 1}")
        expect_shape(self.fc.weight, "fc.weight", (self._mc.hidden_size, len(self.taps) * h), "[H, 3 x target H]")
        embed = "the target's token embedding, shared with the head"
        expect_shape(self.midlayer.input_layernorm.weight, "midlayer.input_layernorm.weight", (h,), embed)
        expect_shape(self.t2d, "t2d", (v,), "one flag per target token")
        top = int(self.to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device)).max())
        if top >= v:
            raise ValueError(f"EAGLE-3 head: d2t maps a draft token to id {top}, beyond the target's {v} tokens")

    def step(
        self, features: Tensor, input_ids: Tensor, embed_tokens: nn.Module, at: Step, cache: KVCache | None = None
    ) -> Tensor:
        at = self._causal(at, input_ids.shape[1])
        hidden = self.fuse(features)
        embeds = embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, self._rope(at.positions), self.cache if cache is None else cache, at)

    def fuse(self, features: Tensor) -> Tensor:
        """Target features (len(taps) x target H wide) go through ``fc``; the head's own (H wide) do not."""
        features = features.to(self.fc.weight.dtype)
        return self.fc(features) if features.shape[-1] != self._mc.hidden_size else features

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_logprobs(self, predicted: Tensor) -> Tensor:
        return torch.log_softmax(self.logits(predicted).float(), dim=-1)

    # --- training-time test ---------------------------------------------------------------------

    def unroll(self, features: Tensor, tokens: Tensor, embed_tokens: nn.Module, steps: int) -> list[Tensor]:
        """Training-time test: the head drafts ``steps`` tokens deep from every position at once.

        ``features`` [B, n, 3H] are the target's taps at positions 0..n-1 and ``tokens`` [B, n + steps - 1]
        the tokens after them (t_1, t_2, ...). Step k feeds position j the head's own output of step
        k - 1 with token t_{j+1+k} at RoPE position j + k, attending to step 0's keys at positions
        <= j and to its own keys of steps 1..k: exactly what the depth-k node of a draft chain sees
        when drafting after position j. Returns the hidden states [B, n, H] of every step (pass them
        to ``logits``); step k at position j predicts token t_{j+2+k}.
        """
        n = features.shape[1]
        positions = torch.arange(n + steps - 1, device=features.device)
        self._fit_rope(positions)
        hidden = self.fuse(features)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        out = []
        for k in range(steps):
            embeds = embed_tokens(tokens[:, k : k + n]).to(hidden.dtype)
            x, residual = self.midlayer.attention_input(embeds, hidden)
            attended = self._unrolled_attention(x, self._rope(positions[k : k + n]), keys, values)
            hidden = self.midlayer.finish(residual, attended)
            out.append(hidden)
        return out

    def _unrolled_attention(self, x: Tensor, rope, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """Causal attention over step 0's keys plus the diagonal (same position) of later steps'."""
        attn = self.midlayer.self_attn
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, attn.n_kv, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, attn.n_kv, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        rep = attn.n_heads // attn.n_kv
        keys.append(k.repeat_interleave(rep, dim=1))
        values.append(v.repeat_interleave(rep, dim=1))
        q = q * attn.head_dim**-0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * key).sum(-1, keepdim=True) for key in keys[1:]]
        p = torch.cat(scores, dim=-1).softmax(-1, dtype=torch.float32).to(q.dtype)
        y = p[..., :n] @ values[0]
        for i, value in enumerate(values[1:]):
            y = y + p[..., n + i : n + i + 1] * value
        return attn.o_proj(y.transpose(1, 2).reshape(b, n, -1))
