"""Static-shape steps (what CUDA graphs replay on a GPU), run eagerly on the CPU: padding, the
full-cache mask, and losslessness of every algorithm through them."""

import json

import pytest
import torch
from support.paths import MODELS

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.model.graphs import BUCKETS, StaticHeadStep, StaticTarget, bucket
from ace_mw.engine.model.step import Step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALGORITHMS = ["ngram", "draft_model", "eagle", "eagle_2", "eagle_3"]


def test_query_counts_pad_up_to_a_bucket():
    assert [bucket(q) for q in (1, 2, 3, 9, 128)] == [1, 2, 4, 16, 128]
    assert bucket(BUCKETS[-1] + 1) is None


def test_padded_rows_take_free_slots_and_see_only_themselves():
    tree_mask = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    positions, slots = torch.tensor([5, 6, 6]), torch.tensor([5, 6, 7])
    padded = Step(positions, slots, tree_mask, kv_len=3).padded(4, 12)
    pos, full_slots, mask = padded.positions, padded.slots, padded.mask
    assert padded.kv_len == 12 and mask is not None
    assert full_slots.tolist() == [5, 6, 7, 8] and pos.tolist() == [5, 6, 6, 6]
    assert torch.equal(mask[:3, :3], tree_mask) and not mask[:3, 3:].any()
    assert mask[3].nonzero().flatten().tolist() == [8]


def test_causal_rows_see_the_cache_up_to_their_own_slot():
    mask = Step(torch.tensor([3]), torch.tensor([3]), None, kv_len=4).padded(2, 6).mask
    assert mask is not None and mask[0].tolist() == [True, True, True, True, False, False]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Plain and static-shape engines over the same weights (random EAGLE-3 head unless one is shipped)."""
    from ace_mw.engine.drafting.eagle3_head import Eagle3Head

    head3 = MODELS / "ace-tiny-chat-eagle3"
    if not (head3 / "config.json").exists():
        head3 = tmp_path_factory.mktemp("head3")
        config = json.loads((MODELS / "ace-tiny-chat" / "config.json").read_text())
        torch.manual_seed(0)
        Eagle3Head.for_target(config, torch.arange(0, 8192, 4), taps=(1, 3, 5)).save_pretrained(head3)
    kwargs = {"eagle": [MODELS / "ace-tiny-chat-eagle", head3], "draft": MODELS / "ace-tiny-chat-draft"}
    plain = Engine.from_pretrained(MODELS / "ace-tiny-chat", max_context=1024, **kwargs)
    static = Engine.from_pretrained(MODELS / "ace-tiny-chat", max_context=1024, steps="static", **kwargs)
    return plain, static


@pytest.fixture(scope="module")
def prompts():
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:400]}] for c in data[:4]]


def test_static_shapes_are_off_on_the_cpu_unless_asked(engines):
    plain, static = engines
    assert plain.step_model is plain.model
    assert isinstance(static.step_model, StaticTarget) and not static.step_model.runner.use_graphs


@pytest.mark.parametrize("algorithm", ["baseline", *ALGORITHMS])
def test_static_shape_steps_decode_exactly_like_plain_ones(engines, prompts, algorithm):
    plain, static = engines
    spec = None if algorithm == "baseline" else SpecParams(algorithm, self_gate=False)
    for messages in prompts:
        expected = plain.generate(messages, max_new_tokens=24).token_ids
        assert static.generate(messages, max_new_tokens=24, speculative=spec).token_ids == expected


def test_a_static_head_step_equals_the_plain_one(engines):
    _, static = engines
    head = static.drafts_with("eagle_3")
    step = head.static_step()
    assert isinstance(step, StaticHeadStep) and step is head.static_step()
    head.setup_drafting(static.step_model, static.model.max_seq_len + 64)
    feats = torch.randn(1, 3, 3 * 512)
    ids, slots = torch.tensor([[5, 6, 7]]), torch.arange(3)
    with torch.inference_mode():
        plain = head.step(feats, ids, static.model.embed_tokens, Step(slots, slots, None, 3))
        padded = step(feats, ids, static.model.embed_tokens, Step(slots, slots, None, 3))
    # A bf16 head: GEMMs of other shapes round differently, by up to one bf16 ulp (8 significant
    # bits) at the output's largest magnitude; a real difference in what is computed is far larger.
    ulp = 2.0 ** (int(torch.log2(plain.abs().max().float())) - 7)
    torch.testing.assert_close(padded, plain, rtol=2e-2, atol=max(ulp, 2e-2))
