"""Distribution shaping and the lossless acceptance rules on synthetic distributions.

The Monte Carlo tests run the real rule thousands of times with a seeded generator and bound the
total-variation distance between what it emits and the target distribution (expected noise at
these trial counts is about 0.01; a wrong rule is off by 0.1 or more).
"""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ace_mw.engine.drafting.sampling import Sampling, accept_child, logits_to_probs, residual, walk_tree

TRIALS = 12000
TV_BOUND = 0.03


def dist(values):
    t = torch.tensor(values, dtype=torch.float)
    return t / t.sum()


def tv(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - expected).abs().sum())


def seeded(seed=0, temperature=1.0) -> Sampling:
    return Sampling(temperature=temperature, generator=torch.Generator().manual_seed(seed))


def test_temperature_zero_gives_the_one_hot_argmax():
    probs = logits_to_probs(torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.6)])
def test_shaping_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    torch.testing.assert_close(logits_to_probs(logits, temperature, top_p, top_k), expected.softmax(-1))


def test_top_p_always_keeps_the_most_likely_token():
    probs = logits_to_probs(torch.tensor([5.0, 0.0, 0.0]), 1.0, top_p=0.01)
    assert probs.tolist() == [1.0, 0.0, 0.0]


def test_residual_is_the_normalised_positive_part():
    r = residual(dist([0.5, 0.3, 0.2]), dist([0.2, 0.6, 0.2]))
    torch.testing.assert_close(r, torch.tensor([1.0, 0.0, 0.0]))


def test_residual_falls_back_to_p_when_nothing_is_left():
    p = dist([0.5, 0.5])
    assert residual(p, p).tolist() == p.tolist()


def test_deterministic_draft_is_accepted_with_probability_p():
    sampling, p = seeded(3), dist([0.25, 0.75])
    accepted = sum(accept_child(p, 1, None, sampling)[0] for _ in range(4000))
    assert abs(accepted / 4000 - 0.75) < 0.03


def test_rejected_deterministic_draft_zeroes_that_token():
    ok, p = accept_child(dist([1.0, 0.0, 1.0]), 0, None, Sampling(1.0, generator=_always_reject()))
    assert not ok and p.tolist() == [0.0, 0.0, 1.0]


def _always_reject() -> torch.Generator:
    # A generator whose first uniform draw is above 0.5: found once, deterministic afterwards.
    for seed in range(100):
        if torch.rand((), generator=torch.Generator().manual_seed(seed)) > 0.5:
            return torch.Generator().manual_seed(seed)
    raise AssertionError("no seed draws above 0.5")


P_ROOT = dist([0.35, 0.25, 0.2, 0.1, 0.1])
Q_ROOT = dist([0.1, 0.4, 0.1, 0.3, 0.1])


def first_token_counts(draft_tree, trials=TRIALS, seed=0) -> torch.Tensor:
    """Run the walk ``trials`` times on trees from ``draft_tree(sampling)``; count the first emitted token."""
    sampling = seeded(seed)
    counts = torch.zeros(P_ROOT.numel())
    for _ in range(trials):
        tokens, children, q = draft_tree(sampling)
        probs = P_ROOT.expand(len(tokens) + 1, -1)
        path, p = walk_tree(probs, tokens, children, q, sampling)
        counts[tokens[path[1] - 1] if len(path) > 1 else sampling.sample(p)] += 1
    return counts


def test_chain_rule_with_sampled_draft_emits_the_target_distribution():
    def one_draft(sampling):
        return [sampling.sample(Q_ROOT)], [[1], []], Q_ROOT[None]

    assert tv(first_token_counts(one_draft), P_ROOT) < TV_BOUND


def test_deterministic_siblings_emit_the_target_distribution():
    def top3(sampling):
        return [1, 3, 0], [[1, 2, 3], [], [], []], None

    assert tv(first_token_counts(top3), P_ROOT) < TV_BOUND


def test_siblings_sampled_without_replacement_emit_the_target_distribution():
    def two_siblings(sampling):
        first = sampling.sample(Q_ROOT)
        rest = Q_ROOT.clone()
        rest[first] = 0
        rest /= rest.sum()
        return [first, sampling.sample(rest)], [[1, 2], [], []], torch.stack([Q_ROOT, rest])

    assert tv(first_token_counts(two_siblings), P_ROOT) < TV_BOUND


def test_two_token_chain_emits_the_target_joint_distribution():
    # Target: P1 at the root, P2[x] after token x. Draft: q1, then q2[x] after x.
    gen = torch.Generator().manual_seed(5)
    V = 4
    p1, q1 = torch.rand(V, generator=gen).softmax(0), torch.rand(V, generator=gen).softmax(0)
    p2 = (3 * torch.rand(V, V, generator=gen)).softmax(-1)
    q2 = (3 * torch.rand(V, V, generator=gen)).softmax(-1)
    sampling = seeded(7)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        x1 = sampling.sample(q1)
        x2 = sampling.sample(q2[x1])
        probs = torch.stack([p1, p2[x1], p2[x2]])  # p2[x2] is never used for the first two tokens
        path, p = walk_tree(probs, [x1, x2], [[1], [2], []], torch.stack([q1, q2[x1]]), sampling)
        emitted = [[x1, x2][i - 1] for i in path[1:]] + [sampling.sample(p)]
        if len(emitted) == 1:  # rejected at once: the next step samples plainly after the bonus
            emitted.append(sampling.sample(p2[emitted[0]]))
        counts[emitted[0], emitted[1]] += 1
    assert tv(counts.flatten(), (p1[:, None] * p2).flatten()) < TV_BOUND
