"""What each head architecture trains on and how it is scored: the frozen target's features, the
EAGLE loss (feature regression + cross-entropy) and EAGLE-3's training-time test, one `Recipe` each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..drafting.eagle3_head import Eagle3Head
from ..drafting.eagle_head import DraftHead, EagleHead
from .args import TrainArgs
from .data import PackedRows, draft_mask

# EAGLE-3's weight of the k-th unrolled step: later drafts matter less (each needs the earlier ones).
STEP_DECAY = 0.8


class FrozenTarget:
    """The target model, frozen: its final post-norm features, token embedding and lm_head."""

    def __init__(self, path: str, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.embed_tokens: nn.Module = self.model.get_input_embeddings()
        self.lm_head: nn.Module = self.model.get_output_embeddings()

    @torch.no_grad()  # not inference_mode: the features feed the head's autograd graph
    def features(self, input_ids: Tensor) -> Tensor:
        return self.model.base_model(input_ids=input_ids).last_hidden_state

    @torch.no_grad()
    def tapped(self, input_ids: Tensor, taps: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """(final post-norm features [B, T, H], the inputs of layers ``taps`` side by side [B, T, len(taps) H]);
        ``hidden_states[i]`` is the input of layer i, as in the engine's ``Transformer(taps=...)``."""
        out = self.model.base_model(input_ids=input_ids, output_hidden_states=True)
        return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in taps], dim=-1)


def head_outputs(head: EagleHead, target: FrozenTarget, ids: Tensor, noise: float) -> tuple[Tensor, Tensor]:
    """Teacher-forced head pass over rows [B, T]: (predicted f_1..f_{T-1}, true f_1..f_{T-1})."""
    features = target.features(ids)
    inputs = features[:, :-1]
    if noise:
        inputs = inputs + torch.empty_like(inputs).uniform_(-noise, noise)
    return head(inputs, ids[:, 1:], target.embed_tokens), features[:, 1:]


@dataclass
class LossTerms:
    loss: Tensor
    regression: float
    soft_ce: float
    correct: int  # positions where the head's top-1 token is the target's (first draft step)
    count: int


def eagle_loss(pred: Tensor, true: Tensor, mask: Tensor, lm_head: nn.Module, ce_weight: float) -> LossTerms:
    """SmoothL1 on features + `ce_weight` x soft-label CE through the frozen lm_head, over `mask`."""
    p, t = pred[mask], true[mask]
    if p.shape[0] == 0:
        return LossTerms(pred.sum() * 0.0, 0.0, 0.0, 0, 0)
    regression = F.smooth_l1_loss(p.float(), t.float())
    with torch.no_grad():
        target_logits = lm_head(t).float()
    logp = torch.log_softmax(lm_head(p).float(), dim=-1)
    soft_ce = -(torch.softmax(target_logits, dim=-1) * logp).sum(-1).mean()
    correct = int((logp.argmax(-1) == target_logits.argmax(-1)).sum())
    return LossTerms(regression + ce_weight * soft_ce, regression.item(), soft_ce.item(), correct, p.shape[0])


@torch.no_grad()
def evaluate(head: EagleHead, target: FrozenTarget, rows: PackedRows, batch_size: int) -> tuple[float, int]:
    """Held-out top-1: the head's argmax token against the target's argmax next token, teacher-forced,
    on assistant tokens. Returns (accuracy, positions scored)."""
    was_training = head.training
    head.eval()
    correct = count = 0
    for i in range(0, len(rows), batch_size):
        ids = rows.ids[i : i + batch_size].to(target.model.device)
        pred, true = head_outputs(head, target, ids, noise=0.0)
        mask = draft_mask(rows.assistant[i : i + batch_size]).to(ids.device)
        same = target.lm_head(pred[mask]).argmax(-1) == target.lm_head(true[mask]).argmax(-1)
        correct += int(same.sum())
        count += int(mask.sum())
    head.train(was_training)
    return correct / max(count, 1), count


def draft_vocabulary(rows: PackedRows, vocab_size: int, size: int) -> tuple[Tensor, float]:
    """The ``size`` most frequent assistant tokens of the training rows, in id order, and the share
    of assistant tokens they cover (a token outside can never be drafted)."""
    counts = torch.bincount(rows.ids[rows.assistant], minlength=vocab_size)
    top = torch.topk(counts, min(size, vocab_size)).indices
    return top.sort().values, float(counts[top].sum() / counts.sum().clamp_min(1))


