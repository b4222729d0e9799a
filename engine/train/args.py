"""The training run's arguments: what a resumed run must keep, and the command line that sets them."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ace_mw.usage import Parser

# Arguments that fix which rows a step sees, or what the head is: a resumed run must keep them.
DATA_SHAPING = ("target", "steps", "batch_size", "seq_len", "seed", "arch", "draft_vocab_size", "taps")


ARCHS = ("eagle", "eagle3")


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
    dtype: str = "auto"  # autocast compute dtype: auto (model.dtypes.bf16_pays) | bfloat16 | float32
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


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = Parser(
        prog="python -m ace_mw.engine.train",
        description="Train an EAGLE or EAGLE-3 draft head for a target model on chat conversations.",
    )
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
