"""EAGLE, EAGLE-2 and EAGLE-3 are lossless for ANY head: greedy output equals plain decoding token for
token, and sampled output is distributed exactly as plain sampling of the target, drafting every step
or self-gated (plain and speculative steps mixed under a forced cost table)."""

import dataclasses
import json

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.paths import MODELS
from support.tiny_target import assert_distributed_as, exact_joint, sampled_counts, tiny_engine

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.drafting.eagle3_head import Eagle3Head
from ace_mw.engine.drafting.eagle_head import EagleHead

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAINED_HEAD = MODELS / "ace-tiny-chat-eagle"
TRAINED_HEAD3 = MODELS / "ace-tiny-chat-eagle3"
SPECS = {
    "eagle_default_tree": SpecParams("eagle", self_gate=False),
    "eagle_custom_tree": SpecParams(
        "eagle", tree_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0]], self_gate=False
    ),
    "eagle_2_small_budget": SpecParams("eagle_2", num_speculative_tokens=4, total_tokens=6, self_gate=False),
    "eagle_2_large_budget": SpecParams("eagle_2", num_speculative_tokens=6, total_tokens=40, self_gate=False),
    "eagle_3_small_budget": SpecParams("eagle_3", num_speculative_tokens=4, total_tokens=6, self_gate=False),
    "eagle_3_large_budget": SpecParams("eagle_3", num_speculative_tokens=6, total_tokens=40, self_gate=False),
    "eagle_self_gated": SpecParams("eagle"),
    "eagle_2_self_gated": SpecParams("eagle_2"),
    "eagle_3_self_gated": SpecParams("eagle_3"),
}


def eval_prompts(n: int) -> list[list[dict]]:
    conversations = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:400]}] for c in conversations[:n]]


@pytest.fixture(scope="module")
def random_head_engine(tmp_path_factory):
    target_config = json.loads((MODELS / "ace-tiny-chat" / "config.json").read_text())
    torch.manual_seed(0)
    head_dir, head3_dir = tmp_path_factory.mktemp("random-head"), tmp_path_factory.mktemp("random-head3")
    EagleHead.for_target(target_config).save_pretrained(head_dir)
    draft_ids = torch.randperm(target_config["vocab_size"])[:2048]
    Eagle3Head.for_target(target_config, draft_ids.sort().values, taps=(1, 3, 5)).save_pretrained(head3_dir)
    return Engine.from_pretrained(
        MODELS / "ace-tiny-chat", eagle=[head_dir, head3_dir], max_context=1024, costs=ALTERNATING, compile_decode=False
    )


@pytest.fixture(scope="module")
def prompts():
    return eval_prompts(2)


@pytest.fixture(scope="module")
def plain_ids(random_head_engine, prompts):
    """Plain greedy decoding of the target (no head involved), computed once."""
    return [random_head_engine.generate(m, max_new_tokens=32).token_ids for m in prompts]


@pytest.mark.parametrize("name", SPECS)
def test_greedy_output_with_a_random_head_equals_plain_decoding(random_head_engine, prompts, plain_ids, name):
    fast = [random_head_engine.generate(m, max_new_tokens=32, speculative=SPECS[name]) for m in prompts]
    assert [f.token_ids for f in fast] == plain_ids
    assert all(f.stats.drafted > 0 for f in fast)


@pytest.fixture(scope="module")
def trained_head_engine():
    heads = [h for h in (TRAINED_HEAD, TRAINED_HEAD3) if h.exists()]
    if not heads:
        pytest.skip("no trained head is in models/ yet")
    return Engine.from_pretrained(
        MODELS / "ace-tiny-chat", eagle=heads, max_context=1024, costs=ALTERNATING, compile_decode=False
    )


@pytest.mark.parametrize("name", SPECS)
def test_greedy_output_with_the_trained_head_equals_plain_decoding_and_accepts_drafts(
    trained_head_engine, prompts, plain_ids, name
):
    if not trained_head_engine.runs(SPECS[name].algorithm):
        pytest.skip(f"no trained head for {SPECS[name].algorithm} in models/ yet")
    fast = [trained_head_engine.generate(m, max_new_tokens=32, speculative=SPECS[name]) for m in prompts]
    assert [f.token_ids for f in fast] == plain_ids
    assert sum(f.stats.accepted for f in fast) > 0


# --- sampling: a tiny vocabulary makes the drafts hit often, at every depth ------------------------


@pytest.fixture(scope="module")
def tiny_engines():
    """The same tiny target and heads in fp32 and in bf16."""
    return {dtype: tiny_engine(dtype) for dtype in (torch.float32, torch.bfloat16)}


SAMPLED = {
    "eagle": SpecParams("eagle", tree_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0]], self_gate=False),
    "eagle_2": SpecParams("eagle_2", num_speculative_tokens=3, total_tokens=8, self_gate=False),
    "eagle_3": SpecParams("eagle_3", num_speculative_tokens=3, total_tokens=8, self_gate=False),
}


# Self-gated: a step drafts while the request's acceptance so far says it pays under the forced cost
# table, so whether the second and third tokens are drafted depends on the first step.
SAMPLED |= {f"{name}_self_gated": dataclasses.replace(spec, self_gate=True) for name, spec in SAMPLED.items()}


# bf16: the reference is plain sampling of the same bf16 target; one case runs by default, the rest are slow.
@pytest.mark.parametrize(
    "name,dtype",
    [(n, torch.float32) for n in SAMPLED]
    + [pytest.param(n, torch.bfloat16, marks=[] if n == "eagle_3" else pytest.mark.slow) for n in SAMPLED],
    ids=lambda v: str(v).removeprefix("torch."),
)
# Floors on accepted drafts, and on trials accepting two in one step, so the rule is really exercised
# (a peaky T=0.7 target accepts a random head's drafts less often).
@pytest.mark.parametrize("temperature,top_p,min_accepted,min_deep", [(1.0, 1.0, 400, 10), (0.7, 0.9, 100, 0)])
def test_sampled_first_three_tokens_follow_the_target_distribution(
    tiny_engines, name, dtype, temperature, top_p, min_accepted, min_deep
):
    engine, spec = tiny_engines[dtype], SAMPLED[name]
    counts, accepted, deep, mixed = sampled_counts(engine, spec, temperature, top_p, trials=1000)
    if spec.self_gate:
        assert accepted > 0 and mixed > 0  # drafted steps, and trials that mixed them with plain ones
    else:
        assert accepted >= min_accepted and deep >= min_deep
    assert_distributed_as(counts, exact_joint(engine, temperature, top_p))