def eagle3_outputs(head: Eagle3Head, target: FrozenTarget, ids: Tensor, steps: int) -> tuple[list[Tensor], Tensor]:
    """The head unrolled ``steps`` drafts deep over rows [B, T]: (its hidden states [B, T-1, H] per
    step, the target's logits [B, T, V]). Step k at position j drafts token j + 2 + k, whose target
    distribution is logits[:, j + 1 + k]."""
    final, tapped = target.tapped(ids, head.taps)
    tokens = F.pad(ids[:, 1:], (0, steps - 1))  # past the row: never scored
    hidden = head.unroll(tapped[:, :-1], tokens, target.embed_tokens, steps)
    with torch.no_grad():
        target_logits = target.lm_head(final)
    return hidden, target_logits


@dataclass
class StepMatches:
    """Per unrolled step k: ``matches[k]`` and ``masks[k]`` Bool [B, T-1-k] over positions j."""

    matches: list[Tensor]
    masks: list[Tensor]

    def chain_tau(self) -> tuple[float, int]:
        """Teacher-forced estimate of a greedy chain's tokens per step: 1 + the run of leading steps
        whose draft is the target's top-1, at positions where every step fits in the row."""
        steps = len(self.matches)
        n = self.masks[-1].shape[1]
        run = torch.ones_like(self.masks[0][:, :n])
        total = torch.zeros(run.shape, dtype=torch.long, device=run.device)
        for k in range(steps):
            run = run & self.matches[k][:, :n] & self.masks[k][:, :n]
            total += run
        scored = self.masks[0][:, :n]
        return 1.0 + float(total[scored].float().mean()) if scored.any() else 1.0, int(scored.sum())


def eagle3_loss(
    hidden: list[Tensor], target_logits: Tensor, mask: Tensor, head: Eagle3Head
) -> tuple[Tensor, StepMatches]:
    """Sum over steps of ``STEP_DECAY**k`` x soft CE against the target's distribution over the draft
    vocabulary (renormalised there, as EAGLE-3 trains), on ``mask`` = ``draft_mask`` shifted k on.
    The head's lm_head runs only where a step is scored."""
    draft_ids = head.to_target(torch.arange(head.draft_vocab_size, device=target_logits.device))
    with torch.no_grad():
        target_top, target_draft = target_logits.argmax(-1), target_logits[..., draft_ids]
    loss = target_logits.new_zeros((), dtype=torch.float32)
    matches, masks = [], []
    for k, h in enumerate(hidden):
        n = h.shape[1] - k
        m = mask[:, k:]
        logits = head.logits(h[:, :n][m])
        if logits.shape[0]:
            logp = torch.log_softmax(logits.float(), dim=-1)
            p = torch.softmax(target_draft[:, 1 + k : 1 + k + n][m].float(), dim=-1)
            loss = loss + STEP_DECAY**k * -(p * logp).sum(-1).mean()
        hit = torch.zeros_like(m)
        hit[m] = head.to_target(logits.argmax(-1).detach()) == target_top[:, 1 + k : 1 + k + n][m]
        matches.append(hit)
        masks.append(m)
    return loss, StepMatches(matches, masks)


@torch.no_grad()
def evaluate_eagle3(
    head: Eagle3Head, target: FrozenTarget, rows: PackedRows, batch_size: int, steps: int
) -> tuple[list[float], float, int]:
    """Held-out, teacher-forced: top-1 agreement with the target per unrolled step (the first is the
    EAGLE-1 head's figure), the chain estimate of tokens per step, and the positions scored."""
    was_training = head.training
    head.eval()
    correct, count = [0] * steps, [0] * steps
    tau_sum = tau_n = 0.0
    for i in range(0, len(rows), batch_size):
        ids = rows.ids[i : i + batch_size].to(target.model.device)
        logits, target_logits = eagle3_outputs(head, target, ids, steps)
        _, found = eagle3_loss(
            logits, target_logits, draft_mask(rows.assistant[i : i + batch_size]).to(ids.device), head
        )
        for k in range(steps):
            correct[k] += int((found.matches[k] & found.masks[k]).sum())
            count[k] += int(found.masks[k].sum())
        tau, n = found.chain_tau()
        tau_sum, tau_n = tau_sum + tau * n, tau_n + n
    head.train(was_training)
    return [c / max(n, 1) for c, n in zip(correct, count, strict=True)], tau_sum / max(tau_n, 1), count[0]


class Recipe(Protocol):
    """What an architecture brings to the training loop: its head, loss, evaluation and provenance."""

    title: str
    format_note: str

    @property
    def head(self) -> DraftHead: ...

    def loss(self, ids: Tensor, assistant: Tensor) -> tuple[Tensor, int, int]:
        """(loss, first-draft top-1 hits, positions) of one batch."""
        ...

    def evaluate(self, rows: PackedRows) -> dict: ...

    def recipe_notes(self) -> str: ...

    def load_head(self, path: Path, device: str) -> DraftHead: ...


