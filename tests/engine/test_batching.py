"""Continuous batching (engine/batching, engine/model/rows.py): many requests in one forward per
step, each as lossless as when it runs alone, on the real fixture (fp32 CPU).

Tolerance (fp32): a batched forward multiplies a T-row matrix where a solo one multiplies one row,
so its kernels sum in another order; on the fixture the logits then differ by about 1e-5. A
batched greedy run may leave the solo one only where the solo run's top two logits are within
FP32_NEAR_TIE of each other (near_ties.py checks it, as vLLM and SGLang test batch invariance).
"""

import asyncio
import dataclasses
import json
import threading

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.near_ties import first_divergence
from support.pairs import TEMPERATURE, TOP_K, exact_pair_distribution, tv
from support.paths import MODELS
from support.servers import wait_for
from support.stats import chi_square_p_value
from support.unlike_rows import decoding_step

from ace_mw.engine import Engine, SamplingParams, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.batching.layout import StepLayout
from ace_mw.engine.batching.prefixes import RowPrefixes, common_prefix, longest_held
from ace_mw.engine.batching.sequence import BatchSequence
from ace_mw.engine.drafting.drafters import DraftTree
from ace_mw.engine.model.rows import Outputs, Rows, Span
from ace_mw.engine.model.step import Step
from ace_mw.engine.planning.batch import BatchCosts, MeasuredPrice, RowDraft, StepOverhead, plan_batch
from ace_mw.engine.planning.cost import CostCurve
from ace_mw.engine.planning.planner import PROBE_SHARE

TARGET, DRAFT = MODELS / "ace-tiny-chat", MODELS / "ace-tiny-chat-draft"
HEADS = [MODELS / "ace-tiny-chat-eagle", MODELS / "ace-tiny-chat-eagle3"]  # EAGLE-1/2 and EAGLE-3
EAGLES = ["eagle", "eagle_2", "eagle_3"]
FP32_NEAR_TIE = 1e-3  # 100x the measured batched-vs-solo logit error
NEW_TOKENS = 32
CPU = torch.device("cpu")

# Verifying a draft token costs next to nothing: every fresh row drafts what its lookup found, and
# an EAGLE row's head (ALTERNATING's: a level 1 ms, a twentieth of a step) drafts from the start.
CHEAP_DRAFTS = BatchCosts({b: CostCurve({1: 20.0 * b, 16: 20.0 * b + 1.5}) for b in (1, 2, 4, 8)})
# And a draft model's level costs a twentieth of a target step.
CHEAP_DRAFT_MODEL = BatchCosts({b: CostCurve({1: 0.5 * b, 16: 0.6 * b}) for b in (1, 2, 4, 8)})


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return Engine.from_pretrained(TARGET, draft=DRAFT, eagle=HEADS, costs=ALTERNATING, compile_decode=False)


@pytest.fixture(scope="module")
def batch(engine):
    return BatchEngine(engine, max_num_seqs=4, prefill_chunk=16, costs=CHEAP_DRAFTS, draft_costs=CHEAP_DRAFT_MODEL)


@pytest.fixture(scope="module")
def conversations():
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:300]}] for c in data[:10]]


