"""What the batching tests share (test_batching.py, test_batch_steps.py, test_prefix_caching.py):
the fixture engine with every drafter, a small batch of it, held-out conversations, and a way to
run calls at once."""

import json
import threading

from ace_mw.engine import Engine
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.planning.batch import BatchCosts
from ace_mw.engine.planning.cost import CostCurve
from support.engine_costs import ALTERNATING
from support.paths import MODELS

TARGET, DRAFT = MODELS / "ace-tiny-chat", MODELS / "ace-tiny-chat-draft"
HEADS = [MODELS / "ace-tiny-chat-eagle", MODELS / "ace-tiny-chat-eagle3"]  # EAGLE-1/2 and EAGLE-3

# Verifying a draft token costs next to nothing: every fresh row drafts what its lookup found, and
# an EAGLE row's head (ALTERNATING's: a level 1 ms, a twentieth of a step) drafts from the start.
CHEAP_DRAFTS = BatchCosts({b: CostCurve({1: 20.0 * b, 16: 20.0 * b + 1.5}) for b in (1, 2, 4, 8)})
# And a draft model's level costs a twentieth of a target step.
CHEAP_DRAFT_MODEL = BatchCosts({b: CostCurve({1: 0.5 * b, 16: 0.6 * b}) for b in (1, 2, 4, 8)})


def every_drafter() -> Engine:
    """The fixture target with the draft model and both EAGLE heads, eager, on the alternating costs."""
    return Engine.from_pretrained(TARGET, draft=DRAFT, eagle=HEADS, costs=ALTERNATING, compile_decode=False)


def small_batch(engine: Engine) -> BatchEngine:
    """Four rows, 16-token prompt chunks, drafts priced cheap."""
    return BatchEngine(engine, max_num_seqs=4, prefill_chunk=16, costs=CHEAP_DRAFTS, draft_costs=CHEAP_DRAFT_MODEL)


def held_out_conversations() -> list[list[dict]]:
    """Ten one-turn conversations of chat_eval.json, their first 300 characters."""
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:300]}] for c in data[:10]]


def run_concurrently(calls):
    """Run each zero-argument call in its own thread; their results in order."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results
