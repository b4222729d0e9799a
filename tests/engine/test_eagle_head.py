import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ace_mw.engine.bench.methods import module_bytes
from ace_mw.engine.drafting.drafters import Plan
from ace_mw.engine.drafting.eagle import Eagle2Drafter, EagleDrafter
from ace_mw.engine.drafting.eagle_head import EagleHead, EagleHeadConfig, drafting_dtype
from ace_mw.engine.drafting.tree import EAGLE1_TREE, StaticTree, VerifyLayout
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}
PUBLISHED_NAMES = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture
def head():
    torch.manual_seed(0)
    return EagleHead.for_target(TINY).eval()


@pytest.fixture
def embed():
    torch.manual_seed(1)
    return torch.nn.Embedding(TINY["vocab_size"], TINY["hidden_size"])


def inputs(t=6, b=1, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, TINY["hidden_size"], generator=gen), torch.randint(0, 100, (b, t), generator=gen)


def test_for_target_takes_the_target_shape_with_one_layer():
    head = EagleHead.for_target(ModelConfig.from_hf(TINY))
    assert head.fc.in_features == 128 and head.fc.out_features == 64
    assert len(head.layers) == 1
    assert head.config.vocab_size == 100


def test_state_dict_uses_published_names_without_input_layernorm(head):
    assert set(head.state_dict()) == PUBLISHED_NAMES | {"fc.bias"}


def test_head_without_bias_has_no_fc_bias():
    assert set(EagleHead.for_target(TINY, bias=False).state_dict()) == PUBLISHED_NAMES


def test_save_pretrained_writes_llama_config_and_safetensors(head, tmp_path):
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is True
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLISHED_NAMES | {"fc.bias"}


def test_safetensors_round_trip_gives_identical_outputs(head, embed, tmp_path):
    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path)
    feats, ids = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(feats, ids, embed), head(feats, ids, embed))
    assert loaded.config == head.config


def test_pytorch_model_bin_with_bias_and_embedding_copy_loads(head, embed, tmp_path):
    state = {**head.state_dict(), "embed_tokens.weight": torch.randn(100, 64)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1, "bias": True}))
    loaded = EagleHead.from_pretrained(tmp_path)
    feats, ids = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(feats, ids, embed), head(feats, ids, embed))


def test_fc_bias_is_read_from_the_weights_when_config_omits_it(tmp_path):
    head = EagleHead.for_target(TINY, bias=False)
    torch.save(head.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1}))
    assert EagleHead.from_pretrained(tmp_path).fc.bias is None


