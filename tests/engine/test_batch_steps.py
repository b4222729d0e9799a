"""A batched step's plan and layout (engine/planning/batch.py, engine/batching/drafting.py and
layout.py): which rows draft how many tokens at what price, and where each row's tokens go."""

import dataclasses

import pytest
import torch
from support.batching import CHEAP_DRAFTS

from ace_mw.engine import SamplingParams, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.batching.layout import StepLayout
from ace_mw.engine.batching.sequence import BatchSequence
from ace_mw.engine.drafting.drafters import DraftTree
from ace_mw.engine.planning.batch import BatchCosts, MeasuredPrice, RowDraft, StepOverhead, plan_batch
from ace_mw.engine.planning.cost import CostCurve
from ace_mw.engine.planning.planner import PROBE_SHARE

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small matmuls: faster on one thread


def test_speculation_fades_out_as_the_batch_turns_compute_bound():
    """One row decoding alone on a memory-bound machine drafts; sixteen rows on a machine where
    every token costs as much as the forward's weights draft nothing at the same acceptance."""
    memory_bound = BatchCosts({1: CostCurve({1: 10.0, 16: 11.0})})
    compute_bound = BatchCosts({1: CostCurve({1: 10.0, 16: 160.0}), 16: CostCurve({1: 40.0, 16: 640.0})})
    offer = RowDraft(cap=8, alpha=0.6)
    assert sum(plan_batch([offer], 0, 0, memory_bound)) > 2
    assert plan_batch([offer] * 16, 0, 0, compute_bound) == [0] * 16


def test_a_draft_token_that_pads_a_full_batch_is_priced_as_it_runs():
    """16 decoding rows run their projections at 16 rows, 17 tokens at 32 (packed weights): two
    likely draft tokens pay only when the table prices the tokens they add, not the rows they run."""
    curve = CostCurve({1: 10.0, 2: 13.0})  # 16 rows of one token: 10 ms; of two: 13 ms
    offers = [RowDraft(1, 0.9)] * 2 + [RowDraft(0, 0.0)] * 14
    assert plan_batch(offers, 0, 0, BatchCosts({16: curve})) == [1, 1] + [0] * 14
    assert plan_batch(offers, 0, 0, BatchCosts({16: curve}, padded=True)) == [0] * 16
    assert BatchCosts({16: curve}, padded=True)(16, 17) == BatchCosts({16: curve})(16, 32)


def test_a_prompt_chunk_in_the_step_does_not_make_drafts_look_cheap():
    """Eight decoding rows on a compute-bound machine draft nothing at this acceptance; a 256-token
    prompt chunk in the same step makes the step long but each draft token no cheaper, so they
    still draft nothing (priced against the whole step's time, the chunk made drafting look free)."""
    costs = BatchCosts({8: CostCurve({1: 10.0, 2: 17.0, 4: 31.0, 8: 59.0, 16: 115.0, 64: 450.0})})
    offers = [RowDraft(cap=4, alpha=0.5)] * 8
    assert plan_batch(offers, 0, 0, costs) == [0] * 8
    assert plan_batch(offers, 1, 256, costs) == [0] * 8
    likely = [RowDraft(cap=4, alpha=0.95)] * 8  # drafts that pay without the chunk pay with it
    assert sum(plan_batch(likely, 0, 0, costs)) > 0 and sum(plan_batch(likely, 1, 256, costs)) > 0