def run_concurrently(calls):
    """Run each zero-argument call in its own thread; their results in order."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


# --- the batched forward ------------------------------------------------------------------------


def last_three(prefix: list[int]) -> list[Span]:
    """Four rows' last three tokens after their ``prefix`` (rows 0, 1, 3, 4): a chain, one token, a
    two-node tree (both children of the root), a chain."""
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    return [
        Span(0, prefix[0], 3),
        Span(1, prefix[1], 1),
        Span(3, prefix[2], 3, depths=torch.tensor([0, 1, 1]), tree=tree_mask),
        Span(4, prefix[3], 3),
    ]


def test_a_batched_forward_gives_each_sequence_its_solo_logits(engine):
    """Prompt chunks (long rows attend alone), decoding rows, a chain, a tree, and an idle row
    inside the batch's slice of rows: every token's logits as the sequence alone would get them."""
    model = engine.model
    torch.manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,)) for n in (40, 9, 70, 25)]
    caches = model.batch_caches(5, 128)
    with torch.inference_mode():
        solo = [model(s[None], Step.span(0, s.numel(), CPU))[0][0] for s in seqs]
        prefix = [s.numel() - 3 for s in seqs]
        rows = Rows.build([Span(r, 0, n) for r, n in zip((0, 1, 3, 4), prefix, strict=True)], CPU)
        model.forward_rows(
            torch.cat([s[:n] for s, n in zip(seqs, prefix, strict=True)]),
            rows,
            caches,
            torch.zeros(1, dtype=torch.long),
        )
        # The last three tokens: a chain for rows 0 and 4, one token for row 1, a two-node tree
        # (both children of the root) for row 3; row 2 runs nothing.
        spans = last_three(prefix)
        s2 = seqs[2]
        tree_ids = torch.stack([s2[-3], s2[-2], s2[-1]])
        ids = torch.cat([seqs[0][-3:], seqs[1][-3:-2], tree_ids, seqs[3][-3:]])
        logits, _ = model.forward_rows(ids, Rows.build(spans, CPU), caches, torch.arange(10))
        # the tree's second child sits at the first child's position: solo, that is s2[-1] after s2[-3]
        alone, _ = model(torch.cat([s2[:-2], s2[-1:]])[None], Step.span(0, s2.numel() - 1, CPU))
    expected = [solo[0][-3:], solo[1][-3:-2], torch.stack([solo[2][-3], solo[2][-2], alone[0][-1]]), solo[3][-3:]]
    assert torch.allclose(logits, torch.cat(expected), atol=1e-4)


def test_the_outputs_of_a_step_are_its_wanted_spans_whole_or_their_last_token():
    """A decoding row or a verified chain is wanted whole, a prompt chunk that ends its prompt at its
    last token (a query over its whole row), one that does not, not at all; a span wanted otherwise,
    or every token, leaves the step whole."""
    spans = [Span(0, 40, 1), Span(1, 30, 3), Span(2, 0, 50), Span(3, 100, 20)]
    outputs = Outputs.build(spans, [0, 1, 2, 3, 53], CPU)
    assert outputs is not None and outputs.rows is not None
    assert outputs.tokens.tolist() == [0, 1, 2, 3, 53]
    assert outputs.rows.slots.tolist() == [40, 30, 31, 32, 49]  # the chunk's last token, after its 49
    assert outputs.rows.rows.tolist() == [0, 1, 1, 1, 2]
    nothing = Outputs.build([Span(2, 0, 50)], [], CPU)
    assert nothing is not None and nothing.rows is None and nothing.tokens.numel() == 0
    assert Outputs.build(spans, [0, 1, 2, 3, 30], CPU) is None  # a chunk's middle token
    assert Outputs.build(spans[:2], [0, 1, 2, 3], CPU) is None  # every token wanted: nothing left out


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_a_last_layer_of_the_wanted_tokens_alone_gives_their_logits_and_the_same_cache(engine, native):
    """Prompt chunks (one ending its prompt, one not, one from slot 0), decoding rows, a chain and a
    tree in one step: with ``Outputs`` the last layer runs only the wanted tokens, and gives their
    logits and every token's keys and values as the whole step does."""
    from ace_mw.engine.model import native as kernels

    if native and not kernels.runs_on(engine.model.embed_tokens.weight):
        pytest.skip("no native kernels here")
    model = engine.model
    torch.manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n,)) for n in (40, 9, 70, 25, 90)]
    runs = [model.batch_caches(6, 128), model.batch_caches(6, 128)]
    prefix = [s.numel() - 3 for s in seqs[:4]]
    spans = [*last_three(prefix), Span(5, 0, 60)]  # and a prompt's first chunk: no output wanted
    ids = torch.cat([seqs[0][-3:], seqs[1][-3:-2], seqs[2][-3:], seqs[3][-3:], seqs[4][:60]])
    wanted = list(range(10))
    results = []
    with torch.inference_mode():
        for caches, whole in zip(runs, (True, False), strict=True):
            start = Rows.build([Span(r, 0, n) for r, n in zip((0, 1, 3, 4), prefix, strict=True)], CPU, native)
            model.forward_rows(
                torch.cat([s[:n] for s, n in zip(seqs, prefix, strict=False)]), start, caches, torch.zeros(1).long()
            )
            outputs = None if whole else Outputs.build(spans, wanted, CPU, native)
            assert whole or (outputs is not None and outputs.tokens.tolist() == wanted)
            logits, _ = model.forward_rows(
                ids, Rows.build(spans, CPU, native), caches, torch.tensor(wanted), outputs=outputs
            )
            end = [Span(5, 60, 30)]  # the prompt's last chunk: its last token wanted
            last, _ = model.forward_rows(
                seqs[4][60:],
                Rows.build(end, CPU, native),
                caches,
                torch.tensor([29]),
                outputs=None if whole else Outputs.build(end, [29], CPU, native),
            )
            results.append((logits, last, caches))
    (logits, last, caches), (alone, last_alone, caches_alone) = results
    assert torch.allclose(alone, logits, atol=1e-5) and torch.allclose(last_alone, last, atol=1e-5)
    for layer, layer_alone in zip(caches, caches_alone, strict=True):
        assert torch.equal(layer.k, layer_alone.k) and torch.equal(layer.v, layer_alone.v)


