"""How much to draft per step, from injected cost tables: the acceptance model, the chooser (plain
steps included), the running acceptance estimate and the bounded probes."""

import pytest
import torch

from ace_mw.engine.drafting.drafters import PLAIN, DraftTree, Plan
from ace_mw.engine.drafting.tree import EAGLE1_TREE, StaticTree
from ace_mw.engine.planning.cost import CostCurve, EngineCosts
from ace_mw.engine.planning.planner import (
    MARGIN,
    PROBE_SHARE,
    Acceptance,
    DraftPlanner,
    Rate,
    best_tree_expected,
    chain_menu,
    draft_model_menu,
    dynamic_tree_menu,
    lookup_menu,
    static_tree_expected,
    static_tree_menu,
)

# Measured ms per forward of q tokens (2026-11-29): an 8B-shaped model on an H200 in bf16 (q=4
# smoothed), and the fixture on the 2-core CPU with one thread.
FLAT = CostCurve({1: 21.9, 2: 24.4, 4: 25.0, 8: 25.7, 16: 24.6, 32: 32.6, 64: 34.1})
STEEP = CostCurve({1: 4.26, 2: 6.89, 4: 8.52, 8: 10.2, 16: 13.61, 32: 20.49, 64: 34.31})
HEAD = CostCurve({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.2})


def costs(verify: CostCurve, head: CostCurve = HEAD, draft_ms: float = 0.5, lookup_ms: float = 0.0) -> EngineCosts:
    draft = CostCurve({1: draft_ms, 2: draft_ms, 64: 3 * draft_ms})
    return EngineCosts(
        verify, lookup_ms, draft, head, head_commit=CostCurve({q: ms / 2 for q, ms in head.as_dict().items()})
    )


def drafts(verify: CostCurve, k: int = 4, draft_ms: float = 0.5):
    """A draft model's chains of up to k, each token costing ``draft_ms``."""
    return draft_model_menu(k, costs(verify, draft_ms=draft_ms))


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


def test_static_tree_expects_the_sum_of_its_path_probabilities():
    tree, a, b = StaticTree.from_choices([[0], [1], [0, 0]]), 0.6, 0.2
    second = (1 - a) * b
    assert static_tree_expected(tree, a, b) == pytest.approx([0.0, a, a + second, a + second + a * a])
    assert static_tree_menu(tree, costs(FLAT)).plans == [PLAIN, Plan(2, 1), Plan(3, 2)]


# --- the chooser ---------------------------------------------------------------------------------


def test_a_flat_curve_drafts_and_a_steep_one_steps_plain_at_the_same_acceptance():
    assert drafts(FLAT).best((0.5, 0.5)) != PLAIN
    assert drafts(STEEP).best((0.5, 0.5)) == PLAIN


def test_low_acceptance_steps_plain_even_on_a_flat_curve():
    menu = drafts(FLAT, draft_ms=2.0)
    assert menu.best((0.05, 0.5)) == PLAIN
    assert menu.best((0.9, 0.5)) == Plan(4, 4)


def test_chain_length_grows_with_acceptance():
    menu = drafts(STEEP, k=8, draft_ms=0.2)
    lengths = [menu.best((a, 0.5)).tokens for a in (0.2, 0.6, 0.8, 0.95)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] >= 4


def test_a_plan_must_beat_plain_steps_by_the_margin():
    # A one-token chain costing 1.1 plain steps pays at alpha > 0.1, but only beats plain steps
    # by MARGIN from alpha > 0.155.
    menu = chain_menu(1, lambda p: 0.0, costs(CostCurve({1: 10.0, 2: 11.0})))
    assert menu.best((0.14, 0.5)) == PLAIN and menu.best((0.16, 0.5)) == Plan(1, 1)
    assert 1.1 * (1 + MARGIN) == pytest.approx(1.155)


def test_a_cap_limits_the_plan_to_what_a_lookup_found():
    menu = lookup_menu(10, costs(FLAT, lookup_ms=0.05))
    assert menu.best((0.95, 0.5)) == Plan(10, 10)
    assert menu.best((0.95, 0.5), cap=3) == Plan(3, 3)
    assert menu.best((0.95, 0.5), cap=0) == PLAIN


def test_a_flat_gpu_curve_affords_a_much_larger_tree_than_a_steep_cpu_curve():
    cheap_head = CostCurve({1: 0.1, 16: 0.2})
    gpu = dynamic_tree_menu(64, 6, 10, costs(FLAT, cheap_head)).best((0.6, 0.6))
    cpu = dynamic_tree_menu(64, 6, 10, costs(STEEP, cheap_head)).best((0.6, 0.6))
    assert cpu.tokens <= 8 < gpu.tokens


def test_siblings_that_rarely_hit_make_the_tree_a_chain():
    menu = dynamic_tree_menu(16, 6, 10, costs(STEEP, CostCurve({1: 0.1, 16: 0.2})))
    wide, narrow = menu.best((0.6, 0.6)), menu.best((0.6, 0.02))
    assert narrow.tokens == narrow.depth < wide.tokens


def test_expensive_head_levels_make_the_tree_shallower():
    cheap = dynamic_tree_menu(32, 6, 10, costs(FLAT, CostCurve({1: 0.1, 16: 0.2}))).best((0.8, 0.5))
    dear = dynamic_tree_menu(32, 6, 10, costs(FLAT, CostCurve({1: 4.0, 16: 8.0}))).best((0.8, 0.5))
    assert dear.depth < cheap.depth


def test_a_plan_costs_its_drafting_and_its_verification():
    menu = dynamic_tree_menu(16, 4, 10, costs(STEEP))
    assert menu.cost(PLAIN) == STEEP(1)
    assert menu.cost(Plan(8, 3)) == pytest.approx(HEAD(1) + 2 * HEAD(8) + STEEP(9))


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


