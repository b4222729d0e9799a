"""Benchmark: the engine's algorithms against transformers' own decoding, same process, same prompts.

    python -m ace_mw.engine.bench --target models/ace-tiny-chat --eagle models/ace-tiny-chat-eagle \
        --draft models/ace-tiny-chat-draft --prompts-per-category 3 --max-new-tokens 64 \
        --temperature 0 --device cpu --out bench_out

Every method decodes every held-out prompt (code, summarization, chat, math; see `prompts.py`)
after a warm-up, methods interleaved prompt by prompt so machine noise hits all alike. Each
speculative algorithm runs twice: as configured every step (`eagle_2`), and self-gated
(`eagle_2 self-gated`: the engine drafts per step only what pays on this machine, nothing
included). Figures are medians over prompts; "min ratio" is the worst prompt's baseline TPOT
over the method's on that same prompt. TPOT is decode time per output token after the first (prefill excluded),
for the engine from its own stats and for transformers from a streamer's timestamps.
accepted/step is tokens per target forward after the prefill, bonus token included (vLLM's mean
acceptance length; 1.00 for plain decoding); for transformers the forwards are counted as
streamer puts. Acceptance rate is accepted / drafted (n/a where transformers does not say).
Memory overhead is what a method adds to plain decoding: drafter weights plus its KV cache.
Writes results.json, results.md and speedup.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ace_mw.engine import Engine
from ace_mw.engine.bundled import exit_if_missing
from ace_mw.engine.model.dtypes import DTYPES, resolve_dtype
from ace_mw.engine.prompts import CATEGORIES, MODELS_DIR, load_prompts
from ace_mw.usage import Parser
from ace_mw.vocabulary import Algorithm

from .methods import GATED, HF_GENERATE, Method, Run, engine_method, hf_methods

ENGINE_ALGORITHMS = tuple(a.value for a in Algorithm)
VARIANTS = ("fixed", "self-gated")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
DEFAULT_DTYPE = "float32"  # see docs/benchmarks.md for the bf16 measurement behind this choice
MB = 2**20


# --- measuring and reporting -------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(methods: list[Method], temperature: float, category: str | None) -> list[dict]:
    """One row per method over the runs of `category` (None: all)."""

    def runs_of(m: Method) -> list[Run]:
        return [r for r in m.runs if category is None or r.category == category]

    base = {m.name: m for m in methods}
    baseline_runs = runs_of(base["baseline"]) if "baseline" in base else None
    tpot = {m.name: statistics.median(r.tpot_s for r in runs_of(m)) for m in methods}
    rows = []
    for m in methods:
        runs = runs_of(m)
        greedy = ratios = None
        if baseline_runs is not None:
            ratios = [b.tpot_s / r.tpot_s for r, b in zip(runs, baseline_runs, strict=True)]
        if temperature == 0 and baseline_runs is not None:
            greedy = sum(a.tokens == b.tokens for a, b in zip(runs, baseline_runs, strict=True))
        rows.append(
            {
                "algorithm": m.name,
                "acceptance_rate": _median(
                    [r.accepted / r.drafted if r.drafted and r.accepted is not None else None for r in runs]
                ),
                "accepted_per_step": _median([(len(r.tokens) - 1) / r.steps if r.steps else None for r in runs]),
                "tpot_ms": tpot[m.name] * 1e3,
                "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
                "speedup_vs_baseline": tpot["baseline"] / tpot[m.name] if "baseline" in tpot else None,
                "min_ratio_vs_baseline": min(ratios) if ratios else None,
                "plain_step_fraction": _median(
                    [r.plain_steps / r.steps if r.plain_steps is not None and r.steps else None for r in runs]
                ),
                "speedup_vs_hf_generate": tpot[HF_GENERATE] / tpot[m.name] if HF_GENERATE in tpot else None,
                "memory_overhead_mb": m.memory_bytes() / MB,
                "greedy_equal_baseline": f"{greedy}/{len(runs)}" if greedy is not None else "n/a",
                "prompts": len(runs),
            }
        )
    return rows


COLUMNS = (
    ("algorithm", "algorithm", "{}"),
    ("acceptance rate", "acceptance_rate", "{:.2f}"),
    ("accepted/step", "accepted_per_step", "{:.2f}"),
    ("TPOT ms", "tpot_ms", "{:.2f}"),
    ("speedup vs baseline", "speedup_vs_baseline", "{:.2f}x"),
    ("min ratio vs baseline", "min_ratio_vs_baseline", "{:.2f}x"),
    ("plain steps", "plain_step_fraction", "{:.2f}"),
    ("speedup vs HF generate", "speedup_vs_hf_generate", "{:.2f}x"),
    ("memory overhead MB", "memory_overhead_mb", "{:.1f}"),
    ("greedy = baseline", "greedy_equal_baseline", "{}"),
)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = ["n/a" if row[key] is None else fmt.format(row[key]) for _, key, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(tables: dict[str, list[dict]], path: Path, temperature: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["algorithm"] for row in tables["overall"]]
    groups = list(tables)
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, group in enumerate(groups):
        values = [row["speedup_vs_hf_generate"] or 0 for row in tables[group]]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=group)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(names))], names, rotation=20)
    ax.set_ylabel("speedup vs transformers generate (TPOT)")
    ax.set_title(f"ace-mw engine vs transformers, T={temperature}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_benchmark(
    methods: list[Method],
    prompts: dict[str, list[str]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    repeats: int = 1,
    progress: Callable[[str], None] = print,
) -> None:
    """Warm every method up, then decode prompt by prompt with every method in turn.

    With `repeats` > 1 every method decodes the prompt that often (same seed, so the same tokens),
    in rounds of one decode per method, and each keeps its fastest: on a shared machine the
    minimum is the figure least polluted by other processes, and rounds spread every method's
    tries over the same stretch of time.
    """
    warm = [{"role": "user", "content": prompts[CATEGORIES[0]][0]}]
    for m in methods:
        m.decode(CATEGORIES[0], warm, min(16, max_new_tokens), temperature, seed)
    for category in CATEGORIES:
        for i, text in enumerate(prompts[category]):
            messages = [{"role": "user", "content": text}]
            rounds = [
                [m.decode(category, messages, max_new_tokens, temperature, seed + i) for m in methods]
                for _ in range(repeats)
            ]
            for m, runs in zip(methods, zip(*rounds, strict=True), strict=True):
                m.runs.append(min(runs, key=lambda r: r.tpot_s))
            progress(f"{category} {i + 1}/{len(prompts[category])}")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m ace_mw.engine.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(MODELS_DIR / "ace-tiny-chat"))
    parser.add_argument("--eagle", default=str(MODELS_DIR / "ace-tiny-chat-eagle"), help="'' to skip eagle, eagle_2")
    parser.add_argument("--eagle3", default=str(MODELS_DIR / "ace-tiny-chat-eagle3"), help="'' to skip eagle_3")
    parser.add_argument("--draft", default=str(MODELS_DIR / "ace-tiny-chat-draft"), help="'' to skip draft_model")
    parser.add_argument("--prompts-per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K for draft_model / ngram / eagle (default: the engine's)",
    )
    parser.add_argument(
        "--total-tokens",
        type=int,
        default=None,
        help="eagle_2 / eagle_3 tree budget (default: chosen from the engine's verify-cost curve)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="decode each prompt this often, keep the fastest")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="decode time by the wall clock, or by this thread's CPU time ('cpu': with --threads 1 on "
        "the CPU, time spent waiting for a core that another process holds is left out)",
    )
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=("auto", *DTYPES),
        help=f"our engine's dtype (default {DEFAULT_DTYPE}; auto = bf16 on a GPU or an AMX CPU)",
    )
    parser.add_argument(
        "--peer-dtype", default="float32", choices=tuple(DTYPES), help="transformers peers' dtype (default float32)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for every method (default: torch's); 1 is the stable choice "
        "on a machine shared with other jobs, where multi-thread barriers stall",
    )
    parser.add_argument("--algorithms", nargs="+", default=list(ENGINE_ALGORITHMS), choices=ENGINE_ALGORITHMS)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=VARIANTS,
        help="run speculative algorithms at their configured size every step, self-gated, or both",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    exit_if_missing(args.target, "--target")
    if args.draft:
        exit_if_missing(args.draft, "--draft")
    for prompts_file in ("chat_eval.json", "bench_prompts.json"):
        exit_if_missing(MODELS_DIR / prompts_file, "the prompt file")
    algorithms = ["baseline"] + [a for a in args.algorithms if a != "baseline"]
    for flag, needs in (("eagle", ("eagle", "eagle_2")), ("eagle3", ("eagle_3",))):
        folder = getattr(args, flag)
        if folder and not Path(folder).exists():
            print(f"no head at {folder}: skipping {', '.join(needs)}")
        if not (folder and Path(folder).exists()):
            setattr(args, flag, None)
            algorithms = [a for a in algorithms if a not in needs]
    args.draft = args.draft or None
    if not args.draft:
        algorithms = [a for a in algorithms if a != "draft_model"]
    heads = [h for h in (args.eagle, args.eagle3) if h]
    dtype = resolve_dtype(args.dtype, args.device)
    args.resolved_dtype = str(dtype).removeprefix("torch.")
    engine = Engine.from_pretrained(args.target, eagle=heads, draft=args.draft, device=args.device, dtype=dtype)
    budget = min(512, engine.max_context - args.max_new_tokens - 128)
    prompts = load_prompts(
        args.prompts_per_category, fits=lambda text: len(engine.tokenizer(text)["input_ids"]) <= budget
    )
    clock = CLOCKS[args.clock]
    methods = [engine_method(engine, "baseline", clock=clock)] + [
        engine_method(engine, a, args.num_speculative_tokens, args.total_tokens, variant == "self-gated", clock)
        for a in algorithms[1:]
        for variant in args.variants
    ]
    if not args.no_peers:
        methods += hf_methods(
            args.target, args.draft, args.device, budget + args.max_new_tokens, clock, DTYPES[args.peer_dtype]
        )

    started, load = time.perf_counter(), os.getloadavg()[0]
    run_benchmark(methods, prompts, args.max_new_tokens, args.temperature, args.seed, args.repeats)
    budget_note = ""
    trees = [a for a in algorithms if Algorithm(a).grows_tree]
    if trees:
        chosen = args.total_tokens or engine.auto_tree_budget
        source = "--total-tokens" if args.total_tokens else "the engine's verify-cost curve"
        budget_note = f"; fixed {'/'.join(trees)} tree budget {chosen} tokens (from {source})"
        budget_note += ", self-gated chosen per step"
    budget_note += f"; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    report(args, methods, prompts, time.perf_counter() - started, budget_note)


GATE_FLOOR = 0.95  # a self-gated method may be at most 5 % slower than baseline on any prompt


def gate_verdict(rows: list[dict]) -> str:
    """One line: is every self-gated method within GATE_FLOOR of baseline on every prompt?"""
    gated = [r for r in rows if r["algorithm"].endswith(GATED) and r["min_ratio_vs_baseline"] is not None]
    if not gated:
        return ""
    below = [
        f"{r['algorithm']} ({r['min_ratio_vs_baseline']:.2f}x)"
        for r in gated
        if r["min_ratio_vs_baseline"] < GATE_FLOOR
    ]
    if not below:
        return f"Self-gate check: every self-gated method is at or above {GATE_FLOOR:.2f}x of baseline on every prompt."
    return f"Self-gate check: below {GATE_FLOOR:.2f}x of baseline on some prompt: " + ", ".join(below) + "."


def greedy_verdict(rows: list[dict]) -> str:
    """One line: did every method reproduce the baseline's greedy tokens on every prompt?"""
    differing = [
        f"{r['algorithm']} ({r['greedy_equal_baseline']})"
        for r in rows
        if r["greedy_equal_baseline"] != f"{r['prompts']}/{r['prompts']}"
    ]
    if not differing:
        return "Greedy check: every method's output is token-for-token identical to baseline on every prompt."
    return "Greedy check: outputs differ from baseline for " + ", ".join(differing) + "."


