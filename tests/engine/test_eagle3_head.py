"""EAGLE-3 heads in the published layout: names and shapes, the loading rules (format, target
layers), rejection of heads that do not fit the target, and the draft-vocabulary mapping."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.paths import MODELS

from ace_mw.config import AceConfig
from ace_mw.directive import ALGORITHMS
from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.drafting.drafters import Plan
from ace_mw.engine.drafting.eagle import Eagle2Drafter
from ace_mw.engine.drafting.eagle3_head import Eagle3Head, default_taps, is_eagle3_config, load_draft_head
from ace_mw.engine.drafting.eagle_head import EagleHead
from ace_mw.engine.model.transformer import ModelConfig, Transformer
from ace_mw.engine.params import EngineError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}
DRAFT_IDS = torch.arange(0, 100, 3)  # 34 of the 100 target tokens
PUBLISHED = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture
def head():
    torch.manual_seed(0)
    return Eagle3Head.for_target(TINY, DRAFT_IDS, taps=(1, 3, 5)).eval()


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(3)
    model = Transformer(ModelConfig.from_hf(TINY)).eval()
    model.setup_cache(96)
    return model


def test_state_dict_has_the_published_names_and_shapes(head):
    state = head.state_dict()
    assert set(state) == PUBLISHED
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)  # [embedding ; hidden]
    assert state["midlayer.self_attn.k_proj.weight"].shape == (32, 2 * 64)
    assert state["lm_head.weight"].shape == (34, 64)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool


def test_d2t_maps_draft_ids_back_and_t2d_marks_them(head):
    assert head.to_target(torch.arange(34)).tolist() == DRAFT_IDS.tolist()
    assert head.t2d.nonzero().flatten().tolist() == DRAFT_IDS.tolist()


def test_saved_head_is_told_apart_from_an_eagle1_head_and_round_trips(head, tmp_path):
    head.save_pretrained(tmp_path / "e3")
    EagleHead.for_target(TINY).save_pretrained(tmp_path / "e1")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 34
    assert is_eagle3_config(config)
    assert not is_eagle3_config(json.loads((tmp_path / "e1" / "config.json").read_text()))
    mc = ModelConfig.from_hf(TINY)
    assert isinstance(load_draft_head(tmp_path / "e1", mc), EagleHead)
    loaded = load_draft_head(tmp_path / "e3", mc)
    assert isinstance(loaded, Eagle3Head) and loaded.taps == (1, 3, 5)
    for name, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)


def published_copy(head: Eagle3Head, path: Path, drop_taps: bool = True, layer_prefix: str = "midlayer.") -> None:
    """The head as a third party might ship it: no layer ids in the config, an embedding copy,
    possibly ``layers.0.`` instead of ``midlayer.``."""
    head.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if drop_taps:
        config.pop("eagle_config")
    (path / "config.json").write_text(json.dumps(config))
    state = load_file(path / "model.safetensors")
    state = {k.replace("midlayer.", layer_prefix): v for k, v in state.items()}
    state["embed_tokens.weight"] = torch.zeros(100, 64)
    save_file(state, path / "model.safetensors")


def test_a_head_that_names_no_layers_reads_the_common_low_mid_high_default(head, tmp_path):
    published_copy(head, tmp_path, layer_prefix="layers.0.")
    loaded = load_draft_head(tmp_path, ModelConfig.from_hf(TINY))
    assert loaded.taps == default_taps(6) == (2, 3, 3)
    torch.testing.assert_close(loaded.midlayer.mlp.up_proj.weight, head.midlayer.mlp.up_proj.weight)


def test_layer_ids_are_read_from_the_top_level_too(head, tmp_path):
    published_copy(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [0, 2, 4]}))
    assert load_draft_head(tmp_path, ModelConfig.from_hf(TINY)).taps == (0, 2, 4)


@pytest.mark.parametrize(
    "change,tensor",
    [({"hidden_size": 96, "num_attention_heads": 6}, "fc.weight"), ({"vocab_size": 120}, "t2d")],
)
def test_a_head_for_another_target_is_rejected_naming_the_tensor(head, tmp_path, change, tensor):
    head.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{tensor} is \["):
        load_draft_head(tmp_path, ModelConfig.from_hf({**TINY, **change}))


def test_layer_ids_beyond_the_target_are_rejected(head, tmp_path):
    head.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="outside 0..3"):
        load_draft_head(tmp_path, ModelConfig.from_hf({**TINY, "num_hidden_layers": 4}))


def test_an_eagle1_head_for_another_hidden_size_is_rejected_naming_fc(tmp_path):
    EagleHead.for_target({**TINY, "hidden_size": 96, "num_attention_heads": 6}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"fc.weight is \[96, 192\]"):
        load_draft_head(tmp_path, ModelConfig.from_hf(TINY))


def test_drafted_tree_holds_only_draft_vocabulary_tokens(head, target):
    drafter = Eagle2Drafter(head, target, total_tokens=20, depth=4, top_k=5, min_frontier_mass=0.0)
    ids = torch.randint(0, 100, (9,))
    with torch.inference_mode():
        _, feats = target(ids[None, :8], torch.arange(8), taps=head.taps)
    drafter.reset(ids, feats[0])
    tree = drafter.propose(Plan(20, 4))
    assert tree.tokens.numel() == 20
    assert bool(head.t2d[tree.tokens].all())


def test_eagle_3_is_an_algorithm_the_control_plane_can_ask_for():
    assert "eagle_3" in ALGORITHMS
    assert AceConfig.from_dict({"speculative": {"algorithm": "eagle_3"}}).speculative.algorithm == "eagle_3"


def test_eagle_3_without_an_eagle3_head_is_a_clear_error():
    engine = Engine.from_pretrained(
        MODELS / "ace-tiny-chat", eagle=MODELS / "ace-tiny-chat-eagle", compile_decode=False
    )
    with pytest.raises(EngineError, match="needs an EAGLE-3 head"):
        engine.generate("Hi", max_new_tokens=2, speculative=SpecParams("eagle_3"))
