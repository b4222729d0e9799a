"""EAGLE-3 head training: training-time test, draft vocabulary, target taps, checkpoints/resume.

Runs the real fixture target on a few short rows of real ShareGPT text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.paths import MODELS

from ace_mw.engine.drafting.eagle3_head import Eagle3Head
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.train.args import TrainArgs
from ace_mw.engine.train.data import ChatEncoder, PackedRows, draft_mask, load_eval_conversations, pack
from ace_mw.engine.train.loop import Trainer
from ace_mw.engine.train.recipes import FrozenTarget, StepMatches, draft_vocabulary, eagle3_loss, eagle3_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = MODELS / "ace-tiny-chat"


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(str(TARGET), "cpu")


@pytest.fixture(scope="module")
def rows():
    from transformers import AutoTokenizer

    _, convs = load_eval_conversations(str(MODELS / "chat_eval.json"))
    return pack(ChatEncoder(AutoTokenizer.from_pretrained(TARGET)), convs, seq_len=96, max_rows=4)


def tiny_args(tmp_path, **kw) -> TrainArgs:
    base = {
        "target": str(TARGET),
        "out": str(tmp_path / "head"),
        "arch": "eagle3",
        "steps": 4,
        "batch_size": 2,
        "seq_len": 32,
        "warmup": 1,
        "eval_every": 2,
        "eval_rows": 2,
        "final_eval_rows": 2,
        "ttt_steps": 3,
        "draft_vocab_size": 256,
        "dtype": "float32",
    }
    return TrainArgs(**{**base, **kw})


def test_target_taps_are_the_engine_models_layer_inputs(target, rows):
    model = Transformer.from_pretrained(TARGET)
    model.setup_cache(128)
    ids = rows.ids[:1, :40]
    final, tapped = target.tapped(ids, (1, 3, 5))
    with torch.inference_mode():
        _, engine_taps = model(ids, torch.arange(40), taps=(1, 3, 5))
        _, engine_final = model(ids, torch.arange(40))
    torch.testing.assert_close(engine_taps, tapped, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(engine_final, final, rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_is_the_most_frequent_assistant_tokens_in_id_order():
    ids = torch.tensor([[5, 7, 7, 9, 9, 9, 3, 3, 3, 3]])
    assistant = torch.tensor([[True] * 6 + [False] * 4])  # 3 is frequent but never assistant text
    vocab, coverage = draft_vocabulary(PackedRows(ids, assistant), vocab_size=12, size=2)
    assert vocab.tolist() == [7, 9]
    assert coverage == pytest.approx(5 / 6)


def test_a_few_steps_on_fixed_rows_lower_the_eagle3_loss(target, rows):
    torch.manual_seed(0)
    vocab, _ = draft_vocabulary(rows, 8192, 512)
    head = Eagle3Head.for_target(target.config.to_dict(), vocab, (1, 3, 5))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    ids, mask = rows.ids[:2, :64], draft_mask(rows.assistant[:2, :64])
    losses = []
    for _ in range(6):
        hidden, target_logits = eagle3_outputs(head, target, ids, steps=3)
        loss, found = eagle3_loss(hidden, target_logits, mask, head)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert [m.shape[1] for m in found.masks] == [63, 62, 61]


def test_chain_estimate_counts_leading_matching_steps():
    t = torch.tensor
    matches = [t([[True, True, False]]), t([[True, False]]), t([[False]])]
    masks = [t([[True, True, True]]), t([[True, True]]), t([[True]])]
    # only position 0 has room for all three steps: steps 0 and 1 match, step 2 does not
    assert StepMatches(matches, masks).chain_tau() == (3.0, 1)


def test_training_autocasts_to_bf16_only_where_bf16_pays(tmp_path):
    from ace_mw.engine.model.dtypes import bf16_pays

    trainer = Trainer(tiny_args(tmp_path, dtype="auto", steps=1))
    assert trainer.compute_dtype == (torch.bfloat16 if bf16_pays("cpu") else torch.float32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = Trainer(tiny_args(tmp_path_factory.mktemp("whole")))
    return trainer, *trainer.train()


def test_training_writes_a_published_layout_eagle3_head(trained):
    trainer, top1, positions = trained
    out = Path(trainer.args.out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (512, 3 * 512)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (512, 2 * 512)
    assert {"d2t", "t2d", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight"} <= names
    assert "embed_tokens.weight" not in names
    head = Eagle3Head.from_pretrained(out)
    for name, value in trainer.head.state_dict().items():
        torch.testing.assert_close(head.state_dict()[name], value)
    text = (out / "PROVENANCE.md").read_text()
    assert f"{top1:.4f}" in text and "chain" in text
    assert positions > 0


def test_resumed_eagle3_run_ends_with_the_same_head_as_an_uninterrupted_one(trained, tmp_path):
    first = Trainer(tiny_args(tmp_path))
    assert first.train(stop_at=2) is None
    resumed = Trainer(tiny_args(tmp_path, resume=True))
    assert resumed.progress.step == 2
    resumed.train()
    for name, value in trained[0].head.state_dict().items():
        torch.testing.assert_close(resumed.head.state_dict()[name], value)


def test_resume_with_another_draft_vocabulary_is_refused(trained, tmp_path):
    import dataclasses

    with pytest.raises(ValueError, match="draft_vocab_size"):
        Trainer(dataclasses.replace(trained[0].args, draft_vocab_size=128, resume=True))


def test_package_ships_a_bf16_copy_with_hash_and_engine_measurement(trained, tmp_path):
    import hashlib

    from ace_mw.engine.train.package import main as package

    out = tmp_path / "shipped"
    package(["--head", trained[0].args.out, "--out", str(out), "--prompts", "1", "--max-new-tokens", "8"])
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    text = (out / "PROVENANCE.md").read_text()
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() in text
    assert "tokens per target step" in text and "identical to plain decoding on 1/1" in text
    assert "held-out top-1" in text.lower()  # the training provenance comes along
