import pytest
import torch

from ace_mw.engine.drafting.tree import (
    EAGLE1_TREE,
    StaticTree,
    VerifyLayout,
    longest_greedy_path,
    rerank,
    retrieve_paths,
    topk_children,
)


def small_tree() -> StaticTree:
    # root -> a(0), b(1); a -> c(0,0), d(0,1); c -> e(0,0,0)
    return StaticTree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])


def test_static_tree_parents_follow_paths():
    tree = small_tree()
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]
    assert tree.ranks.tolist() == [0, 1, 0, 1, 0]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]


def test_static_tree_orders_choices_by_depth_whatever_the_input_order():
    shuffled = StaticTree.from_choices([[0, 0, 0], [0, 1], [1], [0, 0], [0]])
    assert shuffled.parents.tolist() == small_tree().parents.tolist()


def test_static_tree_expands_only_nodes_with_children():
    tree = small_tree()
    assert [lvl.tolist() for lvl in tree.levels] == [[0, 1], [2, 3], [4]]
    assert [e.tolist() for e in tree.expand[1:]] == [[0], [2]]
    assert tree.fan_out == [2, 2, 1]


def test_eagle1_default_tree_has_25_nodes_depth_5_and_4_root_children():
    tree = StaticTree.from_choices(EAGLE1_TREE)
    assert len(tree) == 25
    assert int(tree.depths.max()) == 5
    assert int((tree.parents == -1).sum()) == 4


@pytest.mark.parametrize(
    "choices",
    [[], [[0, 1]], [[0], [0]], [[-1]], [[0], []], "[[0]]", [[0.5]], [[True]]],
)
def test_invalid_tree_choices_raise_value_error(choices):
    with pytest.raises(ValueError, match="tree_choices"):
        StaticTree.from_choices(choices)


def test_verify_mask_is_ancestors_or_self_with_root_visible():
    layout = VerifyLayout.from_parents(small_tree().parents)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # a
            [1, 0, 1, 0, 0, 0],  # b
            [1, 1, 0, 1, 0, 0],  # c
            [1, 1, 0, 0, 1, 0],  # d
            [1, 1, 0, 1, 0, 1],  # e
        ],
        dtype=torch.bool,
    )
    assert torch.equal(layout.mask, expected)


def test_verify_positions_are_depths_with_root_zero():
    layout = VerifyLayout.from_parents(small_tree().parents)
    assert layout.positions.tolist() == [0, 1, 1, 2, 2, 3]


def test_attention_mask_prepends_the_visible_prefix():
    layout = VerifyLayout.from_parents(small_tree().parents)
    mask = layout.attention_mask(prefix_len=4)
    assert mask.shape == (6, 10)
    assert bool(mask[:, :4].all())
    assert torch.equal(mask[:, 4:], layout.mask)


def test_retrieve_paths_cover_every_leaf_root_first():
    assert retrieve_paths(small_tree().parents).tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]


def test_children_lists_are_in_input_index_space():
    layout = VerifyLayout.from_parents(small_tree().parents)
    assert layout.children == [[1, 2], [3, 4], [], [5], [], []]


def test_chain_layout_is_causal():
    layout = VerifyLayout.from_parents(torch.tensor([-1, 0, 1]))
    assert torch.equal(layout.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert retrieve_paths(torch.tensor([-1, 0, 1])).tolist() == [[0, 1, 2, 3]]


def test_empty_tree_layout_is_root_only():
    layout = VerifyLayout.from_parents(torch.empty(0, dtype=torch.long))
    assert layout.mask.tolist() == [[True]]
    assert retrieve_paths(torch.empty(0, dtype=torch.long)).tolist() == [[0]]


def test_parents_after_their_children_are_rejected():
    with pytest.raises(ValueError, match="precede"):
        VerifyLayout.from_parents(torch.tensor([-1, 2, 0]))


def test_longest_greedy_path_follows_matching_children():
    tokens = torch.tensor([10, 11, 20, 21, 30])  # a, b, c, d, e
    parents = small_tree().parents
    # target argmax per input: root->10 (a), a->21 (d), b, c, d->99 (nothing), e
    argmax = torch.tensor([10, 21, 0, 0, 99, 0])
    assert longest_greedy_path(tokens, parents, argmax) == [0, 1, 4]


def test_longest_greedy_path_is_root_only_when_nothing_matches():
    tokens = torch.tensor([10, 11, 20, 21, 30])
    argmax = torch.tensor([7, 0, 0, 0, 0, 0])
    assert longest_greedy_path(tokens, small_tree().parents, argmax) == [0]


def test_topk_children_adds_parent_score():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]), dim=-1)
    tokens, scores = topk_children(torch.tensor([-1.0, -2.0]), logprobs, k=2)
    assert tokens.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(scores, torch.tensor([-1.0, -2.0])[:, None] + logprobs.gather(1, tokens))


def random_dynamic_candidates(seed: int, levels: int = 4, k: int = 3, vocab: int = 20):
    """Candidates recorded exactly as the EAGLE-2 drafter records them."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(1, vocab, generator=gen), -1)
    tok, sc = topk_children(torch.zeros(1), logp, k)
    scores, parents = [sc.flatten()], [torch.full((k,), -1)]
    frontier_idx, frontier_sc, offset = torch.arange(k), sc.flatten(), k
    for _ in range(levels - 1):
        logp = torch.log_softmax(3 * torch.randn(k, vocab, generator=gen), -1)
        tok, sc = topk_children(frontier_sc, logp, k)
        scores.append(sc.flatten())
        parents.append(frontier_idx.repeat_interleave(k))
        best = torch.topk(sc.flatten(), k).indices
        frontier_idx, frontier_sc = offset + best, sc.flatten()[best]
        offset += k * k
    return torch.cat(scores), torch.cat(parents)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 5, 12, 100])
def test_rerank_keeps_budget_and_parents_precede_children(seed, budget):
    scores, parents = random_dynamic_candidates(seed)
    kept, new_parents = rerank(scores, parents, budget)
    assert kept.numel() == min(budget, scores.numel())
    assert bool((new_parents < torch.arange(kept.numel())).all())
    VerifyLayout.from_parents(new_parents)  # a valid tree


@pytest.mark.parametrize("seed", range(5))
def test_rerank_keeps_the_best_scores_and_scores_fall_along_paths(seed):
    scores, parents = random_dynamic_candidates(seed)
    kept, new_parents = rerank(scores, parents, 12)
    kept_scores = scores[kept]
    assert torch.equal(torch.sort(kept_scores, descending=True).values, torch.topk(scores, 12).values)
    has_parent = new_parents >= 0
    assert bool((kept_scores[has_parent] <= kept_scores[new_parents[has_parent]]).all())


def test_rerank_keeps_parent_when_child_ties_its_score():
    # child 1 has log-prob 0 (certain), so it ties its parent 0; budget 1 must keep the parent
    kept, new_parents = rerank(torch.tensor([-1.0, -1.0, -3.0]), torch.tensor([-1, 0, -1]), 1)
    assert kept.tolist() == [0]
    assert new_parents.tolist() == [-1]
