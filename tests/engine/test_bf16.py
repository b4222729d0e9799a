"""bf16: lossless up to floating-point numerics, the definition vLLM and SGLang use.

In bf16 a verify pass over several tokens runs other kernels than a one-token decode step, so two
near-tied logits can come out in either order and a speculative run can take the other branch.
What must hold, for every algorithm on held-out prompts:
- at least half of the prompts come out identical to the bf16 baseline;
- at the first token where an output leaves the baseline, both tokens sit within BF16_NEAR_TIE logits of
  the top of the fp32 reference at that position (a bug in acceptance would pick tokens far below).

The tolerance (near_ties.BF16_NEAR_TIE, 0.5 logits) is derived there from measured bf16 error.
(In fp32 the tests in test_engine_lossless.py demand token-for-token equality.)
"""

import json

import pytest
import torch
from support.near_ties import BF16_NEAR_TIE, assert_equal_up_to_ties
from support.paths import MODELS

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.drafting.eagle3_head import Eagle3Head
from ace_mw.engine.model.dtypes import bf16_pays, native_bf16, resolve_dtype
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.planning.batch import BatchCosts
from ace_mw.engine.planning.cost import CostCurve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = MODELS / "ace-tiny-chat"
EAGLE, EAGLE3 = MODELS / "ace-tiny-chat-eagle", MODELS / "ace-tiny-chat-eagle3"
N_PROMPTS, NEW_TOKENS = 8, 32
# Batched steps priced so that verifying and drafting pay: rows speculate whenever they can.
CHEAP = BatchCosts({b: CostCurve({1: 10.0 * b, 16: 10.0 * b + 1.5}) for b in (1, 2)})
CHEAP_LEVELS = BatchCosts({b: CostCurve({1: 0.5 * b, 16: 0.6 * b}) for b in (1, 2)})
SPECS = [
    SpecParams("ngram", self_gate=False),
    SpecParams("draft_model", self_gate=False),
    SpecParams("eagle", self_gate=False),
    SpecParams("eagle_2", total_tokens=12, self_gate=False),
    SpecParams("eagle_3", total_tokens=12, self_gate=False),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The fixture in bf16 with every drafter; a random EAGLE-3 head until a trained one is shipped
    (its drafts are rarely accepted, but every step still verifies a whole tree in bf16)."""
    head3 = EAGLE3
    if not (EAGLE3 / "config.json").exists():
        config = json.loads((TARGET / "config.json").read_text())
        head3 = tmp_path_factory.mktemp("head3")
        torch.manual_seed(0)
        Eagle3Head.for_target(config, torch.arange(0, 8192, 4), taps=(1, 3, 5)).save_pretrained(head3)
    return Engine.from_pretrained(
        TARGET, eagle=[EAGLE, head3], draft=MODELS / "ace-tiny-chat-draft", dtype=torch.bfloat16, max_context=1024
    )


@pytest.fixture(scope="module")
def reference():
    model = Transformer.from_pretrained(TARGET)
    model.setup_cache(1200)
    return model


@pytest.fixture(scope="module")
def prompts(engine):
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [engine._encode([{"role": "user", "content": c["turns"][0][1][:400]}]) for c in data[:N_PROMPTS]]


@pytest.fixture(scope="module")
def baseline(engine, prompts):
    return [engine.generate(engine.tokenizer.decode(p), max_new_tokens=NEW_TOKENS).token_ids for p in prompts]


def test_engine_runs_in_bf16(engine):
    assert engine.model.embed_tokens.weight.dtype == torch.bfloat16
    assert engine.drafts_with("eagle_3").fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.algorithm)
def test_bf16_output_equals_the_bf16_baseline_except_after_near_ties(engine, reference, prompts, baseline, spec):
    assert_equal_up_to_ties(engine, reference, prompts, baseline, spec, NEW_TOKENS, BF16_NEAR_TIE, min_identical=0.5)


def test_auto_dtype_is_bf16_exactly_where_bf16_pays():
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if bf16_pays("cpu") else torch.float32)
    assert bf16_pays("cpu") <= native_bf16("cpu")  # never bf16 where it would be emulated
    assert resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("spec", [None, SpecParams("ngram"), SpecParams("draft_model")], ids=str)
def test_bf16_batched_output_equals_the_bf16_baseline_except_after_near_ties(
    engine, reference, prompts, baseline, spec
):
    """Two rows at a time in bf16, against the one-row bf16 baseline: the same tolerance, prompt
    lookup and the draft model drafting per row."""
    batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=64, costs=CHEAP, draft_costs=CHEAP_LEVELS)
    assert_equal_up_to_ties(batch, reference, prompts, baseline, spec, NEW_TOKENS, BF16_NEAR_TIE, min_identical=0.5)
