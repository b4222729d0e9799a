"""The compiled decoding step (model/compiled.py), one or two rows decoding a token each: the eager
step's logits up to summation order, greedy output equal to eager decoding up to near-ties, every
graph compiled before a request, and eager decoding wherever it cannot compile."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch._dynamo
from support.engine_costs import ALTERNATING
from support.near_ties import assert_equal_up_to_ties

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.drafting.eagle3_head import default_taps
from ace_mw.engine.model import native
from ace_mw.engine.model.compiled import ROWS, _stored, features
from ace_mw.engine.model.rows import Rows, Span
from ace_mw.engine.model.transformer import Transformer
from ace_mw.engine.planning.cost import CostCurve
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

TARGET = MODELS_DIR / "ace-tiny-chat"
HEADS = [MODELS_DIR / "ace-tiny-chat-eagle", MODELS_DIR / "ace-tiny-chat-eagle3"]
FP32_NEAR_TIE = 1e-3  # as batching's: 50x the compiled-vs-eager logit error measured below (2e-5)
NEW_TOKENS = 24


# ALTERNATING with an EAGLE head's passes nearly free: its rows draft, and after a rejection run a
# plain step, which is what a head must be fed through
CHEAP_HEADS = dataclasses.replace(
    ALTERNATING, head_level=CostCurve({1: 0.05, 16: 0.1, 64: 0.2}), head_commit=CostCurve({1: 0.02, 64: 0.1})
)


@pytest.fixture(scope="module")
def compiled():
    return Engine.from_pretrained(TARGET, eagle=HEADS, costs=CHEAP_HEADS, max_context=512, compile_decode=True)


@pytest.fixture(scope="module")
def eager():
    return Engine.from_pretrained(TARGET, costs=ALTERNATING, max_context=512, compile_decode=False)


@pytest.fixture(scope="module")
def reference():
    model = Transformer.from_pretrained(TARGET)
    model.setup_cache(1024)
    return model


def test_the_step_reads_bf16_copies_only_of_weights_that_bf16_holds_exactly(compiled, reference):
    """The fixture ships in bf16 (as most checkpoints do): every projection the step reads is a
    row-major bf16 copy whose values are the fp32 weights' own; a weight that bf16 cannot hold
    stays in fp32."""
    step = compiled.decoding_step
    read = [w for layer in step.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [step.lm_head]
    assert all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in read)
    assert torch.equal(step.lm_head.float(), reference.embed_tokens.weight)
    assert torch.equal(step.layers[0].down.float(), reference.layers[0].mlp.down_proj.weight)
    exact = torch.tensor([[1.0, 0.5], [-2.0, 3.0]])
    assert _stored(exact).dtype == torch.bfloat16 and torch.equal(_stored(exact).float(), exact)
    inexact = exact + torch.tensor([[0.0, 1e-4], [0.0, 0.0]])  # 0.5001 is not a bf16 value
    assert _stored(inexact).dtype == torch.float32 and torch.equal(_stored(inexact), inexact)
    assert _stored(exact.t()).is_contiguous()  # row-major whatever the layout it came in


def test_the_compiled_step_gives_the_eager_steps_logits_in_any_rows(compiled, one_torch_thread):
    # the engine's own step and model (packed): compiling another would double this file's time
    model, step = compiled.model, compiled.decoding_step
    ours, theirs = model.batch_caches(4, 64), model.batch_caches(4, 64)
    assert step.warm_up(ours)
    for mine, other in zip(ours, theirs, strict=True):  # the same history in both
        mine.k.normal_(), mine.v.normal_(), other.k.copy_(mine.k), other.v.copy_(mine.v)
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    cases = [([0], [1]), ([3], [7]), ([2, 0], [5, 9]), ([1, 3], [12, 2]), ([0, 1], [20, 21])]
    taps = [(), default_taps(model.config.num_hidden_layers)]  # an EAGLE-1/2 head's, an EAGLE-3 head's
    with torch.inference_mode():
        for rows, positions in cases:
            token = tokens[positions]
            compiled, streams = step(token, rows, positions, ours)
            spans = [Span(r, p, 1) for r, p in zip(rows, positions, strict=True)]
            eager, tapped = model.forward_rows(
                token, Rows.build(spans, torch.device("cpu")), theirs, torch.arange(len(rows)), taps
            )
            assert compiled.shape == eager.shape == (len(rows), model.config.vocab_size)
            assert (compiled - eager).abs().max() < 1e-4, (rows, positions)
            for tap in taps:  # what an EAGLE head drafts from, as the eager forward hands it over
                assert features(streams, tap).shape == tapped[tap].shape
                assert (features(streams, tap) - tapped[tap]).abs().max() < 1e-4, (rows, positions, tap)
        # and every step wrote the keys and values where the eager one did
        for mine, other in zip(ours, theirs, strict=True):
            assert torch.allclose(mine.k, other.k, atol=1e-4) and torch.allclose(mine.v, other.v, atol=1e-4)


def test_an_engine_that_compiles_decodes_as_the_eager_one_up_to_near_ties(compiled, eager, reference, one_torch_thread):
    loop = compiled.one_row()
    assert loop.decoding_step is not None and eager.one_row().decoding_step is None
    calls = []
    step = loop.decoding_step.compiled
    loop.decoding_step.compiled = lambda *args: calls.append(1) or step(*args)
    try:
        prompts = [eager.tokenizer(p, add_special_tokens=False).input_ids for p in _prompts()]
        baseline = [
            eager.generate(eager.tokenizer.decode(p), max_new_tokens=NEW_TOKENS, temperature=0).token_ids
            for p in prompts
        ]
        assert_equal_up_to_ties(compiled, reference, prompts, baseline, None, NEW_TOKENS, FP32_NEAR_TIE, 0.75)
    finally:
        loop.decoding_step.compiled = step
    # every step after a prompt's (its first token) ran compiled (one output that left at a near-tie
    # may be shorter than its baseline)
    assert len(calls) >= sum(len(b) - 1 for b in baseline) - NEW_TOKENS


@pytest.mark.parametrize("algorithm", ["eagle_2", "eagle_3"])
def test_a_row_with_an_eagle_head_decodes_its_plain_steps_compiled_and_drafts_as_eagerly(
    compiled, algorithm, monkeypatch, one_torch_thread
):
    """An EAGLE row's plain steps run compiled (they once ran eagerly, about twice a plain request's
    time: the engine bench's self-gated EAGLE at 0.54x baseline), and its head, fed the compiled
    step's features, drafts as when fed the eager forward's: priced alike (the compiled step at the
    eager one's cost), both loops plan the same steps and accept the same drafts. A head fed another
    layer's stream was accepted at 0.08-0.15 where these are at 0.56-0.61."""
    monkeypatch.setattr(BatchEngine, "_compiled_ratio", lambda self, n: 1.0)
    eager = Engine.from_pretrained(TARGET, eagle=HEADS, costs=CHEAP_HEADS, max_context=512, compile_decode=False)
    loop = BatchEngine(compiled, max_num_seqs=1, costs=eager.one_row().drafting.costs)
    calls = []
    step = loop.decoding_step.compiled
    loop.decoding_step.compiled = lambda *args: calls.append(1) or step(*args)
    spec = SpecParams(algorithm=algorithm)
    drafted = accepted = plain = 0
    for prompt in _prompts():
        ours = loop.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, speculative=spec)
        theirs = eager.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, speculative=spec)
        assert ours.token_ids[:8] == theirs.token_ids[:8]  # up to near-ties further on
        assert abs(ours.stats.accepted - theirs.stats.accepted) <= 1, prompt[:40]
        drafted += ours.stats.drafted
        accepted += ours.stats.accepted
        plain += ours.stats.plain_steps
    assert plain >= 6 and len(calls) == plain  # every plain step ran compiled
    assert drafted >= 10 and accepted >= 0.3 * drafted


