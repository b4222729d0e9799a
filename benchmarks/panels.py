"""Decoding steps on bf16 panels against oneDNN's packed fp32 weights (engine/model/packed.py), and
the compiled step of one or two rows (engine/model/compiled.py), in one process, taking turns.

Prints, per row count, the milliseconds of a step's projections alone and of a whole eager step
(`Transformer.forward_rows`, each row one token at a 300-token context), each the best of
`--rounds` medians, and their ratio. Run: python benchmarks/panels.py [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ace_mw.engine.model import native
from ace_mw.engine.model.compiled import DecodingStep
from ace_mw.engine.model.packed import linear
from ace_mw.engine.model.rows import Rows, Span
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.prompts import MODELS_DIR

CONTEXT = 300
ROWS = (1, 2, 4, 8, 16)


def model(panels: bool) -> Transformer:
    """The fixture packed, with its bf16 panels or without them."""
    m = Transformer.from_pretrained(MODELS_DIR / "ace-tiny-chat")
    m.setup_cache(CONTEXT + 64)
    m.pack()
    if not panels:
        for layer in m.layers:
            layer.self_attn.qkv_panels = layer.mlp.gate_up_panels = None
            layer.self_attn.o_proj.panels = layer.mlp.down_proj.panels = None
        m.lm_head.panels = None
    return m


def products(m: Transformer, n: int) -> Callable[[], object]:
    """A step's projections for ``n`` rows: every layer's four, and the logits'."""
    hidden, inner = m.config.hidden_size, m.config.intermediate_size
    weights = []  # (weight, its panels, its input width)
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [(attn.qkv, attn.qkv_panels, hidden), (attn.o_proj.weight, attn.o_proj.panels, hidden)]
        weights += [(mlp.gate_up, mlp.gate_up_panels, hidden), (mlp.down_proj.weight, mlp.down_proj.panels, inner)]
    weights.append((m.lm_head.weight, m.lm_head.panels, hidden))
    inputs = [torch.randn(n, width) for _, _, width in weights]
    return lambda: [linear(x, w, None, p) for x, (w, p, _) in zip(inputs, weights, strict=True)]


def step(m: Transformer, n: int) -> Callable[[], object]:
    caches = m.batch_caches(n, CONTEXT + 64)
    rows = Rows.build(
        [Span(r, CONTEXT, 1) for r in range(n)], torch.device("cpu"), native.runs_on(m.embed_tokens.weight)
    )
    tokens, wanted = torch.full((n,), 5), torch.arange(n)
    return lambda: m.forward_rows(tokens, rows, caches, wanted)


def compiled_step(n: int) -> Callable[[], object] | None:
    """The compiled step of ``n`` rows (one or two), warmed; None where it does not run."""
    m = Transformer.from_pretrained(MODELS_DIR / "ace-tiny-chat")
    m.setup_cache(CONTEXT + 64)
    if n > 2 or not DecodingStep.supports(m):
        return None
    decoding = DecodingStep(m)
    caches = m.batch_caches(n, CONTEXT + 64)
    if not decoding.warm_up(caches):
        return None
    tokens, rows = torch.full((n,), 5), list(range(n))
    return lambda: decoding(tokens, rows, [CONTEXT] * n, caches)


def best_median(runs: dict[str, Callable[[], object]], rounds: int, calls: int = 30) -> dict[str, float]:
    """Milliseconds of each run: the best of ``rounds`` medians, the runs taking turns."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(3):
                run()
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                run()
                times.append(time.perf_counter() - started)
            best[name] = min(best[name], statistics.median(times) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.has_panels():
        raise SystemExit("no panel kernel here: the native kernels need an AVX-512 CPU and a C++ compiler")
    onednn, panels = model(panels=False), model(panels=True)
    print(f"the fixture, fp32, {args.threads} thread(s), a {CONTEXT}-token context; ms, best of {args.rounds} medians")
    columns = [("rows", 4), ("products: oneDNN", 17), ("panels", 7), ("ratio", 6)]
    columns += [("step: oneDNN", 13), ("panels", 7), ("ratio", 6), ("compiled", 9)]
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    with torch.inference_mode():
        for n in ROWS:
            compiled = compiled_step(n)
            runs = {
                "products onednn": products(onednn, n),
                "products panels": products(panels, n),
                "step onednn": step(onednn, n),
                "step panels": step(panels, n),
                **({"compiled": compiled} if compiled is not None else {}),
            }
            ms = best_median(runs, args.rounds)
            p, s = ms["products panels"] / ms["products onednn"], ms["step panels"] / ms["step onednn"]
            c = f"{ms['compiled']:9.2f}" if "compiled" in ms else f"{'-':>9}"
            print(
                f"{n:>4} {ms['products onednn']:17.2f} {ms['products panels']:7.2f} {p:6.2f}"
                f" {ms['step onednn']:13.2f} {ms['step panels']:7.2f} {s:6.2f} {c}",
                flush=True,
            )


if __name__ == "__main__":
    main()