def test_rows_verifying_drafts_never_pad_the_decoding_rows(engine):
    """Decoding rows attend together, one query each; rows verifying drafts attend apart from them:
    together where they fill most of their rows, else each alone. Each token's logits stay its own."""

    def shape(qs):
        groups = Rows.build([Span(r, 40, q) for r, q in enumerate(qs)], CPU).groups
        return sorted((g.q, g.hi - g.lo) for g in groups)

    assert shape([1] * 15 + [11]) == [(1, 15), (11, 1)]
    assert shape([1] * 8 + [5] * 8) == [(1, 8), (5, 8)]
    assert shape([3, 1, 1, 1, 3]) == [(1, 3), (3, 1), (3, 1)]

    model = engine.model
    torch.manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (30,)) for _ in range(5)]
    caches = model.batch_caches(5, 64)
    with torch.inference_mode():
        solo = [model(s[None], Step.span(0, s.numel(), CPU))[0][0] for s in seqs]
        model.forward_rows(
            torch.cat([s[:27] for s in seqs]),
            Rows.build([Span(r, 0, 27) for r in range(5)], CPU),
            caches,
            torch.zeros(1, dtype=torch.long),
        )
        qs = [3, 1, 1, 1, 3]
        ids = torch.cat([s[27 : 27 + q] for s, q in zip(seqs, qs, strict=True)])
        logits, _ = model.forward_rows(
            ids, Rows.build([Span(r, 27, q) for r, q in enumerate(qs)], CPU), caches, torch.arange(9)
        )
    expected = torch.cat([solo_logits[27 : 27 + q] for solo_logits, q in zip(solo, qs, strict=True)])
    assert torch.allclose(logits, expected, atol=1e-4)


def test_decoding_rows_of_unlike_lengths_attend_in_runs_each_as_far_as_its_longest(engine):
    """A group reads every row of its range as far as its longest, so decoding rows of very
    different lengths split into runs of neighbouring rows (rows.GROUP_SLOTS prices a run); rows
    alike stay one group. Spans come in step order, not row order: each token's logits stay its own."""

    def runs(starts):
        groups = Rows.build([Span(r, s, 1) for r, s in starts], CPU).groups
        return sorted((g.lo, g.hi, g.kv_len) for g in groups)

    assert runs([(r, 300) for r in range(16)]) == [(0, 16, 301)]
    assert runs([(0, 2000), (1, 2000), (2, 40), (3, 40), (4, 40), (5, 40)]) == [(0, 2, 2001), (2, 6, 41)]

    step, logits, solo = decoding_step(engine.model, native=False)
    assert len(step.groups) == 2
    assert torch.allclose(logits, solo, atol=1e-4)


def test_a_batched_forward_returns_each_tokens_features_as_a_solo_forward_would(engine):
    """What an EAGLE row's head drafts from: the final post-norm features (EAGLE-1/2) and the
    inputs of tapped layers (EAGLE-3), for every token of every row, prompt chunk or decoding."""
    model = engine.model
    torch.manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,)) for n in (30, 12)]
    caches = model.batch_caches(2, 64)
    taps = (0, 2, 3)
    with torch.inference_mode():
        solo = [
            (
                model(s[None], Step.span(0, s.numel(), CPU))[1][0],
                model(s[None], Step.span(0, s.numel(), CPU), taps=taps)[1][0],
            )
            for s in seqs
        ]
        rows = Rows.build([Span(0, 0, 30), Span(1, 0, 12)], CPU)
        _, features = model.forward_rows(torch.cat(seqs), rows, caches, torch.tensor([29, 41]), [(), taps])
    assert set(features) == {(), taps}
    assert torch.allclose(features[()], torch.cat([f for f, _ in solo]), atol=1e-4)
    assert torch.allclose(features[taps], torch.cat([t for _, t in solo]), atol=1e-4)