def report(
    args: argparse.Namespace, methods: list[Method], prompts: dict[str, list[str]], elapsed: float, note: str = ""
) -> None:
    tables = {"overall": summarize(methods, args.temperature, None)}
    tables.update({c: summarize(methods, args.temperature, c) for c in CATEGORIES})
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if args.device != "cpu" and torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    header = (
        f"T={args.temperature}, {args.prompts_per_category} prompts x {len(CATEGORIES)} categories, "
        f"{args.max_new_tokens} new tokens, fastest of {args.repeats}, device {args.device} ({machine}); "
        f"engine in {args.resolved_dtype}, transformers peers in {args.peer_dtype}; "
        f"{args.clock} clock; medians over prompts; "
        f"measured in {elapsed:.0f} s{note}"
    )
    if args.temperature == 0:
        header += "\n\n" + greedy_verdict(tables["overall"])
    if gate_verdict(tables["overall"]):
        header += "\n\n" + gate_verdict(tables["overall"])
    md = [f"# Engine benchmark\n\n{header}\n"] + [
        f"## {name}\n\n{markdown_table(rows)}\n" for name, rows in tables.items()
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(md))
    (out / "results.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "header": header,
                "tables": tables,
                "runs": {m.name: [asdict(r) for r in m.runs] for m in methods},
                "prompts": prompts,
            },
            indent=1,
        )
    )
    plot(tables, out / "speedup.png", args.temperature)
    print("\n".join(md))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'speedup.png'}")
