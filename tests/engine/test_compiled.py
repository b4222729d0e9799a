"""One row's compiled one-token step (model/compiled.py): the eager step's logits up to summation
order, greedy output equal to eager decoding up to near-ties, every graph compiled before a request,
and eager decoding wherever it cannot compile."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from support.engine_costs import ALTERNATING
from support.near_ties import assert_equal_up_to_ties

from ace_mw.engine import Engine
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.model.compiled import OneTokenStep
from ace_mw.engine.model.rows import Rows, Span
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

TARGET = MODELS_DIR / "ace-tiny-chat"
FP32_NEAR_TIE = 1e-3  # as batching's: 50x the compiled-vs-eager logit error measured below (2e-5)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def compiled():
    return Engine.from_pretrained(TARGET, costs=ALTERNATING, max_context=512)


@pytest.fixture(scope="module")
def eager():
    return Engine.from_pretrained(TARGET, costs=ALTERNATING, max_context=512, compile_decode=False)


@pytest.fixture(scope="module")
def reference():
    model = Transformer.from_pretrained(TARGET)
    model.setup_cache(1024)
    return model


def test_the_compiled_step_gives_the_eager_steps_logits_in_any_row(one_torch_thread):
    model = Transformer.from_pretrained(TARGET)
    model.setup_cache(64)
    step = OneTokenStep(model)
    model.pack()
    ours, theirs = model.batch_caches(4, 64), model.batch_caches(4, 64)
    assert step.warm_up(ours)
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for row in (0, 2, 3):
            for position in range(1, 8):
                token = tokens[position : position + 1]
                compiled = step(token, row, position, ours)
                rows = Rows.build([Span(row, position, 1)], torch.device("cpu"))
                eager, _ = model.forward_rows(token, rows, theirs, torch.tensor([0]))
                assert compiled.shape == eager.shape == (1, model.config.vocab_size)
                assert (compiled - eager).abs().max() < 1e-4, (row, position)
        # and it wrote the same keys and values where the eager step did
        for mine, other in zip(ours, theirs, strict=True):
            assert torch.allclose(mine.k[[0, 2, 3], :, 1:8], other.k[[0, 2, 3], :, 1:8], atol=1e-4)
            assert torch.allclose(mine.v[[0, 2, 3], :, 1:8], other.v[[0, 2, 3], :, 1:8], atol=1e-4)


def test_an_engine_that_compiles_decodes_as_the_eager_one_up_to_near_ties(compiled, eager, reference, one_torch_thread):
    loop = compiled.one_row()
    assert loop.one_token is not None and eager.one_row().one_token is None
    calls = []
    step = loop.one_token.compiled
    loop.one_token.compiled = lambda *args: calls.append(1) or step(*args)
    try:
        prompts = [eager.tokenizer(p, add_special_tokens=False).input_ids for p in _prompts()]
        baseline = [
            eager.generate(eager.tokenizer.decode(p), max_new_tokens=NEW_TOKENS, temperature=0).token_ids
            for p in prompts
        ]
        assert_equal_up_to_ties(compiled, reference, prompts, baseline, None, NEW_TOKENS, FP32_NEAR_TIE, 0.75)
    finally:
        loop.one_token.compiled = step
    # every step after a prompt's (its first token) ran compiled (one output that left at a near-tie
    # may be shorter than its baseline)
    assert len(calls) >= sum(len(b) - 1 for b in baseline) - NEW_TOKENS


def test_a_loop_of_many_rows_compiles_every_graph_before_its_first_request(compiled, one_torch_thread):
    loop = BatchEngine(compiled, max_num_seqs=4, costs=compiled.one_row().costs)
    assert loop.one_token is compiled.one_token
    torch._dynamo.config.error_on_recompile = True
    try:
        with torch.inference_mode():
            for row in range(4):
                for position in (3, 9, 200):
                    loop.one_token(torch.tensor([7]), row, position, loop.caches)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert not loop.one_token.runs(0)  # a sequence's first token would compile another graph: eager


def test_the_plan_prices_a_lone_decoding_step_at_what_the_compiled_one_costs(compiled, eager):
    ours, theirs = compiled.one_row().costs, eager.one_row().costs
    assert ours(1, 1) < 0.9 * theirs(1, 1)
    assert ours(1, 2) == theirs(1, 2) and ours(2, 2) == theirs(2, 2)  # verifying, or two rows: eager either way


def test_where_it_cannot_compile_the_loop_decodes_eagerly(compiled, eager, monkeypatch, caplog):
    def fails(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled.one_token, "compiled", fails)
    with caplog.at_level(logging.WARNING):
        loop = BatchEngine(compiled, max_num_seqs=1, costs=eager.one_row().costs)
    assert loop.one_token is None
    assert "decoding eagerly: cannot compile the one-token step here (InvalidCxxCompiler" in caplog.text
    prompt = _prompts()[0]
    ours = loop.generate(prompt, max_new_tokens=8, temperature=0)
    assert ours.token_ids == eager.generate(prompt, max_new_tokens=8, temperature=0).token_ids


def _prompts() -> list[str]:
    return [text for texts in load_prompts(2, fits=lambda text: len(text) < 1200).values() for text in texts][:6]