# --- losslessness under batching ----------------------------------------------------------------


def test_batched_greedy_equals_solo_except_at_near_ties(engine, batch, conversations):
    """Ten conversations, four rows at a time (requests join as others leave, prompts prefill in
    chunks of 16 beside decoding rows), plain, with prompt lookup, the draft model, and the EAGLE
    heads (trees verified under their masks beside other rows, their accepted paths compacted)."""
    solo = [engine.generate(c, max_new_tokens=NEW_TOKENS, temperature=0.0).token_ids for c in conversations]
    for spec in (None, *(SpecParams(a) for a in ["ngram", "draft_model", *EAGLES])):
        outs = run_concurrently(
            [
                lambda c=c, spec=spec: batch.generate(c, max_new_tokens=NEW_TOKENS, temperature=0.0, speculative=spec)
                for c in conversations
            ]
        )
        identical = 0
        for conversation, out, base in zip(conversations, outs, solo, strict=True):
            if out.token_ids == base:
                identical += 1
                continue
            i, ours, theirs = first_divergence(out.token_ids, base, min(engine.eos_ids))
            ids = torch.tensor([engine._encode(conversation) + base[:i]])
            with torch.inference_mode():
                logits, _ = engine.model(ids, torch.arange(ids.shape[1]), last_logits_only=True)
            gaps = [float(logits[0, -1].max() - logits[0, -1, t]) for t in (ours, theirs)]
            assert max(gaps) <= FP32_NEAR_TIE, (spec, i, gaps)
        assert identical >= 9, (spec, identical)


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model", *EAGLES])
def test_batched_speculation_drafts_and_accepts(batch, algorithm):
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    out = batch.generate(prompt, max_new_tokens=24, temperature=0.0, speculative=SpecParams(algorithm))
    assert out.stats.accepted > 0 and out.stats.plain_steps < out.stats.steps
    assert out.stats.steps < len(out.token_ids)  # fewer forwards than tokens


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model", "eagle_2"])
def test_batched_speculative_sampling_matches_plain_sampling_distribution(engine, batch, algorithm):
    """400 seeded two-token samples, eight requests in the batch at a time, each drafting after
    its first token (CHEAP_DRAFTS), by prompt lookup (deterministic drafts) or by the draft model
    (sampled drafts, their distributions kept): Pearson chi-square against the exact distribution
    of plain sampling, p >= 1e-3, with drafts both accepted and rejected.

    Measured (seed 0): ngram p = 0.43 / TV 0.037, draft_model p = 0.83 / TV 0.034. Planted by hand,
    the draft model's q taken from the unshaped logits (temperature and top-k forgotten) fails it."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2,"
    exact = exact_pair_distribution(engine, engine._encode(prompt))
    spec = SpecParams(algorithm)

    def pair(seed):
        # Three tokens, so the step after the first may verify a draft for the second.
        sampling = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        out = batch.generate(prompt, sampling, spec)
        return tuple(out.token_ids[:2]), out.stats

    results = []
    for start in range(0, 400, 8):
        results += run_concurrently([lambda s=s: pair(s) for s in range(start, start + 8)])
    counts = {}
    for ids, _ in results:
        counts[ids] = counts.get(ids, 0) + 1
    accepted = sum(stats.accepted for _, stats in results)
    proposed = sum(stats.proposed for _, stats in results)
    assert 0 < accepted < proposed
    assert chi_square_p_value(counts, exact) >= 1e-3, (tv(counts, exact), counts, exact)


# --- scheduling ---------------------------------------------------------------------------------


def test_a_long_prompt_prefills_in_chunks_while_other_rows_keep_decoding(engine, conversations):
    batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=16, costs=CHEAP_DRAFTS)
    short = batch.stream(conversations[0], max_new_tokens=400, temperature=0.0)
    next(short)  # decoding
    long_prompt = [{"role": "user", "content": " ".join(["tell me more about the sea"] * 40)}]
    steps, decoded = batch.steps, batch.decoding_rows
    long_stream = batch.stream(long_prompt, max_new_tokens=4, temperature=0.0)
    assert next(long_stream).token_ids
    chunks = len(engine._encode(long_prompt)) // 16
    assert batch.steps - steps >= chunks  # a step per chunk of the prompt
    assert batch.decoding_rows - decoded >= chunks - 1  # and the short row decoded in each of them
    long_stream.close()
    short.close()


def test_a_cancelled_stream_frees_its_row_within_a_step(engine, conversations):
    batch = BatchEngine(engine, max_num_seqs=1, costs=CHEAP_DRAFTS)
    stream = batch.stream(conversations[1], max_new_tokens=1000, temperature=0.0)
    next(stream)
    stream.close()
    steps = batch.steps
    wait_for(lambda: batch.running == 0, timeout=5, what="the row to be freed")
    assert batch.steps - steps <= 2
    out = batch.generate(conversations[2], max_new_tokens=8, temperature=0.0)  # the only row serves again
    assert out.token_ids


def test_the_kv_cache_is_sized_from_rows_and_context(engine):
    batch = BatchEngine(engine, max_num_seqs=3, costs=CHEAP_DRAFTS)
    c = engine.model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert batch.kv_cache_bytes == 3 * batch.row_length * per_token
    assert "3 rows" in batch.describe() and "MiB" in batch.describe()


# --- batch-aware planning -----------------------------------------------------------------------


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


def test_free_rows_are_taken_by_the_longest_prefix_they_hold():
    rows = RowPrefixes(3)
    assert rows.take([1, 2, 3]) == (0, 0)  # nothing held: the lowest row
    assert rows.take([1, 2, 3]) == (1, 0)
    rows.give_back(0, [1, 2, 3, 4, 5])
    rows.give_back(1, [1, 2, 9])
    assert rows.take([1, 2, 3, 4, 7]) == (0, 4)  # the longest shared prefix wins
    assert rows.take([1, 2, 3]) == (1, 2)
    rows.give_back(0, [5, 6, 7])
    assert rows.take([5, 6, 7]) == (0, 2)  # all but the last prompt token: it must run for the logits
    rows.give_back(0, [5, 6, 7])
    assert rows.take([5, 6, 7, 8], reuse=False) == (0, 0)
    rows.give_back(0, [])  # content unknown (a failed step): nothing to reuse
    assert rows.take([5, 6, 7, 8]) == (0, 0)
    assert rows.reused == 8
    off = RowPrefixes(1, enabled=False)
    row, _ = off.take([1, 2])
    off.give_back(row, [1, 2])
    assert off.take([1, 2, 3]) == (0, 0)


def test_a_prompt_copies_the_longest_prefix_another_row_holds():
    assert [common_prefix([1, 2, 3, 4], b) for b in ([1, 2, 3, 4, 5], [1, 2, 9], [7], [])] == [4, 2, 0, 0]
    rows = [(0, [1, 2, 8]), (1, [1, 2, 3, 4, 5, 6]), (2, [1, 2, 3])]
    assert longest_held([1, 2, 3, 4, 9], 0, rows) == (1, 4)
    assert longest_held([1, 2, 3, 4, 9], 4, rows) == (-1, 4)  # nobody holds more than it has
    assert longest_held([1, 2, 3, 4], 0, rows) == (1, 3)  # all but the last: it must run for the logits


def test_requests_that_arrive_together_compute_their_shared_system_prompt_once(engine, conversations):
    """Two requests at once on a fresh two-row batch: the one whose prompt runs second copies the
    system prompt from the other's row (no free row holds anything), and both decode exactly what
    a cache without reuse gives them."""
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly, in plain words, and kindly."}
    prompts = [[system, *conversations[2]], [system, *conversations[3]]]
    shared = common_prefix(engine._encode(prompts[0]), engine._encode(prompts[1]))
    assert shared >= len(engine._encode([system])) - 2
    outputs = {}
    for caching in (True, False):
        batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=16, costs=CHEAP_DRAFTS, prefix_caching=caching)
        results = run_concurrently(
            [lambda p=p, b=batch: b.generate(p, max_new_tokens=12, temperature=0.0) for p in prompts]
        )
        outputs[caching] = [r.token_ids for r in results]
        cached = sorted(r.stats.cached_prompt_tokens for r in results)
        assert cached == ([0, shared] if caching else [0, 0])
        assert batch.rows.reused == cached[1]
    assert outputs[True] == outputs[False]


def test_a_later_turn_starts_from_the_row_that_holds_the_earlier_one(engine, conversations):
    """Prefix caching end to end: a conversation's second turn prefills only what its row does not
    hold (the first turn's prompt and answer), and decodes exactly what a cache without reuse gives;
    an EAGLE row, whose head needs every prompt token's features, computes its prompt in full."""
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    first = [system, *conversations[0]]
    outputs = {}
    for caching in (True, False):
        batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=16, costs=CHEAP_DRAFTS, prefix_caching=caching)
        one = batch.generate(first, max_new_tokens=12, temperature=0.0)
        second = [*first, {"role": "assistant", "content": one.text}, {"role": "user", "content": "Say more."}]
        two = batch.generate(second, max_new_tokens=12, temperature=0.0)
        outputs[caching] = two.token_ids
        if caching:
            assert two.stats.cached_prompt_tokens >= len(engine._encode(first)) - 1
            assert batch.rows.reused == two.stats.cached_prompt_tokens
            eagle = batch.generate(second, max_new_tokens=4, temperature=0.0, speculative=SpecParams("eagle_2"))
            assert eagle.stats.cached_prompt_tokens == 0
        else:
            assert two.stats.cached_prompt_tokens == 0
    assert outputs[True] == outputs[False]