class EagleRecipe:
    """EAGLE-1/2 head: the target's final features, SmoothL1 + soft CE, feature noise."""

    title = "EAGLE head"

    def __init__(self, args: TrainArgs, target: FrozenTarget, rows: PackedRows) -> None:
        self.args, self.target = args, target
        self.head = EagleHead.for_target(target.config.to_dict())

    def load_head(self, path: Path, device: str) -> DraftHead:
        return EagleHead.from_pretrained(path, device=device)

    def loss(self, ids: Tensor, assistant: Tensor) -> tuple[Tensor, int, int]:
        pred, true = head_outputs(self.head, self.target, ids, self.args.noise)
        mask = draft_mask(assistant).to(ids.device)
        terms = eagle_loss(pred, true, mask, self.target.lm_head, self.args.ce_weight)
        return terms.loss, terms.correct, terms.count

    def evaluate(self, rows: PackedRows) -> dict:
        top1, positions = evaluate(self.head, self.target, rows, self.args.batch_size)
        return {"heldout_top1": round(top1, 4), "heldout_positions": positions}

    def recipe_notes(self) -> str:
        a = self.args
        return (
            f"loss SmoothL1(features) + {a.ce_weight} x soft CE through the target's lm_head;\n"
            f"  input feature noise U(-{a.noise}, {a.noise})"
        )

    format_note = (
        "`config.json` + `model.safetensors` (names `fc.*`, `layers.0.*`, no `embed_tokens`), loadable\n"
        "  with `EagleHead.from_pretrained` and by tools that read the published EAGLE heads"
    )


class Eagle3Recipe:
    """EAGLE-3 head: fused low/mid/high target layers, training-time test, a draft vocabulary."""

    title = "EAGLE-3 head"

    def __init__(self, args: TrainArgs, target: FrozenTarget, rows: PackedRows) -> None:
        self.args, self.target = args, target
        config = target.config.to_dict()
        layers = config["num_hidden_layers"]
        taps = args.taps or (1, layers // 2, layers - 1)
        draft_ids, self.coverage = draft_vocabulary(rows, config["vocab_size"], args.draft_vocab_size)
        head = Eagle3Head.for_target(config, draft_ids, taps)
        # Start the head's own lm_head and final norm from the target's rows for its vocabulary: the
        # head's output then begins in the target's feature space.
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.get_parameter("weight")[draft_ids])
            head.norm.weight.copy_(target.model.base_model.norm.weight)
        self.head = head

    def load_head(self, path: Path, device: str) -> DraftHead:
        return Eagle3Head.from_pretrained(path, device=device)

    def loss(self, ids: Tensor, assistant: Tensor) -> tuple[Tensor, int, int]:
        hidden, target_logits = eagle3_outputs(self.head, self.target, ids, self.args.ttt_steps)
        loss, found = eagle3_loss(hidden, target_logits, draft_mask(assistant).to(ids.device), self.head)
        return loss, int((found.matches[0] & found.masks[0]).sum()), int(found.masks[0].sum())

    def evaluate(self, rows: PackedRows) -> dict:
        by_step, tau, positions = evaluate_eagle3(
            self.head, self.target, rows, self.args.batch_size, self.args.ttt_steps
        )
        return {
            "heldout_top1": round(by_step[0], 4),
            "heldout_tau": round(tau, 3),
            "heldout_top1_by_step": [round(a, 3) for a in by_step],
            "heldout_positions": positions,
        }

    def recipe_notes(self) -> str:
        a, head = self.args, self.head
        return (
            f"training-time test {a.ttt_steps} steps deep, step k weighted {STEP_DECAY}**k; loss soft CE against the\n"
            f"  target's distribution restricted to the draft vocabulary; target layers {list(head.taps)} (inputs of\n"
            f"  those layers, vLLM numbering); draft vocabulary: the {head.draft_vocab_size} most frequent assistant\n"
            f"  tokens of the training rows ({self.coverage:.1%} of them); lm_head and norm initialised from the\n"
            f"  target's rows for those tokens"
        )

    format_note = (
        "`config.json` (`LlamaForCausalLMEagle3`, `draft_vocab_size`, `eagle_config`) + `model.safetensors`\n"
        "  (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`), the layout vLLM and\n"
        "  SGLang load; loadable with `Eagle3Head.from_pretrained`"
    )


RECIPES: dict[str, Callable[[TrainArgs, FrozenTarget, PackedRows], Recipe]] = {
    "eagle": EagleRecipe,
    "eagle3": Eagle3Recipe,
}