def test_a_loop_of_many_rows_compiles_every_graph_before_its_first_request(compiled, one_torch_thread):
    loop = BatchEngine(compiled, max_num_seqs=4, costs=compiled.one_row().drafting.costs)
    step = loop.decoding_step
    assert step is compiled.decoding_step
    torch._dynamo.config.error_on_recompile = True
    try:
        with torch.inference_mode():
            for rows in ([0], [3], [1], [0, 3], [3, 0], [1, 2], [2, 1]):
                for position in (1, 2, 9, 200):
                    step(torch.tensor([7] * len(rows)), rows, [position + r for r in rows], loop.caches)
    finally:
        torch._dynamo.config.error_on_recompile = False
    # a sequence's first token, or more rows, would compile other graphs: they run eagerly
    assert not step.runs(1, 0) and not step.runs(ROWS + 1, 5) and step.runs(ROWS, 1)


def test_two_rows_decoding_run_compiled_and_as_each_alone_up_to_near_ties(compiled, one_torch_thread):
    loop = BatchEngine(compiled, max_num_seqs=2, costs=compiled.one_row().drafting.costs)
    calls: list[int] = []
    step = loop.decoding_step
    assert step is not None
    compiled_step = step.compiled
    step.compiled = lambda tokens, *rest: calls.append(tokens.numel()) or compiled_step(tokens, *rest)
    prompts = _prompts()[:2]
    try:
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda p: loop.generate(p, max_new_tokens=NEW_TOKENS, temperature=0), prompts))
    finally:
        step.compiled = compiled_step
    assert calls.count(2) >= NEW_TOKENS // 2  # most steps ran both rows in one compiled step
    for prompt, out in zip(prompts, both, strict=True):
        alone = compiled.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0)
        assert out.token_ids[:8] == alone.token_ids[:8]


