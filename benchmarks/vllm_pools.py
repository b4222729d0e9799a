"""Benchmark: the closed loop against real vLLM pools and vLLM's own dynamic speculation, same run.

    python benchmarks/vllm_pools.py                       # 60 requests at one client, bursts of 1-8 twice
    python benchmarks/vllm_pools.py --requests 60 --per-client 3 --burst-rounds 2
    python benchmarks/vllm_pools.py --eager               # servers start in ~30 s instead of minutes

Starts vLLM 0.32 servers of the bundled model (`python -m ace_mw.demo.vllm build` first): plain,
prompt lookup, the shipped EAGLE-3 head and the draft model, each K = 4, and a prompt-lookup pool
with vLLM's `num_speculative_tokens_per_batch_size` schedule (K = 4 up to 2 running requests, off
from 3). Policies, taking turns: `adaptive` (ace-mw's load-aware speed policy over the four pools),
each static pool, and `vllm-dynamic` (see ace_mw/demo/vllm_run.py for the workload and the cores).
It prints aggregate output tokens/s per policy at one client and under bursts, the same-text count
against the plain pool, each tenant's best static pool against adaptive, and writes report.md and
report.json into --out. Targets (issue 39): adaptive >= 1.0x the best static pool and >= 1.0x
vLLM's dynamic speculation at one client and under bursts; no tenant below 0.95x its best static.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ace_mw.demo import vllm, vllm_report, vllm_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="requests at one client, each to every policy")
    parser.add_argument("--per-client", type=int, default=3, help="requests per client in each burst")
    parser.add_argument(
        "--burst-rounds", type=int, default=2, help="rounds of every burst size, the policies' order rotated each round"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--warm-requests",
        type=int,
        default=vllm_run.STEADY_WARM_UP,
        help="adaptive's warm-up: earlier traffic (3 rounds of each prompt)",
    )
    parser.add_argument("--eager", action="store_true", help="vLLM servers with --enforce-eager")
    parser.add_argument("--out", default="bench_out/vllm-pools")
    args = parser.parse_args()
    if vllm.python() is None:
        print(f"vLLM is not built here: {vllm.HOW_TO_GET}", file=sys.stderr)
        return 2
    data = vllm_report.run(
        Path(args.out),
        requests=args.requests,
        per_client=args.per_client,
        max_tokens=args.max_tokens,
        warm_requests=args.warm_requests,
        eager=args.eager,
        burst_rounds=args.burst_rounds,
    )
    print(vllm_report.table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
