"""What a request has shown of its drafts (engine/planning/planner.py): the acceptance model of a
tree's expected tokens, and what the running estimate learns from each step; ``test_batch_steps.py``
tests the plans made from them."""

import pytest
import torch

from ace_mw.engine.drafting.drafters import DraftTree
from ace_mw.engine.planning.planner import Acceptance, Rate, best_tree_expected

# --- the acceptance model ------------------------------------------------------------------------


def test_a_confident_drafter_spends_a_small_budget_on_a_chain():
    assert best_tree_expected(0.9, 0.5, 3, 3)[3] == pytest.approx(0.9 + 0.81 + 0.729)


def test_an_unsure_drafter_spends_it_on_siblings():
    # 0.5 (top guess), then its child and the second guess tie at 0.25 each.
    assert best_tree_expected(0.5, 0.5, 3, 3)[3] == pytest.approx(0.5 + 0.25 + 0.25)


def test_siblings_are_worth_only_what_later_candidates_hit():
    # First choice 0.5; a later candidate right 1 time in 10 once the ones before it missed:
    # the first choice's child (0.25) beats the second guess (0.05).
    assert best_tree_expected(0.5, 0.1, 2, 2)[2] == pytest.approx(0.5 + 0.25)
    assert best_tree_expected(0.5, 0.1, 2, 1)[2] == pytest.approx(0.5 + 0.05)


def test_a_depth_cap_keeps_the_tree_shallow():
    # One level only: the top three guesses, 0.9 + 0.09 + 0.009.
    assert best_tree_expected(0.9, 0.9, 3, 1)[3] == pytest.approx(0.999)


def test_more_tree_nodes_never_expect_fewer_accepted_tokens():
    values = best_tree_expected(0.6, 0.3, 40, 6)
    assert values == sorted(values) and values[0] == 0.0


# --- what the estimate learns from -----------------------------------------------------------------


def chain(*tokens) -> DraftTree:
    return DraftTree.chain(torch.tensor(tokens))


def learned(proposal: DraftTree, emitted: list[int]) -> tuple[float, float, float, float]:
    acceptance = Acceptance()
    acceptance.learn(proposal, emitted)
    first, later = acceptance.first, acceptance.later
    return first.right, first.wrong, later.right, later.wrong


def test_a_chain_teaches_first_choices_up_to_the_first_difference():
    assert learned(chain(1, 2, 3, 4), [1, 2, 9]) == (2, 1, 0, 0)
    assert learned(chain(1, 2), [1, 2, 7]) == (2, 0, 0, 0)  # the bonus token follows the chain's end


def test_the_bonus_token_checks_the_first_unverified_draft():
    assert learned(chain(5, 6), [5]) == (1, 0, 0, 0)  # a plain step whose token the lookup had right
    assert learned(chain(5, 6), [8]) == (0, 1, 0, 0)


def test_a_tree_teaches_later_siblings_in_the_verifiers_order():
    # root -> [7 (first choice), 8, 6]; 8 -> [9]
    tree = DraftTree(torch.tensor([7, 8, 6, 9]), torch.tensor([-1, -1, -1, 1]))
    assert learned(tree, [8, 9, 4]) == (1, 1, 1, 0)  # first missed, second right, then 9 under 8
    assert learned(tree, [6]) == (0, 1, 1, 1)  # first and second missed, third right
    assert learned(tree, [3]) == (0, 1, 0, 2)


def test_evidence_fades_so_a_stretch_without_drafts_makes_the_estimate_uncertain_again():
    rate = Rate()
    rate.wrong = 20
    confident = rate.upper
    assert rate.mean < 0.1
    for _ in range(30):
        rate.fade()
    assert rate.upper > confident + 0.4 and rate.mean > 0.3


def test_the_prior_is_uninformed():
    assert Rate().mean == 0.5