def test_prefix_caching_can_be_turned_off_on_a_running_loop(engine, conversations):
    """The one-row loop of an `Engine` caches by default; `prefix_caching = False` (what the demo
    sets: its policies send each request in turn) makes the same prompt prefill in full again."""
    loop = engine.one_row()
    assert loop.prefix_caching
    prompt = conversations[1]
    loop.generate(prompt, max_new_tokens=4, temperature=0.0)
    assert loop.generate(prompt, max_new_tokens=4, temperature=0.0).stats.cached_prompt_tokens > 0
    loop.prefix_caching = False
    try:
        assert loop.generate(prompt, max_new_tokens=4, temperature=0.0).stats.cached_prompt_tokens == 0
    finally:
        loop.prefix_caching = True


def test_an_event_loop_reads_the_same_chunks_and_leaving_early_frees_the_row(engine, conversations):
    """`astream` (the server's path) hands each step to an asyncio loop as the scheduler's thread
    ends it: the same chunks as `stream`, greedy; a reader that leaves after its first chunk
    cancels the sequence, and its row is free for the next request."""
    batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=16, costs=CHEAP_DRAFTS)
    prompt = conversations[2]
    expected = list(batch.stream(prompt, max_new_tokens=24, temperature=0.0))

    async def read() -> list:
        loop = asyncio.get_running_loop()
        chunks = [chunk async for chunk in batch.astream(loop, prompt, max_new_tokens=24, temperature=0.0)]
        left = batch.astream(loop, prompt, max_new_tokens=1000, temperature=0.0)
        await anext(left)
        await left.aclose()
        return chunks

    got = asyncio.run(read())
    assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [
        (c.text, c.token_ids, c.finish_reason) for c in expected
    ]
    assert got[-1].stats is not None and got[-1].stats.output_tokens == expected[-1].stats.output_tokens
    wait_for(lambda: batch.running == 0, timeout=30, what="the left sequence's row to be freed")


