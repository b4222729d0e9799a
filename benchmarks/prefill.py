"""Benchmark: a prompt's time to its first token in the engine, with the last layer running only
the tokens whose outputs the step needs (`rows.Outputs`, the default) and running every token.

    python benchmarks/prefill.py                  # one thread, 8 held-out prompts, 5 rounds
    python benchmarks/prefill.py --threads 2 --rounds 9

In process: one `BatchEngine` (the server's loop, prefix caching off, so every prompt is computed
whole) on the bundled model, fp32, the two variants taking turns prompt by prompt, so a slower
minute hits both alike. Each request is the serving benchmark's (`serving.py`: its system prompt,
then a held-out prompt) with one output token: its time is the prompt's prefill in chunks of the
server's `--prefill-chunk`. Prints the median per prompt length, the ratio, and whether each
prompt's greedy answer (32 tokens) is the same both ways.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from serving import PROMPT_CHARS, SYSTEM, TARGET  # the serving benchmark's requests (run from benchmarks/)

from ace_mw.engine import Engine, SamplingParams
from ace_mw.engine.batching import BatchEngine, scheduler
from ace_mw.engine.prompts import load_prompts

VARIANTS = ("every token", "wanted only")


class EveryToken:
    """In place of `rows.Outputs`: no step of outputs alone, so the last layer runs every token."""

    @staticmethod
    def build(*args: object, **kwargs: object) -> None:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="turns of both variants (the first is a warm-up)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [p for ps in load_prompts(4, fits=lambda text: len(text) < PROMPT_CHARS).values() for p in ps]
    messages = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Request {i}. {p}"}]
        for i, p in enumerate(prompts[: args.prompts])
    ]
    engine = BatchEngine(Engine.from_pretrained(TARGET), max_num_seqs=4, prefix_caching=False)
    wanted_only = scheduler.Outputs
    times: dict[tuple[int, str], list[float]] = {}
    answers: dict[tuple[int, str], list[int]] = {}
    for r in range(args.rounds):
        for variant in VARIANTS:
            scheduler.Outputs = wanted_only if variant == "wanted only" else EveryToken  # type: ignore[misc]
            for i, m in enumerate(messages):
                started = time.perf_counter()
                result = engine.generate(m, SamplingParams(max_new_tokens=1))
                if r:
                    times.setdefault((result.prompt_tokens, variant), []).append(time.perf_counter() - started)
                else:
                    answers[i, variant] = engine.generate(m, SamplingParams(max_new_tokens=32)).token_ids
    scheduler.Outputs = wanted_only  # type: ignore[misc]
    print(f"time to the first token, in process, {args.threads} thread(s), {args.rounds - 1} rounds (medians):")
    print(f"{'prompt tokens':>13} {'every token':>12} {'wanted only':>12} {'ratio':>6}")
    totals = dict.fromkeys(VARIANTS, 0.0)
    for n in sorted({n for n, _ in times}):
        every, only = (statistics.median(times[n, v]) * 1e3 for v in VARIANTS)
        totals["every token"] += every
        totals["wanted only"] += only
        print(f"{n:>13} {every:>9.1f} ms {only:>9.1f} ms {only / every:>6.3f}")
    same = sum(answers[i, VARIANTS[0]] == answers[i, VARIANTS[1]] for i in range(len(messages)))
    ratio = totals["wanted only"] / totals["every token"]
    print(f"all prompts: {ratio:.3f}x the time; the same greedy answer: {same}/{len(messages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
