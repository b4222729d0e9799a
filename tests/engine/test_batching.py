"""Continuous batching (engine/batching, engine/model/rows.py): many requests in one forward per
step, each as lossless as when it runs alone, on the real fixture (fp32 CPU).

Tolerance (fp32): a batched forward multiplies a T-row matrix where a solo one multiplies one row,
so its kernels sum in another order; on the fixture the logits then differ by about 1e-5. A
batched greedy run may leave the solo one only where the solo run's top two logits are within
FP32_NEAR_TIE of each other (near_ties.py checks it, as vLLM and SGLang test batch invariance).
"""

import asyncio

import pytest
import torch
from support.batching import CHEAP_DRAFTS, run_concurrently
from support.near_ties import first_divergence
from support.pairs import TEMPERATURE, TOP_K, exact_pair_distribution, tv
from support.servers import wait_for
from support.stats import chi_square_p_value
from support.unlike_rows import decoding_step

from ace_mw.engine import SamplingParams, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.model.rows import Outputs, Rows, Span
from ace_mw.engine.model.step import Step

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small matmuls: faster on one thread

EAGLES = ["eagle", "eagle_2", "eagle_3"]
FP32_NEAR_TIE = 1e-3  # 100x the measured batched-vs-solo logit error
NEW_TOKENS = 32
CPU = torch.device("cpu")


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