def test_the_plan_prices_steps_that_run_compiled_at_the_ratio_the_loop_measured(compiled, monkeypatch):
    """Only one- and two-row decoding steps take the compiled price; verifying runs eagerly either
    way. (How much faster the compiled step is, is for benchmarks/serving.py to say, not a test.)"""
    table = compiled.one_row().drafting.costs
    monkeypatch.setattr(BatchEngine, "_compiled_ratio", lambda self, n: {1: 0.5, 2: 0.6}[n])
    costs = BatchEngine(compiled, max_num_seqs=4, costs=table).drafting.costs
    assert costs(1, 1) == pytest.approx(0.5 * table(1, 1)) and costs(2, 2) == pytest.approx(0.6 * table(2, 2))
    assert costs(1, 2) == table(1, 2) and costs(2, 4) == table(2, 4) and costs(3, 3) == table(3, 3)


def test_where_it_cannot_compile_the_loop_decodes_eagerly(compiled, eager, monkeypatch, caplog):
    def fails(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled.decoding_step, "compiled", fails)
    with caplog.at_level(logging.WARNING):
        loop = BatchEngine(compiled, max_num_seqs=1, costs=eager.one_row().drafting.costs)
    assert loop.decoding_step is None
    assert "decoding eagerly: cannot compile the decoding step here (InvalidCxxCompiler" in caplog.text
    prompt = _prompts()[0]
    ours = loop.generate(prompt, max_new_tokens=8, temperature=0)
    assert ours.token_ids == eager.generate(prompt, max_new_tokens=8, temperature=0).token_ids


def _prompts() -> list[str]:
    return [text for texts in load_prompts(2, fits=lambda text: len(text) < 1200).values() for text in texts][:6]


def test_an_engine_compiles_the_step_by_default_only_where_it_beats_the_eager_one(monkeypatch):
    """Where the eager step's products read bf16 panels (packed.py), it is the faster one (this
    step took 1.21x its time for one row, 1.35x for two): by default an engine compiles nothing
    there; without the panel kernel (an AVX2 CPU) it compiles, as it did before the panels."""
    default = Engine.from_pretrained(TARGET, costs=ALTERNATING, max_context=256)
    assert (default.decoding_step is None) == native.has_panels()
    monkeypatch.setattr(native, "has_panels", lambda: False)
    without_panels = Engine.from_pretrained(TARGET, costs=ALTERNATING, max_context=256)
    assert without_panels.decoding_step is not None and without_panels.model.kernels == "onednn"
