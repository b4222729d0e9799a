"""Benchmark: one stream's decoding, plain or with prompt lookup, the in-process engine (eager, and
with its steps compiled) against llama.cpp's llama-server, same model, prompts and threads, in the
same run.

    python benchmarks/decode.py                        # 1 and 2 threads, fp32 against llama.cpp f32
    python benchmarks/decode.py --threads 1 --half     # also our bf16 against llama.cpp f16
    python benchmarks/decode.py --algorithm ngram      # prompt lookup: ours self-gated, llama.cpp ngram-simple

Each prompt (3 per held-out category) is decoded greedily for `--max-tokens` by llama.cpp and by
each of ours, in an order that rotates from prompt to prompt. The time per output token leaves
out the prompt and the first token on both sides: ours from the engine's stream (the prefill's
chunk, then the decode steps, as `engine.bench` times it), llama.cpp's own
`timings.predicted_ms / (predicted_n - 1)`: no HTTP in either. Prints per thread count, precision
and engine the median ms/token of each, ours against llama.cpp as a speed ratio (the median of the
per-prompt ratios of the same prompt's runs) and on how many prompts the greedy text is the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence

import httpx
import torch

from ace_mw.demo import llamacpp
from ace_mw.engine import Engine
from ace_mw.engine.bench.methods import engine_method
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

TARGET = MODELS_DIR / "ace-tiny-chat"
PROMPT_CHARS = 2000
LLAMA = "llama.cpp"

Decode = Callable[[str], tuple[float, str]]  # prompt -> (decode ms/token, text)


def llama_decoder(url: str, max_tokens: int) -> Decode:
    def decode(prompt: str) -> tuple[float, str]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status().json()
        timings = reply["timings"]
        ms = timings["predicted_ms"] / max(1, timings["predicted_n"] - 1)
        return ms, reply["choices"][0]["message"]["content"].strip()

    return decode


def engine_decoder(engine: Engine, max_tokens: int, algorithm: str) -> Decode:
    method = engine_method(engine, algorithm, self_gate=algorithm != "baseline")

    def decode(prompt: str) -> tuple[float, str]:
        run = method.decode("chat", [{"role": "user", "content": prompt}], max_tokens, 0.0, 0)
        return run.tpot_s * 1e3, engine.tokenizer.decode(run.tokens, skip_special_tokens=True).strip()

    return decode


def measure(decoders: dict[str, Decode], prompts: Sequence[str]) -> dict[str, list[tuple[float, str]]]:
    """Every decoder on every prompt, the order rotating by one each prompt."""
    names = list(decoders)
    runs: dict[str, list[tuple[float, str]]] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name].append(decoders[name](prompt))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-category", type=int, default=3)
    parser.add_argument("--half", action="store_true", help="also our bf16 against llama.cpp's f16 GGUF")
    parser.add_argument(
        "--algorithm",
        default="baseline",
        choices=("baseline", "ngram"),
        help="ngram: our self-gated prompt lookup against llama.cpp's ngram-simple (default: plain decoding)",
    )
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.max_tokens < 2 or args.prompts_per_category < 1:
        parser.error("--threads must be at least 1, --max-tokens at least 2, --prompts-per-category at least 1")
    chosen = load_prompts(args.prompts_per_category, fits=lambda text: len(text) <= PROMPT_CHARS)
    prompts = [text for texts in chosen.values() for text in texts]
    print(
        f"{args.algorithm}, {len(prompts)} prompts x {args.max_tokens} tokens, greedy, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}:"
    )
    print(f"{'threads':>7}  {'ours':<18} {'llama.cpp':<9} {'ours ms':>8} {'llama ms':>8} {'ours/llama':>10}  same text")
    for dtype, outtype in [("float32", "f32")] + ([("bfloat16", "f16")] if args.half else []):
        for threads in args.threads:
            torch.set_num_threads(threads)  # before compiling: the generated code keeps its threads
            engines = {
                f"{dtype} eager": Engine.from_pretrained(TARGET, dtype=dtype),
                f"{dtype} compiled": Engine.from_pretrained(TARGET, dtype=dtype, steps="compiled"),
            }
            spec = llamacpp.bundled_specs(threads=threads, outtype=outtype)[args.algorithm]
            with llamacpp.LlamaServer(spec) as server:
                decoders = {LLAMA: llama_decoder(server.url, args.max_tokens)}
                for name, engine in engines.items():
                    decoders[name] = engine_decoder(engine, args.max_tokens, args.algorithm)
                measure(decoders, prompts[:2])  # warm every one up
                runs = measure(decoders, prompts)
            llama = runs.pop(LLAMA)
            for name, ours in runs.items():
                ratio = statistics.median(theirs[0] / mine[0] for mine, theirs in zip(ours, llama, strict=True))
                same = sum(mine[1] == theirs[1] for mine, theirs in zip(ours, llama, strict=True))
                print(
                    f"{threads:>7}  {name:<18} {outtype:<9} {statistics.median(m for m, _ in ours):8.2f} "
                    f"{statistics.median(m for m, _ in llama):8.2f} {ratio:9.2f}x  {same}/{len(prompts)}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