def test_a_verifying_step_pays_what_it_was_seen_to_cost_beyond_the_table():
    """Verifying steps that run 1.5 ms over their table price where plain steps run 0.5 ms over
    teach an overhead of 1 ms; a stall moves it a bounded step; with plain steps alone it fades;
    the plan drafts a token that pays against the table, not once the step's overhead is known."""
    overhead = StepOverhead()
    for _ in range(200):
        overhead.observe(True, 10.0, 11.5)
        overhead.observe(False, 9.0, 9.5)
    assert overhead.ms == pytest.approx(1.0, abs=0.05)  # plain steps' forgetting pulls it a little
    overhead.observe(True, 10.0, 5000.0)  # a stall: at most the table's price, one weight of it
    assert overhead.ms < 1.0 + StepOverhead.WEIGHT * 10.0 + 0.01
    for _ in range(3000):
        overhead.observe(False, 9.0, 9.5)
    assert overhead.ms < 0.01
    fixed = StepOverhead(learns=False)
    fixed.observe(True, 10.0, 20.0)
    assert fixed.ms == 0.0
    costs = BatchCosts({8: CostCurve({1: 10.0, 2: 11.0, 16: 40.0})})
    offers = [RowDraft(cap=1, alpha=0.9)] + [RowDraft(0, 0.0)] * 7  # a draft token: 0.125 ms, 0.9 tokens
    assert plan_batch(offers, 0, 0, costs) == [1] + [0] * 7
    assert plan_batch(offers, 0, 0, costs, overhead_ms=1.0) == [0] * 8


def test_drafts_go_to_the_rows_likeliest_to_accept():
    costs = BatchCosts({4: CostCurve({1: 10.0, 2: 14.0, 4: 22.0, 16: 70.0})})
    drafts = plan_batch([RowDraft(6, 0.9), RowDraft(6, 0.1), RowDraft(0, 0.9), RowDraft(6, 0.5)], 0, 0, costs)
    assert drafts[0] > drafts[3] >= drafts[1] and drafts[2] == 0


def test_a_draft_model_row_drafts_only_when_its_levels_pay():
    """The same offer from a draft model: drafted when a level costs a twentieth of a step, not
    when the first level must first catch the row up on a long stretch of plain steps."""
    costs = BatchCosts({1: CostCurve({1: 10.0, 16: 11.0})})
    offer = RowDraft(cap=4, alpha=0.6, by_model=True)
    assert sum(plan_batch([offer], 0, 0, costs, (0.5, 0.5))) > 1
    assert plan_batch([offer], 0, 0, costs, (12.0, 0.5)) == [0]


def test_an_eagle_row_drafts_only_as_deep_as_its_own_head_passes_pay():
    """A head drafts each row alone: its first token pays for catching the head up, each further
    one for a level. Cheap passes: a deep draft; a costly catch-up: none; costly levels: one token."""
    costs = BatchCosts({1: CostCurve({1: 10.0, 16: 11.0}), 2: CostCurve({1: 11.0, 16: 13.0})})
    cheap = RowDraft(cap=6, alpha=0.7, first_ms=0.5, token_ms=0.5)
    assert plan_batch([cheap], 0, 0, costs)[0] >= 4
    assert plan_batch([RowDraft(cap=6, alpha=0.7, first_ms=30.0, token_ms=0.5)], 0, 0, costs) == [0]
    assert plan_batch([RowDraft(cap=6, alpha=0.7, first_ms=0.5, token_ms=6.0)], 0, 0, costs) == [1]
    # two rows: each pays its own passes, and the likelier one gets the tokens first
    plan = plan_batch([cheap, RowDraft(cap=6, alpha=0.3, first_ms=0.5, token_ms=0.5)], 0, 0, costs)
    assert plan[0] >= plan[1] and plan[0] > 0


def test_a_costly_row_probes_only_with_the_tokens_its_credit_pays_for(engine, batch):
    """A draft-model row with a 300-token prompt to catch up on stays at the pessimistic end of its
    acceptance until its credit pays for that catch-up and a token; then it probes at the
    optimistic end with as many tokens as the credit pays for, and the probe spends them."""
    asked = engine.prepare("word " * 300, SamplingParams(temperature=0.0), SpecParams("draft_model"), {})
    s = BatchSequence(asked, drafter=None, by_model=True, max_draft=10, fixed=False, eos_ids=engine.eos_ids, start=0.0)
    s.begin(5)
    s.acceptance.first.right = 2.0  # some evidence: the two ends of its acceptance differ
    first, per_token = batch.drafting.probe_ms(s, RowDraft(10, 0.0, True))
    assert first > 10 * per_token > 0  # the prompt's catch-up dominates a probe's cost

    s.probe_credit = 0.99 * first
    offer = batch.drafting.offer(s)
    assert (offer.cap, offer.alpha) == (10, s.acceptance.first.lower)

    s.probe_credit = first + 2.5 * per_token
    offer = batch.drafting.offer(s)
    assert (offer.cap, offer.alpha) == (3, s.acceptance.first.upper)
    batch.drafting.book_probes([s], [offer], [3], 1, 1)
    assert s.probe_credit == pytest.approx(0.5 * per_token)
    batch.drafting.book_probes([s], [dataclasses.replace(offer, alpha=s.acceptance.first.lower)], [0], 1, 1)
    assert s.probe_credit == pytest.approx(0.5 * per_token + PROBE_SHARE * batch.drafting.costs(1, 1))