def test_an_answer_read_at_its_end_takes_one_hand_off_with_the_same_text(engine, conversations):
    """`astream(..., every_step=False)` (a whole answer without stop strings) holds the tokens on the
    scheduler's thread and hands them to the loop once, with the end: one chunk with the text,
    tokens, finish and counts that reading every step gives, greedy, and the eos or budget still
    ends it."""
    batch = BatchEngine(engine, max_num_seqs=2, prefill_chunk=16, costs=CHEAP_DRAFTS)

    async def read(prompt: str, every_step: bool, budget: int) -> list:
        loop = asyncio.get_running_loop()
        steps = batch.astream(loop, prompt, max_new_tokens=budget, temperature=0.0, every_step=every_step)
        return [chunk async for chunk in steps]

    finishes = set()
    for prompt, budget in ((conversations[2], 24), (conversations[7], 400)):  # 7 ends at an eos
        each = asyncio.run(read(prompt, True, budget))
        once = asyncio.run(read(prompt, False, budget))
        assert len(each) > 1 and len(once) == 1
        assert once[0].text == "".join(c.text for c in each)
        assert once[0].token_ids == [t for c in each for t in c.token_ids]
        assert once[0].finish_reason == each[-1].finish_reason
        assert once[0].stats is not None and each[-1].stats is not None
        assert once[0].stats.output_tokens == each[-1].stats.output_tokens
        finishes.add(once[0].finish_reason)
    assert finishes == {"length", "stop"}  # the budget ended one, an eos the other
