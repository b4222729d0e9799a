"""The Engine's public behaviour: streaming, stop strings, eos, limits, seeds, stats and bad requests."""

import pytest
import torch
from support.paths import MODELS

from ace_mw.engine import Engine, EngineError, SamplingParams, SpecParams
from ace_mw.engine.drafting.drafters import DraftTree
from ace_mw.engine.generation import collect
from ace_mw.engine.model.transformer import Transformer

HELLO = [{"role": "user", "content": "Write a short poem about the sea."}]
FIXED_DRAFT_MODEL = SpecParams("draft_model", 4, self_gate=False)  # four drafts every step


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return Engine.from_pretrained(MODELS / "ace-tiny-chat", draft=MODELS / "ace-tiny-chat-draft", compile_decode=False)


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy output with no stop strings: the text the other tests cut up."""
    return engine.generate(HELLO, max_new_tokens=40)


@pytest.mark.parametrize("algorithm", ["baseline", "ngram", "draft_model"])
def test_stream_chunks_add_up_to_the_generated_text_and_ids(engine, reference, algorithm):
    chunks = list(engine.stream(HELLO, max_new_tokens=40, speculative=SpecParams(algorithm, 3)))
    assert "".join(c.text for c in chunks) == reference.text
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert chunks[-1].finish_reason == reference.finish_reason and chunks[-1].stats is not None
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])


def test_stream_leaves_inference_mode_off_between_chunks(engine):
    modes = [torch.is_inference_mode_enabled() for _ in engine.stream(HELLO, max_new_tokens=8)]
    assert modes and not any(modes)


def test_max_new_tokens_limits_the_output_and_finishes_with_length(engine, reference):
    result = engine.generate(HELLO, max_new_tokens=7, speculative=SpecParams("ngram", 10))
    assert result.token_ids == reference.token_ids[:7]
    assert result.finish_reason == "length"


def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(engine, reference):
    stop = reference.text[12:16]
    result = engine.generate(HELLO, max_new_tokens=40, stop=["@@never@@", stop])
    assert result.text == reference.text[: reference.text.index(stop)]
    assert result.finish_reason == "stop"
    assert result.token_ids == reference.token_ids[: len(result.token_ids)]
    assert stop in engine.tokenizer.decode(result.token_ids)


@pytest.mark.parametrize("algorithm", ["baseline", "draft_model"])  # one token per step, and several
def test_stop_string_text_is_never_streamed(engine, reference, algorithm):
    stop = reference.text[12:16]
    streamed = "".join(
        c.text for c in engine.stream(HELLO, max_new_tokens=40, stop=stop, speculative=SpecParams(algorithm, 4))
    )
    assert streamed == reference.text[: reference.text.index(stop)]


def test_eos_token_ends_generation_without_being_emitted(engine, reference):
    eos = reference.token_ids[5]
    with_eos = Engine(
        engine.model,
        engine.tokenizer,
        draft=engine.drafts_with("draft_model"),
        max_context=engine.max_context,
        eos_ids=[eos],
    )
    result = with_eos.generate(HELLO, max_new_tokens=40, speculative=SpecParams("draft_model", 4))
    assert result.token_ids == reference.token_ids[: reference.token_ids.index(eos)]
    assert result.finish_reason == "stop"


def test_baseline_stats_count_one_step_per_token_after_the_first(engine):
    stats = engine.generate(HELLO, max_new_tokens=12).stats
    assert (stats.steps, stats.drafted, stats.accepted, stats.output_tokens) == (11, 0, 0, 12)
    assert stats.prompt_tokens == len(engine._encode(HELLO))
    assert stats.ttft_s > 0 and stats.tpot_s > 0
    assert stats.tpot_s == pytest.approx(stats.decode_time_s / 11)  # decode time excludes the prefill
    assert (stats.plain_steps, stats.plain_step_fraction, stats.expected_speedup) == (11, 1.0, 1.0)


class ScriptedDrafter:
    """Drafts from the known greedy continuation: per step, `right` tokens the target will accept,
    then `wrong` ones it will reject (the right token + 1), so every count is known in advance."""

    taps = ()

    def __init__(self, continuation: list[int], right: int, wrong: int):
        self.continuation, self.right, self.wrong = continuation, right, wrong
        self.emitted = 0

    def reset(self, input_ids, hidden):
        self.emitted = 1  # the prefill's token

    def propose(self, plan):
        at = self.emitted + self.right
        good = self.continuation[self.emitted : at]
        bad = [t + 1 for t in self.continuation[at : at + self.wrong]]
        return DraftTree.chain(torch.tensor(good + bad, dtype=torch.long))

    def accept(self, tokens, hidden):
        self.emitted += tokens.numel()


def scripted_counts(right: int, wrong: int, budget: int) -> tuple[int, int, int, int]:
    """Steps, accepted, proposed and drafted of a scripted request: each step verifies `right`
    good and `wrong` bad drafts, at most what the budget can still emit after the bonus token."""
    steps = accepted = proposed = drafted = 0
    emitted = 1  # the prefill's token
    while emitted < budget:
        k = min(right + wrong, budget - emitted - 1)
        ok = min(right, k)
        steps, accepted, proposed, drafted = steps + 1, accepted + ok, proposed + k, drafted + ok + (k > ok)
        emitted += ok + 1
    return steps, accepted, proposed, drafted


@pytest.mark.parametrize("right, wrong", [(4, 0), (2, 1), (0, 2)], ids=["all_accepted", "two_of_three", "all_rejected"])
def test_speculative_stats_count_what_a_scripted_drafter_makes_happen(engine, reference, right, wrong):
    """31 tokens = the prefill's + each step's accepted drafts and bonus token."""
    asked = engine.prepare(
        HELLO, SamplingParams(max_new_tokens=31), SpecParams("ngram", right + wrong, self_gate=False), {}
    )
    result = collect(engine.one_row().decode(asked, ScriptedDrafter(reference.token_ids, right, wrong)))
    stats = result.stats
    assert result.token_ids == reference.token_ids[:31]  # rejected drafts never leak into the output
    steps, accepted, proposed, drafted = scripted_counts(right, wrong, 31)
    assert (stats.output_tokens, stats.steps, stats.accepted) == (31, steps, accepted)
    assert (stats.proposed, stats.drafted) == (proposed, drafted)  # drafted: accepted positions + the one rejected
    assert stats.acceptance_rate == pytest.approx(accepted / drafted if drafted else 0.0)
    assert stats.accepted_per_step == pytest.approx((accepted + steps) / steps)
    if not wrong:
        assert (stats.steps, stats.accepted_per_step) == (6, 5.0)


def test_draft_model_drafts_four_tokens_per_step_by_default(engine):
    """Fixed drafting: four drafts every step, as long as the budget can still emit them (the last
    steps may be cut to 3, 2, 1 and none)."""
    stats = engine.generate(HELLO, max_new_tokens=40, speculative=SpecParams("draft_model", self_gate=False)).stats
    assert stats.plain_steps <= 1
    assert 4 * (stats.steps - stats.plain_steps) - (3 + 2 + 1) <= stats.proposed <= 4 * stats.steps


def test_drafted_counts_accepted_positions_plus_one_rejection_per_stopped_step(engine):
    stats = engine.generate(HELLO, max_new_tokens=60, speculative=FIXED_DRAFT_MODEL).stats
    fully_accepted_steps = stats.steps - (stats.drafted - stats.accepted)
    assert 0 <= stats.drafted - stats.accepted <= stats.steps
    assert stats.accepted >= 4 * fully_accepted_steps
    assert stats.drafted <= stats.proposed


def test_same_seed_reproduces_sampled_output(engine):
    runs = [
        engine.generate(
            HELLO, max_new_tokens=16, temperature=1.0, seed=7, speculative=SpecParams("draft_model", 3)
        ).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_different_seeds_give_different_samples(engine):
    outs = {tuple(engine.generate(HELLO, max_new_tokens=16, temperature=1.0, seed=s).token_ids) for s in range(4)}
    assert len(outs) > 1


def test_sampling_leaves_the_global_rng_alone(engine):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(HELLO, max_new_tokens=4, temperature=1.0)
    assert torch.equal(torch.rand(3), expected)


def test_text_content_parts_read_like_a_string(engine, reference):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Write a short poem "}, {"type": "text", "text": "about the sea."}],
        }
    ]
    assert engine.generate(parts, max_new_tokens=40).token_ids == reference.token_ids


def test_prompt_string_is_used_without_the_chat_template(engine):
    assert engine.generate("def add(a, b):", max_new_tokens=3).prompt_tokens == len(
        engine.tokenizer("def add(a, b):", add_special_tokens=False).input_ids
    )


def test_prompt_too_long_for_the_context_raises(engine):
    with pytest.raises(EngineError, match=f"context is {engine.max_context}"):
        engine.generate("word " * engine.max_context, max_new_tokens=4)


def test_output_stops_at_the_end_of_the_context(engine):
    own_model = Transformer.from_pretrained(MODELS / "ace-tiny-chat")  # setup_cache resizes it
    small = Engine(own_model, engine.tokenizer, max_context=40)
    result = small.generate(HELLO, max_new_tokens=50, speculative=SpecParams("ngram", 10))
    assert result.prompt_tokens + len(result.token_ids) == 40
    assert result.finish_reason == "length"


@pytest.mark.parametrize(
    "spec, message",
    [
        (SpecParams("medusa"), "algorithm 'medusa' is unknown"),
        (SpecParams("ngram", num_speculative_tokens=0), r"num_speculative_tokens must be in \[1, 32\], got 0"),
        (SpecParams("draft_model", num_speculative_tokens=33), "got 33"),
        (SpecParams("eagle_2"), "needs an EAGLE head"),
    ],
)
def test_bad_speculative_params_raise(engine, spec, message):
    with pytest.raises(EngineError, match=message):
        engine.generate(HELLO, speculative=spec)


def test_draft_model_without_a_draft_raises(engine):
    bare = Engine(engine.model, engine.tokenizer, max_context=engine.max_context)
    with pytest.raises(EngineError, match="needs a draft model"):
        bare.generate(HELLO, speculative=SpecParams("draft_model"))


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty list"),
        ({"role": "user"}, "non-empty list"),
        (["hello"], r"messages\[0\]: expected an object"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content: expected a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
        ([{"content": "hi"}], r"messages\[0\].role must be one of"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\].role must be one of system, developer"),
    ],
)
def test_bad_messages_raise(engine, messages, message):
    with pytest.raises(EngineError, match=message):
        engine.generate(messages)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_raise(engine, kwargs, message):
    with pytest.raises(EngineError, match=message):
        engine.generate(HELLO, **kwargs)


def test_errors_raise_when_stream_is_called_not_when_iterated(engine):
    with pytest.raises(EngineError):
        engine.stream(HELLO, speculative=SpecParams("nope"))
