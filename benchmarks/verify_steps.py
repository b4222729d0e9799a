"""Benchmark: a batched step with rows verifying chains of drafts, their attention on the native
kernel with the decoding rows (one query a token, the default) against a padded, masked group of
torch's operations (as before).

    python benchmarks/verify_steps.py               # one thread, 4 rounds
    python benchmarks/verify_steps.py --threads 2

In process, on the bundled model, fp32: each step (rows of the tokens listed, at prompt lengths
from `--context` up, 37 apart) is one `Transformer.forward_rows` over a batched cache, the two
variants taking turns round by round, so a slower minute hits both alike. Prints the median of
each, their ratio, and the largest difference of their logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from serving import TARGET  # the serving benchmark's model (run from benchmarks/)

from ace_mw.engine import Engine
from ace_mw.engine.model import native, rows
from ace_mw.engine.model.rows import Rows, Span

STEPS = ([2] + [1] * 7, [4] + [1] * 7, [2, 2] + [1] * 6, [4, 4] + [1] * 6, [4] * 8, [4] * 4, [3, 1], [5])
VARIANTS: dict[str, Callable[[Span], bool]] = {"group": lambda span: span.q == 1, "kernel": rows._chain}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="forwards per variant per round (median)")
    parser.add_argument("--context", type=int, nargs="+", default=[200, 900], help="the first row's prompt length")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Engine.from_pretrained(TARGET).model
    on_kernels = native.runs_on(model.embed_tokens.weight)
    if not on_kernels:
        print("the native kernels do not run here: nothing to compare")
        return 1
    caches = model.batch_caches(8, max(args.context) + 8 * 37 + 16)
    ids = torch.randint(0, model.config.vocab_size, (64,))

    def forward(tokens: Sequence[int], context: int) -> tuple[float, torch.Tensor]:
        spans = [Span(r, context + 37 * r, q) for r, q in enumerate(tokens)]
        n, took = sum(tokens), []
        with torch.inference_mode():
            for _ in range(args.repeats):
                step = Rows.build(spans, torch.device("cpu"), on_kernels)
                start = time.perf_counter()
                logits, _ = model.forward_rows(ids[:n], step, caches, torch.arange(n))
                took.append(time.perf_counter() - start)
        return statistics.median(took) * 1e3, logits

    header = f"{'context':>7}  {'tokens per row':<26} {'group ms':>9} {'kernel ms':>9}"
    print(f"{header} {'kernel/group':>12} {'max diff':>9}")
    for context in args.context:
        for tokens in STEPS:
            ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
            logits: dict[str, torch.Tensor] = {}
            for r in range(args.rounds):
                for name in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
                    rows._chain = VARIANTS[name]  # type: ignore[assignment]
                    took, logits[name] = forward(tokens, context)
                    ms[name].append(took)
            rows._chain = VARIANTS["kernel"]  # type: ignore[assignment]
            group, kernel = statistics.median(ms["group"]), statistics.median(ms["kernel"])
            diff = (logits["group"] - logits["kernel"]).abs().max().item()
            shown = str(tokens).replace(" ", "")
            print(f"{context:>7}  {shown:<26} {group:>9.2f} {kernel:>9.2f} {kernel / group:>11.2f}x {diff:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