def test_from_pretrained_casts_to_requested_dtype(head, tmp_path):
    head.save_pretrained(tmp_path)
    assert EagleHead.from_pretrained(tmp_path, dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


def test_checkpoint_with_foreign_weights_raises_value_error(head, tmp_path):
    torch.save({**head.state_dict(), "midlayer.hidden_norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="published format"):
        EagleHead.from_pretrained(tmp_path)


def test_config_from_dict_reads_transformers5_rope_parameters():
    d = {k: v for k, v in TINY.items() if k != "rope_theta"}
    config = EagleHeadConfig.from_dict({**d, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})
    assert config.rope_theta == 500000.0
    assert config.bias is True


def test_drafting_dtype_keeps_a_reduced_precision_target_as_is():
    assert drafting_dtype("cpu", torch.float16) == torch.float16


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_drafting_dtype_of_an_fp32_cpu_target_is_bf16_exactly_where_the_cpu_has_bf16_instructions():
    """The expectation comes from the CPU's own flags, not from the check the code makes: with
    bf16 dot-product instructions (avx512_bf16, amx_bf16) the head drafts in bf16; without any
    AVX-512 it stays fp32. AVX-512 without bf16 instructions (oneDNN emulates bf16) is left open."""
    flags = cpu_flags()
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert drafting_dtype("cpu", torch.float32) == torch.bfloat16
    elif flags and not any(flag.startswith("avx512") for flag in flags):
        assert drafting_dtype("cpu", torch.float32) == torch.float32
    else:
        pytest.skip("no /proc/cpuinfo, or AVX-512 without bf16 instructions: no independent expectation")


def test_forward_is_causal(head, embed):
    feats, ids = inputs()
    feats2, ids2 = feats.clone(), ids.clone()
    feats2[:, 4:] += 1.0
    ids2[:, 4:] = (ids2[:, 4:] + 1) % 100
    with torch.no_grad():
        a, b = head(feats, ids, embed), head(feats2, ids2, embed)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_forward_runs_past_max_position_embeddings(head, embed):
    feats, ids = inputs(t=TINY["max_position_embeddings"] + 8)
    with torch.no_grad():
        assert head(feats, ids, embed).shape == feats.shape


def test_forward_batches_rows_independently(head, embed):
    feats, ids = inputs(b=2)
    with torch.no_grad():
        both = head(feats, ids, embed)
        second = head(feats[1:], ids[1:], embed)
    assert torch.allclose(both[1:], second, atol=1e-5)


def test_cached_steps_match_the_teacher_forced_pass(head, embed, target):
    feats, ids = inputs(t=6)
    head.setup_drafting(target, 16)
    with torch.no_grad():
        full = head(feats, ids, embed)
        first = head.step(feats[:, :4], ids[:, :4], embed, Step(torch.arange(4), torch.arange(4), None, 4))
        nxt = [
            head.step(
                feats[:, t : t + 1], ids[:, t : t + 1], embed, Step(torch.tensor([t]), torch.tensor([t]), None, t + 1)
            )
            for t in (4, 5)
        ]
    assert torch.allclose(torch.cat([first, *nxt], dim=1), full, atol=1e-5)


def test_tree_step_with_mask_matches_each_branch_alone(head, embed, target):
    feats, ids = inputs(t=5)
    head.setup_drafting(target, 16)
    with torch.no_grad():
        head.step(feats[:, :3], ids[:, :3], embed, Step(torch.arange(3), torch.arange(3), None, 3))
        # two sibling nodes at position 3 in slots 3 and 4: each sees the prefix and itself only
        mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
        tree = head.step(feats[:, 3:5], ids[:, 3:5], embed, Step(torch.tensor([3, 3]), torch.tensor([3, 4]), mask, 5))
        branch_a = head(feats[:, :4], ids[:, :4], embed)[:, 3]
        branch_b = head(torch.cat([feats[:, :3], feats[:, 4:5]], 1), torch.cat([ids[:, :3], ids[:, 4:5]], 1), embed)[
            :, 3
        ]
    assert torch.allclose(tree[0, 0], branch_a[0], atol=1e-5)
    assert torch.allclose(tree[0, 1], branch_b[0], atol=1e-5)


# --- drafters -------------------------------------------------------------------------------------


@pytest.fixture
def target():
    torch.manual_seed(3)
    model = Transformer(ModelConfig.from_hf(TINY)).eval()
    model.setup_cache(48)
    return model


def history(length=9, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (length + 1,), generator=gen), torch.randn(length, 64, generator=gen)


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def reference_logprobs(head, target, ids, feats, path_tokens):
    """Teacher-forced head passes along one path: log-probs of the next token after each path prefix."""
    feats, pairs_ids = feats.clone(), ids[1:].clone()
    out = []
    with torch.no_grad():
        for i in range(len(path_tokens) + 1):
            pred = head(feats[None], pairs_ids[None], target.embed_tokens)[0, -1]
            out.append(torch.log_softmax(target.lm_head(pred), -1))
            if i < len(path_tokens):
                feats = torch.cat([feats, pred[None]])
                pairs_ids = torch.cat([pairs_ids, torch.tensor([path_tokens[i]])])
    return out


def test_static_drafter_takes_the_ranked_token_along_every_path(head, target):
    ids, feats = history()
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 2]]
    drafter = EagleDrafter(head, target, choices)
    drafter.reset(ids, feats)
    draft = drafter.propose(Plan(7, 3))
    tree = StaticTree.from_choices(choices)
    assert draft.parents.tolist() == tree.parents.tolist()
    parents, tokens = draft.parents.tolist(), draft.tokens.tolist()
    for node in range(len(tree)):
        path = path_to(node, parents)
        logp = reference_logprobs(head, target, ids, feats, [tokens[p] for p in path[:-1]])[-1]
        assert tokens[node] == int(torch.topk(logp, 3).indices[int(tree.ranks[node])])


def test_static_drafter_defaults_to_the_eagle1_tree(head, target):
    ids, feats = history()
    drafter = EagleDrafter(head, target)
    drafter.reset(ids, feats)
    assert drafter.propose(Plan(25, 5)).parents.tolist() == StaticTree.from_choices(EAGLE1_TREE).parents.tolist()


def test_static_drafter_grows_only_the_levels_a_plan_asks_for(head, target):
    ids, feats = history()
    full, cut = EagleDrafter(head, target), EagleDrafter(head, target)
    full.reset(ids, feats)
    cut.reset(ids, feats)
    whole, two_levels = full.propose(Plan(25, 5)), cut.propose(Plan(12, 2))
    assert two_levels.tokens.numel() == 12  # EAGLE-1's tree has 4 nodes at depth 1 and 8 at depth 2
    assert torch.equal(two_levels.tokens, whole.tokens[:12]) and torch.equal(two_levels.parents, whole.parents[:12])


@pytest.mark.parametrize("total,depth,top_k", [(10, 4, 3), (1, 3, 2), (200, 3, 4), (16, 1, 5)])
def test_dynamic_drafter_tree_is_valid_and_within_budget(head, target, total, depth, top_k):
    ids, feats = history()
    drafter = Eagle2Drafter(head, target, total_tokens=total, depth=depth, top_k=top_k, min_frontier_mass=0.0)
    drafter.reset(ids, feats)
    draft = drafter.propose(Plan(total, depth))
    assert draft.q is None
    assert draft.tokens.numel() == min(total, top_k + (depth - 1) * top_k * top_k)
    layout = VerifyLayout.from_parents(draft.parents)  # raises unless parents precede children
    assert int(layout.positions.max()) <= depth
    for siblings in layout.children:
        toks = [int(draft.tokens[c - 1]) for c in siblings]
        assert len(toks) == len(set(toks))


def test_dynamic_drafter_scores_are_cumulative_path_logprobs_and_fall_along_paths(head, target):
    ids, feats = history()
    drafter = Eagle2Drafter(head, target, total_tokens=12, depth=4, top_k=3, min_frontier_mass=0.0)
    drafter.reset(ids, feats)
    draft = drafter.propose(Plan(12, 4))
    parents, tokens = draft.parents.tolist(), draft.tokens.tolist()
    scores = []
    for node in range(len(tokens)):
        path = [tokens[p] for p in path_to(node, parents)]
        logps = reference_logprobs(head, target, ids, feats, path[:-1])
        scores.append(sum(float(lp[t]) for lp, t in zip(logps, path, strict=True)))
        assert tokens[node] in torch.topk(logps[-1], 3).indices.tolist()
    for node, p in enumerate(parents):
        if p >= 0:
            assert scores[node] <= scores[p] + 1e-5


def reference_eagle2(head, target, ids, feats, total, depth, k):
    """EAGLE-2 by the book, one teacher-forced pass per node: (tokens, parents) of the kept tree."""
    tokens, scores, parents, paths = [], [], [], []
    root = reference_logprobs(head, target, ids, feats, [])[-1]
    top = torch.topk(root, k)
    for t, s in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        tokens.append(t), scores.append(s), parents.append(-1), paths.append([t])
    frontier = list(range(k))
    for _ in range(depth - 1):
        start = len(tokens)
        for node in frontier:
            logp = reference_logprobs(head, target, ids, feats, paths[node])[-1]
            top = torch.topk(logp, k)
            for t, s in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                tokens.append(t), scores.append(scores[node] + s), parents.append(node), paths.append(paths[node] + [t])
        level = list(range(start, len(tokens)))
        frontier = sorted(level, key=lambda i: -scores[i])[:k]
    kept = sorted(sorted(range(len(tokens)), key=lambda i: -scores[i])[:total])
    index = {c: i for i, c in enumerate(kept)}
    return [tokens[c] for c in kept], [index.get(parents[c], -1) for c in kept]


@pytest.mark.parametrize("total", [1, 4, 9, 30])
def test_dynamic_drafter_matches_eagle2_by_the_book(head, target, total):
    ids, feats = history()
    drafter = Eagle2Drafter(head, target, total_tokens=total, depth=3, top_k=3, min_frontier_mass=0.0)
    drafter.reset(ids, feats)
    draft = drafter.propose(Plan(total, 3))
    assert (draft.tokens.tolist(), draft.parents.tolist()) == reference_eagle2(head, target, ids, feats, total, 3, 3)


@pytest.mark.parametrize("budget,depth", [(1, 1), (2, 3), (3, 2), (9, 3)])
def test_dynamic_drafter_runs_a_smaller_plan_as_a_drafter_sized_for_it(head, target, budget, depth):
    ids, feats = history()
    large = Eagle2Drafter(head, target, total_tokens=30, depth=4, top_k=3, min_frontier_mass=0.0)
    large.reset(ids, feats)
    large.propose(Plan(30, 4))  # leaves its buffers dirty, as a previous step would
    large.accept(ids[-1:], feats[-1:])
    exact = Eagle2Drafter(head, target, total_tokens=budget, depth=depth, top_k=3, min_frontier_mass=0.0)
    exact.reset(ids, feats)
    exact.propose(Plan(budget, depth))
    exact.accept(ids[-1:], feats[-1:])
    small, reference = large.propose(Plan(budget, depth)), exact.propose(Plan(budget, depth))
    assert torch.equal(small.tokens, reference.tokens) and torch.equal(small.parents, reference.parents)


def test_dynamic_drafter_stops_at_a_frontier_below_the_mass_floor(head, target):
    ids, feats = history()
    drafter = Eagle2Drafter(head, target, total_tokens=12, depth=4, top_k=3, min_frontier_mass=1.01)
    drafter.reset(ids, feats)
    draft = drafter.propose(Plan(12, 4))
    assert draft.parents.tolist() == [-1, -1, -1]  # the root's children hold less than all the mass


def test_drafting_state_stays_out_of_the_checkpoint(head, target, tmp_path):
    head.to(torch.bfloat16).setup_drafting(target, 32)
    head.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLISHED_NAMES | {"fc.bias"}
    assert not any(p is target.lm_head.weight for p in head.parameters())


def test_drafting_counts_its_own_lm_head_copy_and_cache_as_head_memory(head, target):
    """What the benchmark's memory column counts for the head grows by exactly a bf16 lm_head
    (vocab x hidden) and a bf16 KV cache for 32 positions (keys and values of its one layer)."""
    head.to(torch.bfloat16)
    before = module_bytes(head)
    head.setup_drafting(target, 32)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    lm_head = TINY["vocab_size"] * TINY["hidden_size"] * 2
    cache = 2 * TINY["num_key_value_heads"] * 32 * head_dim * 2
    assert module_bytes(head) - before == lm_head + cache


@pytest.mark.parametrize("drafted", [True, False], ids=["proposals between", "plain steps between"])
def test_head_cache_drops_the_tree_and_extends_with_confirmed_pairs(head, target, drafted):
    ids, feats = history(length=12)
    plan = Plan(10, 4)
    stepped = Eagle2Drafter(head, target, total_tokens=10, depth=4, top_k=3)
    stepped.reset(ids[:7], feats[:6])
    stepped.propose(plan)
    # Two drafted steps emitting three tokens each, or six plain steps of one token (no proposal):
    # the next proposal catches up on whatever the head has not seen yet.
    chunks = [(7, 10), (10, 13)] if drafted else [(i, i + 1) for i in range(7, 13)]
    for i, (first, end) in enumerate(chunks):
        if drafted and i:
            stepped.propose(plan)
        stepped.accept(ids[first:end], feats[first - 1 : end - 1])
    after_steps = stepped.propose(plan)
    fresh = Eagle2Drafter(head, target, total_tokens=10, depth=4, top_k=3)
    fresh.reset(ids, feats)
    at_once = fresh.propose(plan)
    assert stepped.committed == fresh.committed == 12
    assert torch.equal(after_steps.tokens, at_once.tokens)
    assert torch.equal(after_steps.parents, at_once.parents)


def test_dynamic_drafter_rejects_empty_budget(head, target):
    with pytest.raises(ValueError, match="total_tokens"):
        Eagle2Drafter(head, target, total_tokens=0)