def test_a_step_lays_out_decoding_rows_first_then_prompt_chunks(engine):
    """A decoding row verifying a chain, one verifying a tree, then a prompt's last chunk: each
    row's tokens start where the one before ended, a tree's go under its own positions and mask,
    and the step wants every decoding token's logits and the finished prompt's last one only."""

    def sequence(text: str, row: int) -> BatchSequence:
        asked = engine.prepare(text, SamplingParams(temperature=0.0), SpecParams("ngram"), {})
        s = BatchSequence(
            asked, drafter=None, by_model=False, max_draft=4, fixed=False, eos_ids=engine.eos_ids, start=0.0
        )
        s.row = row
        return s

    chain, tree, prompt = sequence("one two", 0), sequence("three four five", 1), sequence("six " * 20, 2)
    chain.begin(7)
    chain.proposal = DraftTree.chain(torch.tensor([11, 12, 13]))
    tree.begin(8)
    tree.proposal = DraftTree(torch.tensor([21, 22, 23]), torch.tensor([-1, -1, 0]))
    prompt.prefilled = prompt.prompt.numel() - 5
    layout = StepLayout.of([chain, tree], [2, 3], [(prompt, prompt.prompt_chunk(5))])

    assert [x.tolist() for x in layout.inputs[:2]] == [[7, 11, 12], [8, 21, 22, 23]]
    assert layout.offsets == [0, 3, 7]
    assert layout.wanted == [0, 1, 2, 3, 4, 5, 6, 11]
    assert [(s.row, s.start, s.q) for s in layout.spans] == [
        (0, chain.length, 3),
        (1, tree.length, 4),
        (2, prompt.prompt.numel() - 5, 5),
    ]
    assert layout.spans[0].tree is None and layout.spans[1].tree is not None
    assert layout.trees[0][1] == [[1], [2], []]  # a chain: each node's one child
    assert layout.trees[1][1] == [[1, 2], [3], [], []]  # the root's two children, then the tree's


def test_a_measured_price_follows_what_a_part_takes_unless_its_table_was_given():
    price = MeasuredPrice()
    for _ in range(40):
        price.observe(1.0, 3.0)
    assert price(2.0) == pytest.approx(6.0, rel=0.01)
    price.observe(1.0, 1e6)  # one stall moves it by a bounded step
    assert price.ratio <= 3.0 + MeasuredPrice.WEIGHT * MeasuredPrice.MAX_RATIO
    given = MeasuredPrice(learns=False)
    given.observe(1.0, 5.0)
    assert given(2.0) == 2.0


def test_draft_model_levels_are_priced_as_they_run(engine, batch, conversations):
    """A table no forward can match (10 us a level) is corrected by what the levels take; the
    module's batch, whose table was given, keeps it as it is."""
    far_too_cheap = BatchCosts({b: CostCurve({1: 0.01 * b, 16: 0.012 * b}) for b in (1, 2, 4, 8)})
    learning = BatchEngine(engine, max_num_seqs=2, prefill_chunk=64, costs=CHEAP_DRAFTS, draft_costs=far_too_cheap)
    learning.drafting.draft_price = MeasuredPrice()  # as if measured here: learn from the levels it runs
    out = learning.generate(conversations[3], max_new_tokens=24, temperature=0.0, speculative=SpecParams("draft_model"))
    assert out.stats.proposed > 0 and learning.drafting.draft_price.ratio > 5
    batch.generate(conversations[3], max_new_tokens=8, temperature=0.0, speculative=SpecParams("draft_model"))
    assert batch.drafting.draft_price.ratio == 1.0
