"""The plain-PyTorch model against transformers, and its cache/mask mechanics."""

import json

import pytest
import torch
from safetensors.torch import save_file
from support.paths import MODELS

from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")

FIXTURE = MODELS / "ace-tiny-chat"
TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def fixture_pair():
    hf = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(FIXTURE)
    ours.setup_cache(256)
    return hf, ours


def ids(n, vocab=8192, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_prefill_logits_match_transformers_fp32(fixture_pair):
    hf, ours = fixture_pair
    x = ids(48)
    logits, _ = ours(x, torch.arange(48))
    torch.testing.assert_close(logits, hf(x).logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_hidden_is_the_final_post_norm_feature(fixture_pair):
    hf, ours = fixture_pair
    x = ids(16)
    _, hidden = ours(x, torch.arange(16))
    torch.testing.assert_close(hidden, hf(x, output_hidden_states=True).hidden_states[-1], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_cached_chain_after_prefix_matches_full_forward(fixture_pair):
    hf, ours = fixture_pair
    x = ids(40, seed=1)
    ours(x[:, :30], torch.arange(30))
    chain, _ = ours(x[:, 30:], torch.arange(30, 40))
    torch.testing.assert_close(chain, hf(x).logits[:, 30:], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_last_logits_only_returns_the_final_position(fixture_pair):
    _, ours = fixture_pair
    x = ids(12, seed=2)
    full, _ = ours(x, torch.arange(12))
    last, _ = ours(x, torch.arange(12), last_logits_only=True)
    assert last.shape == (1, 1, 8192)
    torch.testing.assert_close(last[0, 0], full[0, -1])


@torch.inference_mode()
def test_tree_forward_matches_each_branch_decoded_as_a_chain(fixture_pair):
    _, ours = fixture_pair
    prefix, (a, b, c) = ids(20, seed=3), ids(3, seed=4)[0].tolist()
    # Inputs: root r, then a (child of r), b (child of r), c (child of a). Branches r-a-c and r-b.
    root = 7
    tree = torch.tensor([[root, a, b, c]])
    positions = 20 + torch.tensor([0, 1, 1, 2])
    mask = torch.ones(4, 24, dtype=torch.bool)
    mask[:, 20:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    ours(prefix, torch.arange(20))
    tree_logits, _ = ours(tree, Step(positions, torch.arange(20, 24), mask, 24))
    branch_ac, _ = ours(torch.tensor([[root, a, c]]), torch.arange(20, 23))
    branch_b, _ = ours(torch.tensor([[root, b]]), torch.arange(20, 22))
    torch.testing.assert_close(tree_logits[0, [0, 1, 3]], branch_ac[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tree_logits[0, 2], branch_b[0, 1], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_moving_a_verified_path_makes_the_accepted_branch_a_contiguous_prefix(fixture_pair):
    _, ours = fixture_pair
    prefix = ids(20, seed=5)
    root, a, b, nxt = 7, 11, 13, 17
    ours(prefix, torch.arange(20))
    mask = torch.ones(3, 23, dtype=torch.bool)
    mask[:, 20:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    ours(torch.tensor([[root, a, b]]), Step(20 + torch.tensor([0, 1, 1]), torch.arange(20, 23), mask, 23))
    for cache in ours.caches:
        cache.move(0, torch.tensor([20, 22]), 20)  # accept root, b
    after, _ = ours(torch.tensor([[nxt]]), torch.tensor([22]))
    ours(prefix, torch.arange(20))
    reference, _ = ours(torch.tensor([[root, b, nxt]]), torch.arange(20, 23))
    torch.testing.assert_close(after[0, 0], reference[0, -1], atol=1e-5, rtol=1e-5)


def test_forward_before_setup_cache_raises():
    model = Transformer(ModelConfig.from_hf({**TINY, "model_type": "llama"}))
    with pytest.raises(RuntimeError, match="setup_cache"):
        model(torch.tensor([[1]]), torch.tensor([0]))


def test_unsupported_model_type_is_rejected():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf({**TINY, "model_type": "gpt2"})


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf({**TINY, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_missing_weights_raise_file_not_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        Transformer.from_pretrained(tmp_path)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
ARCHITECTURES = {
    "llama3_rope_untied": (
        transformers.LlamaConfig,
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "tie_word_embeddings": False},
    ),
    "llama_attention_bias": (transformers.LlamaConfig, {"attention_bias": True, "tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, {"head_dim": 16, "tie_word_embeddings": False}),
    "qwen2_qkv_bias": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
}


def random_hf_model(kind):
    config_cls, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra)).float().eval()
    for p in model.parameters():  # biases and norms start at 0 / 1: randomise so the test can fail
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
@torch.inference_mode()
def test_architecture_matches_transformers(kind, tmp_path):
    hf = random_hf_model(kind)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    ours.setup_cache(128)
    x = ids(80, vocab=97, seed=6)
    torch.testing.assert_close(ours(x, torch.arange(80))[0], hf(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["sharded_safetensors", "pytorch_model_bin"])
@torch.inference_mode()
def test_checkpoint_layouts_load_the_same_weights(layout, tmp_path):
    hf = random_hf_model("llama3_rope_untied")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    hf.config.to_json_file(tmp_path / "config.json")
    if layout == "pytorch_model_bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        names = sorted(state)
        shards = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
        for shard, keys in shards.items():
            save_file({k: state[k] for k in keys}, tmp_path / shard)
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = Transformer.from_pretrained(tmp_path)
    ours.setup_cache(64)
    x = ids(10, vocab=97, seed=7)
    torch.testing.assert_close(ours(x, torch.arange(10))[0], hf(x).logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_fused_projections_keep_the_checkpoint_names_and_follow_their_weights(tmp_path):
    """q/k/v and gate/up run as one product each; the checkpoint's weights stay views of them."""
    first, second = random_hf_model("qwen2_qkv_bias"), random_hf_model("qwen2_qkv_bias")
    for p in second.parameters():
        torch.nn.init.normal_(p, std=0.2)
    first.save_pretrained(tmp_path / "first")
    second.save_pretrained(tmp_path / "second")
    ours = Transformer.from_pretrained(tmp_path / "first")
    attention = ours.layers[0].self_attn
    assert attention.qkv is not None and attention.qkv_bias is not None and ours.layers[0].mlp.gate_up is not None
    assert {k for k in ours.state_dict() if "qkv" in k or "gate_up" in k} == set()
    ours.load_state_dict(Transformer.from_pretrained(tmp_path / "second").state_dict())
    ours.setup_cache(128)
    x = ids(40, vocab=97, seed=2)
    torch.testing.assert_close(ours(x, torch.arange(40))[0], second(x).logits, atol=1e-4, rtol=1e-4)