# --- the planner over a request ----------------------------------------------------------------------


def run(planner: DraftPlanner, steps: int, accept) -> list[Plan]:
    """Drive a planner: ``accept(plan)`` says how many drafted tokens the target agreed with."""
    plans = []
    for _ in range(steps):
        plan = planner.choose()
        plans.append(plan)
        if plan.tokens:
            agreed = accept(plan)
            planner.observe(chain(*range(plan.tokens)), list(range(agreed)) + [-1])
            planner.record(plan, agreed + 1)
        else:
            planner.record(plan, 1)
    return plans


def test_probes_lose_at_most_their_share_of_the_modelled_time():
    menu = dynamic_tree_menu(16, 4, 10, costs(STEEP, CostCurve({1: 0.3, 16: 0.5})))
    planner = DraftPlanner(menu)
    plans = run(planner, 500, accept=lambda plan: 0)  # a drafter that is never right
    probes = [p for p in plans if p.tokens]
    assert probes, "the planner should still probe now and then"
    plain_ms = menu.cost(PLAIN)
    lost = sum(menu.cost(p) - plain_ms for p in probes)
    worst_probe = max(menu.cost(p) for p in menu.plans) - plain_ms
    assert lost <= PROBE_SHARE * planner.modelled_ms + worst_probe
    assert planner.expected_speedup >= 1 - PROBE_SHARE - worst_probe / planner.modelled_ms


def test_a_drafter_that_turns_out_right_is_taken_up():
    menu = drafts(STEEP, k=6, draft_ms=0.3)
    assert menu.best((0.5, 0.5)) == PLAIN  # the prior alone would never draft here
    planner = DraftPlanner(menu)
    plans = run(planner, 300, accept=lambda plan: plan.tokens)  # a drafter that is always right
    assert all(p.tokens for p in plans[-100:])
    assert planner.expected_speedup > 1.5


def test_a_drafter_that_stops_being_right_is_dropped():
    menu = drafts(STEEP, k=6, draft_ms=0.3)
    planner = DraftPlanner(menu)
    right = run(planner, 60, accept=lambda plan: plan.tokens)
    wrong = run(planner, 100, accept=lambda plan: 0)
    assert right[-1] == Plan(6, 6)
    assert all(p.tokens <= 2 for p in wrong[20:])  # drafting at most a probe's worth
    assert sum(1 for p in wrong[20:] if p.tokens) <= 8


def test_probes_wait_for_credit_from_plain_steps():
    menu = drafts(STEEP, k=6, draft_ms=0.3)
    probe = menu.cheapest_paying((Rate().upper, Rate().upper))
    plans = run(DraftPlanner(menu), 60, accept=lambda plan: 0)
    first = next(i for i, p in enumerate(plans) if p.tokens)
    assert plans[first] == probe
    assert first * PROBE_SHARE * menu.cost(PLAIN) >= menu.cost(probe) - menu.cost(PLAIN)


def test_a_fresh_request_drafts_only_once_sure_enough_to_win():
    menu = drafts(FLAT, k=4, draft_ms=4.0)
    prior = Rate()
    assert menu.best((prior.mean, prior.mean)) != PLAIN  # at the estimate itself drafting would pay...
    assert DraftPlanner(menu).choose() == PLAIN  # ...but not at its pessimistic end, with no evidence yet


def test_a_proposal_after_plain_steps_pays_for_catching_up():
    c = costs(STEEP)
    menu = dynamic_tree_menu(8, 3, 10, c)
    planner = DraftPlanner(menu, unseen=40)  # a 40-token prompt the head has not run yet
    for _ in range(16):  # plain steps: the head sees none of these tokens either
        planner.record(PLAIN, 1)
    before = planner.modelled_ms
    planner.record(Plan(4, 2), 3)
    catch_up = c.head_commit(56) - c.head_commit(1)
    assert planner.modelled_ms - before == pytest.approx(menu.cost(Plan(4, 2)) + catch_up)
    before = planner.modelled_ms
    planner.record(Plan(4, 2), 2)  # right after a proposal: only the last step's 3 tokens
    catch_up = c.head_commit(3) - c.head_commit(1)
    assert planner.modelled_ms - before == pytest.approx(menu.cost(Plan(4, 2)) + catch_up)


def test_a_long_prompt_delays_the_first_probe():
    menu = drafts(STEEP, k=6, draft_ms=0.3)
    short, long = (run(DraftPlanner(menu, unseen=n), 300, accept=lambda plan: 0) for n in (1, 500))
    first = [next(i for i, p in enumerate(plans) if p.tokens) for plans in (short, long)]
    assert first[0] < first[1]


def test_without_the_gate_every_step_drafts_the_largest_plan():
    menu = dynamic_tree_menu(12, 3, 10, costs(STEEP))
    planner = DraftPlanner(menu, gate=False)
    assert set(run(planner, 20, accept=lambda plan: 0)) == {Plan(12, 3)}
    assert planner.choose(cap=2) == Plan(2, 2)


def test_a_request_of_plain_steps_expects_plain_speed():
    planner = DraftPlanner(drafts(STEEP), probe_share=0.0)
    assert set(run(planner, 30, accept=lambda plan: 0)) == {PLAIN}
    assert planner.expected_speedup == pytest.approx(1.0)


def test_eagle1_tree_is_cut_by_levels():
    menu = static_tree_menu(StaticTree.from_choices(EAGLE1_TREE), costs(FLAT))
    assert [p.tokens for p in menu.plans] == [0, 4, 12, 20, 23, 25]
