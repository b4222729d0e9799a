"""Ship a trained draft head into a model folder: cast, hash, measure, write provenance.

    python -m ace_mw.engine.train.package --head /work/train/eagle3-out --out models/ace-tiny-chat-eagle3

Training (``python -m ace_mw.engine.train``) leaves a head and its PROVENANCE.md (commands, the
held-out curve). This step writes the head in the dtype it is served in, measures what it does in
the engine on held-out chat prompts (greedy: tokens per target step and whether the output equals
plain decoding), and appends that, the weights' sha256 and this command to the provenance.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from pathlib import Path

import torch

from ace_mw.usage import Parser
from ace_mw.vocabulary import Algorithm

from ..drafting.eagle3_head import Eagle3Head, load_draft_head
from ..model.dtypes import DTYPES
from ..model.transformer import ModelConfig
from ..prompts import MODELS_DIR


def measure(target: Path, head_dir: Path, prompts: int, new_tokens: int) -> dict:
    """Greedy decoding of held-out chat prompts with the head: tokens per step, equality with plain."""
    from .. import Engine, SpecParams

    engine = Engine.from_pretrained(target, eagle=head_dir, max_context=1024, compile_decode=False)
    algorithm = Algorithm.EAGLE_3 if engine.runs(Algorithm.EAGLE_3) else Algorithm.EAGLE_2
    conversations = json.loads((MODELS_DIR / "chat_eval.json").read_text())[-prompts:]
    steps = emitted = identical = 0
    for c in conversations:
        messages = [{"role": "user", "content": c["turns"][0][1][:400]}]
        plain = engine.generate(messages, max_new_tokens=new_tokens)
        fast = engine.generate(messages, max_new_tokens=new_tokens, speculative=SpecParams(algorithm, self_gate=False))
        steps += fast.stats.steps
        emitted += fast.stats.accepted + fast.stats.steps
        identical += fast.token_ids == plain.token_ids
    return {
        "algorithm": algorithm,
        "tokens_per_step": emitted / max(steps, 1),
        "identical": identical,
        "prompts": len(conversations),
        "tree_budget": engine.auto_tree_budget,
    }


def package(head: Path, out: Path, target: Path, dtype: torch.dtype, prompts: int, new_tokens: int, command: str):
    config = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    model = load_draft_head(head, config, dtype=dtype)
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    params = sum(p.numel() for p in model.parameters())
    torch.set_num_threads(1)
    found = measure(target, out, prompts, new_tokens)
    kind = "EAGLE-3" if isinstance(model, Eagle3Head) else "EAGLE"
    stored = f"{str(dtype).removeprefix('torch.')}, {params:,} parameters, {weights.stat().st_size:,} bytes"
    trained = (head / "PROVENANCE.md").read_text() if (head / "PROVENANCE.md").exists() else ""
    shipped = f"""
## Shipped copy

- Command: `{command}`
- Weights: `model.safetensors`, {stored}, sha256 `{digest}`.
- Measured in the engine on the last {found["prompts"]} conversations of `chat_eval.json` (held out), first user
  turn, {new_tokens} new tokens, greedy, `{found["algorithm"]}` (tree budget {found["tree_budget"]} from the
  verify-cost curve, 1 torch thread, fp32 target): **{found["tokens_per_step"]:.2f} tokens per target step**
  (accepted + bonus); output identical to plain decoding on {found["identical"]}/{found["prompts"]} prompts.
"""
    (out / "PROVENANCE.md").write_text(trained + shipped)
    print(
        f"{kind} head -> {out}: {params:,} params, {weights.stat().st_size:,} bytes, sha256 {digest}, "
        f"{found['tokens_per_step']:.2f} tokens/step ({found['identical']}/{found['prompts']} identical)"
    )


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="python -m ace_mw.engine.train.package", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="trained head folder (train.py's --out)")
    p.add_argument("--out", required=True, help="folder to ship, e.g. models/ace-tiny-chat-eagle3")
    p.add_argument("--target", default=str(MODELS_DIR / "ace-tiny-chat"))
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="stored dtype (default bfloat16)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    command = "python -m ace_mw.engine.train.package " + shlex.join(argv)
    package(
        Path(args.head),
        Path(args.out),
        Path(args.target),
        DTYPES[args.dtype],
        args.prompts,
        args.max_new_tokens,
        command,
    )


if __name__ == "__main__":
    main()
