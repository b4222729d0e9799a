"""bf16 against fp32 on this machine, in one process, interleaved so that load hits both alike.

    python benchmarks/precision.py [--rounds 20] [--prompts-per-category 2] [--eagle3 models/ace-tiny-chat-eagle3]

1. Passes: the target's forward over q tokens after a 128-token prefix, and one draft-head pass with
   its lm_head (EAGLE head: the target's 8192 rows; EAGLE-3 head: its draft vocabulary), for q
   nodes; 20th percentile over rounds; the ratio bf16 time / fp32 time.
2. End to end: the engine in fp32 and in bf16 decoding the same held-out prompts (64 tokens each),
   per algorithm: median ms per output token, speed against the fp32 baseline, tokens per step, and
   how many outputs equal the same-dtype baseline (greedy).
One torch thread. Read the ratios: on a shared machine the absolute times move with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.drafting.eagle3_head import load_draft_head
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

DTYPES = (torch.float32, torch.bfloat16)
TARGET = MODELS_DIR / "ace-tiny-chat"


def p20_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 5] * 1000


def passes(heads: list[Path], rounds: int) -> list[tuple[str, int, float, float]]:
    """(pass, q, fp32 ms, bf16 ms) rows."""
    targets = {dt: Transformer.from_pretrained(TARGET, dtype=dt) for dt in DTYPES}
    for model in targets.values():
        model.setup_cache(512)
    loaded = {dt: [load_draft_head(h, targets[dt].config, dtype=dt) for h in heads] for dt in DTYPES}
    for dt in DTYPES:
        for head in loaded[dt]:
            head.setup_drafting(targets[dt], 512)
    ids = torch.randint(0, targets[torch.float32].config.vocab_size, (1, 256))
    times: dict[tuple[str, int, torch.dtype], list[float]] = {}

    def timed(key: tuple[str, int, torch.dtype], fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - start)

    def target_pass(model: Transformer, q: int) -> Callable[[], object]:
        return lambda: model(ids[:, 128 : 128 + q], torch.arange(128, 128 + q))

    def head_pass(head, dt: torch.dtype, q: int) -> Callable[[], object]:
        features = torch.randn(1, q, head.fc.out_features, dtype=dt)  # a tree node's input: the head's own output
        slots = torch.arange(128, 128 + q)
        mask = torch.ones(q, 128 + q, dtype=torch.bool)
        embed = targets[dt].embed_tokens
        return lambda: head.draft_logprobs(head.step(features, ids[:, :q], embed, Step(slots, slots, mask, 128 + q))[0])

    with torch.inference_mode():
        for model in targets.values():
            model(ids[:, :128], torch.arange(128))
        for _ in range(rounds):
            for q in (1, 2, 4, 8, 16, 32):
                for dt in DTYPES:
                    timed(("target forward", q, dt), target_pass(targets[dt], q))
            for q in (1, 10):
                for dt in DTYPES:
                    for path, head in zip(heads, loaded[dt], strict=True):
                        timed((f"head {path.name}", q, dt), head_pass(head, dt, q))
    keys = dict.fromkeys(k[:2] for k in times)
    return [(name, q, p20_ms(times[(name, q, DTYPES[0])]), p20_ms(times[(name, q, DTYPES[1])])) for name, q in keys]


def end_to_end(heads: list[Path], per_category: int) -> list[str]:
    engines = {dt: Engine.from_pretrained(TARGET, eagle=heads, dtype=dt, max_context=1024) for dt in DTYPES}
    tokenizer = engines[torch.float32].tokenizer
    prompts = load_prompts(per_category, fits=lambda text: len(tokenizer(text)["input_ids"]) <= 512)
    algorithms = ["baseline", "eagle_2", "ngram"] + (["eagle_3"] if engines[torch.float32].runs("eagle_3") else [])
    runs: dict[tuple[torch.dtype, str], list[tuple[float, float, list[int]]]] = {}
    for text in (p for texts in prompts.values() for p in texts):
        messages = [{"role": "user", "content": text}]
        for engine in engines.values():
            engine.generate(messages, max_new_tokens=8)  # warm-up
        for algorithm in algorithms:
            spec = None if algorithm == "baseline" else SpecParams(algorithm, self_gate=False)
            for dt, engine in engines.items():
                r = engine.generate(messages, max_new_tokens=64, speculative=spec)
                runs.setdefault((dt, algorithm), []).append(
                    (r.stats.tpot_s * 1000, r.stats.accepted_per_step, r.token_ids)
                )
    fp32_base = statistics.median(r[0] for r in runs[(torch.float32, "baseline")])
    lines = [
        "| algorithm | dtype | ms/token | x fp32 baseline | tokens/step | = same-dtype baseline |",
        "|---|---|---|---|---|---|",
    ]
    for algorithm in algorithms:
        for dt in DTYPES:
            rs, base = runs[(dt, algorithm)], runs[(dt, "baseline")]
            ms = statistics.median(r[0] for r in rs)
            same = sum(r[2] == b[2] for r, b in zip(rs, base, strict=True))
            tau = statistics.median(r[1] for r in rs)
            name = str(dt).removeprefix("torch.")
            lines.append(f"| {algorithm} | {name} | {ms:.2f} | {fp32_base / ms:.2f}x | {tau:.2f} | {same}/{len(rs)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--prompts-per-category", type=int, default=2)
    p.add_argument("--eagle", default=str(MODELS_DIR / "ace-tiny-chat-eagle"))
    p.add_argument("--eagle3", default=str(MODELS_DIR / "ace-tiny-chat-eagle3"))
    args = p.parse_args()
    torch.set_num_threads(1)
    heads = [Path(h) for h in (args.eagle, args.eagle3) if (Path(h) / "config.json").exists()]
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, 1 thread, load average {load:.1f} at start")
    print("\n| pass | q | fp32 ms | bf16 ms | bf16 / fp32 time |\n|---|---|---|---|---|")
    for name, q, fp32, bf16 in passes(heads, args.rounds):
        print(f"| {name} | {q} | {fp32:.2f} | {bf16:.2f} | {bf16 / fp32:.2f} |")
    print()
    print("\n".join(end_to_end(heads, args.prompts_per_category)))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
