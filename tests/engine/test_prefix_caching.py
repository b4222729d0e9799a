"""Prefix caching in the batched loop (engine/batching/prefixes.py): a prompt starts from the
longest prefix a row holds, and decodes exactly what a cache without reuse gives it."""

import pytest
from support.batching import CHEAP_DRAFTS, run_concurrently

from ace_mw.engine import SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.batching.prefixes import RowPrefixes, common_prefix, longest_held

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small matmuls: faster on one thread


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
