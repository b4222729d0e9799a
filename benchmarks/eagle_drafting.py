"""What one EAGLE draft step costs next to the target's verify pass, by drafting precision and tree shape.

    python benchmarks/eagle_drafting.py [--head models/ace-tiny-chat-eagle] [--threads 1] [--context 300]

Prints a Markdown table: median milliseconds of one ``propose()`` (after 3 accepted tokens, as in
decoding) for full EAGLE-2 shapes (no frontier-mass floor, so every level is drafted) and EAGLE's
static tree, in fp32 and bf16, then the target's verify pass for the same number of tree tokens.
Drafting cost does not depend on the head's weights, so a random head is used when the trained one is absent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ace_mw.engine.drafting.drafters import Plan
from ace_mw.engine.drafting.eagle import Eagle2Drafter, EagleDrafter
from ace_mw.engine.drafting.eagle_head import EagleHead
from ace_mw.engine.model.transformer import Transformer

MODELS = Path(__file__).resolve().parent.parent / "models"
SHAPES = [(4, 4, 4), (8, 5, 10), (12, 5, 10), (16, 6, 10), (32, 6, 10), (60, 6, 10)]  # total, depth, top_k


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODELS / "ace-tiny-chat"))
    parser.add_argument("--head", default=str(MODELS / "ace-tiny-chat-eagle"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=300, help="tokens already in the caches")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = Transformer.from_pretrained(args.target)
    target.setup_cache(args.context + 256)
    ids = torch.randint(0, target.config.vocab_size, (args.context + 1,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, hidden = target(ids[None, :-1], torch.arange(args.context))
    hidden = hidden[0]

    def load_head(dtype):
        if Path(args.head).exists():
            return EagleHead.from_pretrained(args.head, dtype=dtype)
        return EagleHead.for_target(target.config).to(dtype).eval()

    def propose_ms(make_drafter, plan: Plan) -> tuple[float, int]:
        drafter = make_drafter()
        drafter.reset(ids, hidden)
        tree = drafter.propose(plan)

        def step():  # re-accept the last 3 pairs: same cache length every time
            drafter.committed -= 3
            drafter.accept(ids[-3:], hidden[-3:])
            drafter.propose(plan)

        return median_ms(step, args.repeats), tree.tokens.numel()

    print(
        f"threads {args.threads}, context {args.context}, head {'trained' if Path(args.head).exists() else 'random'}\n"
    )
    print("| drafter | tree tokens | fp32 propose ms | bf16 propose ms | target verify ms (tree + root) |")
    print("|---|---|---|---|---|")
    heads = {dtype: load_head(dtype) for dtype in (torch.float32, torch.bfloat16)}
    rows = [
        (
            f"eagle_2 total={t} depth={d} top_k={k}",
            lambda h, t=t, d=d, k=k: Eagle2Drafter(h, target, t, d, k, min_frontier_mass=0.0),
            Plan(t, d),
        )
        for t, d, k in SHAPES
    ]
    rows.append(("eagle (EAGLE-1 25-node tree)", lambda h: EagleDrafter(h, target, None), Plan(25, 5)))
    for name, make, plan in rows:
        fp32, n = propose_ms(lambda make=make: make(heads[torch.float32]), plan)
        bf16, _ = propose_ms(lambda make=make: make(heads[torch.bfloat16]), plan)
        q = n + 1
        pos = torch.arange(args.context, args.context + q)
        mask = torch.ones(q, args.context + q, dtype=torch.bool)
        with torch.inference_mode():
            verify = median_ms(lambda q=q, pos=pos, mask=mask: target(ids[None, :q], pos, attn_mask=mask), args.repeats)
        print(f"| {name} | {n} | {fp32:.2f} | {bf16:.2f} | {verify:.2f} |")


if __name__ == "__main__":
    main()
