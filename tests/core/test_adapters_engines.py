"""Engine adapters of SGLang, TensorRT-LLM and llama.cpp: what each injects, reads in every
documented field shape (llama.cpp's also as its real server answers), and strips."""

from __future__ import annotations

import json
import time

import pytest
from support.adapters import CHAT, META_FORCED, OFF, ON, STREAM, USAGE_FORCED, extract
from support.paths import FIXTURES

from ace_mw.acceptance import AcceptanceFigures
from ace_mw.adapters import NO_INJECTION, get_adapter
from ace_mw.adapters.base import FORCED_META_INFO
from ace_mw.decide.samples import response_sample
from ace_mw.observe.observer import ResponseObserver

# -- SGLang -------------------------------------------------------------------------------------


def test_sglang_non_streaming_forces_return_meta_info():
    new, injection = get_adapter("sglang").inject({**CHAT, "max_tokens": 512}, ON)
    assert new["return_meta_info"] is True and injection.forced == frozenset({FORCED_META_INFO})


@pytest.mark.parametrize(
    "limits, forced",
    [
        ({}, False),  # no limit: up to the model's context
        ({"max_tokens": 17_000}, False),
        ({"max_completion_tokens": 8_000, "max_tokens": 100_000}, True),  # the newer name wins, as in OpenAI's API
        ({"max_tokens": 2_000, "n": 8}, True),
        ({"max_tokens": 2_000, "n": 9}, False),
        ({"max_tokens": 2_000, "logprobs": True, "top_logprobs": 5}, True),
        ({"max_tokens": 2_000, "logprobs": True, "top_logprobs": 20}, False),
        ({"max_tokens": "512"}, False),
        ({"max_tokens": True}, False),
        ({"max_tokens": 512, "n": 0}, False),
    ],
)
def test_sglang_forces_meta_info_only_into_answers_that_fit_the_hold(limits, forced):
    new, injection = get_adapter("sglang").inject({**CHAT, **limits}, ON)
    assert ("return_meta_info" in new) is forced and bool(injection.forced) is forced


def test_sglang_stream_gets_usage_not_return_meta_info():
    new, injection = get_adapter("sglang").inject(STREAM, ON)
    assert "return_meta_info" not in new and new["stream_options"] == {"include_usage": True}
    assert injection.forced == frozenset({"usage"})
    usage_chunk = {"choices": [], "usage": {"completion_tokens": 3}}
    assert get_adapter("sglang").strip(usage_chunk, injection) is None


def test_sglang_client_asking_for_meta_info_forces_nothing():
    body = {**CHAT, "return_meta_info": True}
    new, injection = get_adapter("sglang").inject(body, ON)
    assert new is body and injection.forced == frozenset()


def test_sglang_native_generate_body_is_left_alone():
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 8}}
    assert get_adapter("sglang").inject(body, ON)[0] is body


def test_sglang_disabled_forces_nothing():
    assert get_adapter("sglang").inject(CHAT, OFF)[0] is CHAT


def test_sglang_reads_current_meta_info_names_per_choice():
    info = {
        "completion_tokens": 12,
        "spec_verify_ct": 4,
        "spec_accept_length": 3.0,
        "spec_accept_rate": 0.5,
        "spec_num_correct_drafts": 8,
        "spec_num_proposed_drafts": 16,
    }
    figures = extract("sglang", {"choices": [{"index": 0, "meta_info": info}]})
    assert figures == AcceptanceFigures(16, 8, 4, 12, reported_alpha=0.5, reported_tau=3.0)


def test_sglang_reads_older_token_count_names():
    info = {"spec_verify_ct": 5, "spec_accept_token_num": 7, "spec_draft_token_num": 20}
    figures = extract("sglang", {"choices": [{"index": 0, "meta_info": info}], "usage": {"completion_tokens": 12}})
    assert figures == AcceptanceFigures(drafted=20, accepted=7, steps=5, output_tokens=12)


def test_sglang_reads_native_top_level_meta_info():
    payload = {"text": "...", "meta_info": {"completion_tokens": 9, "spec_verify_ct": 3, "spec_accept_length": 3.0}}
    figures = extract("sglang", payload)
    assert (figures.steps, figures.output_tokens, figures.tau) == (3, 9, 3.0)


def test_sglang_sums_meta_info_over_choices():
    infos = [{"completion_tokens": 6, "spec_verify_ct": 2}, {"completion_tokens": 10, "spec_verify_ct": 4}]
    figures = extract("sglang", {"choices": [{"index": i, "meta_info": m} for i, m in enumerate(infos)]})
    assert (figures.steps, figures.output_tokens) == (6, 16)


def test_sglang_meta_info_without_speculation_has_no_figures():
    assert extract("sglang", {"choices": [{"index": 0, "meta_info": {"completion_tokens": 5}}]}) is None


def test_sglang_strip_removes_forced_meta_info_only():
    payload = {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "meta_info": {"spec_verify_ct": 1}}]}
    assert get_adapter("sglang").strip(payload, META_FORCED) == {
        "id": "x",
        "choices": [{"index": 0, "message": {"content": "hi"}}],
    }
    assert "meta_info" in payload["choices"][0]  # the input stays untouched


def test_sglang_strip_without_forcing_keeps_the_payload():
    payload = {"choices": [{"index": 0, "meta_info": {}}]}
    assert get_adapter("sglang").strip(payload, NO_INJECTION) is payload


# -- TensorRT-LLM -------------------------------------------------------------------------------


def test_trtllm_reads_avg_decoded_tokens_per_iter_as_tau():
    figures = extract("trtllm", {"choices": [{"index": 0, "avg_decoded_tokens_per_iter": 2.5}]})
    assert figures.tau == 2.5 and figures.alpha is None


def test_trtllm_averages_tau_over_choices():
    payload = {
        "choices": [{"index": 0, "avg_decoded_tokens_per_iter": 2.0}, {"index": 1, "avg_decoded_tokens_per_iter": 3.0}]
    }
    assert extract("trtllm", payload).tau == 2.5


def test_trtllm_reads_the_proposed_per_choice_object_in_vllm_names():
    choice = {
        "index": 0,
        "avg_decoded_tokens_per_iter": 2.5,
        "speculative_decoding": {"num_draft_tokens": 12, "num_accepted_draft_tokens": 6, "num_spec_steps": 4},
    }
    figures = extract("trtllm", {"choices": [choice], "usage": {"completion_tokens": 10}})
    assert figures == AcceptanceFigures(12, 6, 4, 10, reported_tau=2.5)


def test_trtllm_plain_choice_has_no_figures():
    assert extract("trtllm", {"choices": [{"index": 0, "delta": {"content": "x"}}]}) is None


def test_trtllm_strip_keeps_the_payload():
    payload = {"choices": []}
    assert get_adapter("trtllm").strip(payload, USAGE_FORCED) is payload


# -- llama.cpp ----------------------------------------------------------------------------------


def test_llamacpp_enabled_sets_n_max_to_k():
    new, injection = get_adapter("llamacpp").inject(CHAT, ON)
    assert new["speculative.n_max"] == 4 and injection.fields == ("speculative.n_max",)


def test_llamacpp_disabled_sets_n_max_to_zero():
    assert get_adapter("llamacpp").inject({**CHAT, "speculative.n_max": 16}, OFF)[0]["speculative.n_max"] == 0


def test_llamacpp_reads_timings_and_derives_steps():
    """predicted_n counts the first token too, which comes from the prefill: 29 tokens were
    decoded in predicted_ms, over 29 - 18 = 11 steps."""
    timings = {"predicted_n": 30, "draft_n": 24, "draft_n_accepted": 18, "predicted_ms": 100.0}
    figures = extract("llamacpp", {"choices": [], "timings": timings})
    assert figures == AcceptanceFigures(
        drafted=24, accepted=18, steps=11, output_tokens=30, decode_seconds=0.1, decode_tokens=29
    )
    assert figures.alpha == 0.75 and figures.tau == pytest.approx(29 / 11)  # tokens per decode step


def test_llamacpp_timings_without_drafting_give_only_the_decode_speed():
    figures = extract("llamacpp", {"timings": {"predicted_n": 30, "predicted_ms": 100.0}})
    assert figures == AcceptanceFigures(decode_seconds=0.1, decode_tokens=29)
    assert figures.alpha is None


@pytest.mark.parametrize("predicted_n", [0, 1])
def test_llamacpp_a_first_token_alone_gives_no_speed(predicted_n):
    """timings_per_token's first chunk says predicted_n 1, predicted_ms 0.001: nothing was decoded
    yet (read as a rate it was a million tokens per second)."""
    assert extract("llamacpp", {"timings": {"predicted_n": predicted_n, "predicted_ms": 0.001}}) is None


def test_llamacpp_timings_without_a_time_give_nothing():
    assert extract("llamacpp", {"timings": {"predicted_n": 30}}) is None


LLAMACPP_FIXTURES = FIXTURES / "llamacpp"  # recorded from the real server: its README


def last_timings(raw: bytes) -> dict:
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: {")]
    return [json.loads(e)["timings"] for e in events if '"timings"' in e][-1]


@pytest.mark.parametrize("name", ["draft.json", "plain.json", "ngram.json", "n-max-zero.json"])
def test_llamacpp_reads_real_answers_as_the_server_reports_them(name):
    """The decode speed is the server's own predicted_per_second; steps are decode steps."""
    payload = json.loads((LLAMACPP_FIXTURES / name).read_bytes())
    timings = payload["timings"]
    found = extract("llamacpp", payload)
    sample, garbage = response_sample(found, None)
    assert not garbage and sample.rate == pytest.approx(timings["predicted_per_second"], rel=1e-9)
    if "draft_n" in timings:
        assert (found.drafted, found.accepted) == (timings["draft_n"], timings["draft_n_accepted"])
        assert found.steps == timings["predicted_n"] - 1 - timings["draft_n_accepted"]
    else:
        assert found.alpha is None


@pytest.mark.parametrize("name", ["draft.sse", "draft-usage.sse", "draft-per-token.sse", "plain.sse"])
def test_llamacpp_reads_real_streams_as_the_server_reports_them(name):
    """Streamed, the figures ride the last chunk (every chunk with timings_per_token, as running
    totals, the first at predicted_n 1): the observer keeps the latest, never the first."""
    raw = (LLAMACPP_FIXTURES / name).read_bytes()
    seen = []
    observer = ResponseObserver(
        get_adapter("llamacpp"), None, lambda f, o, t: seen.append((f, o, t)), clock=time.monotonic
    )
    observer.start(200, "text/event-stream")
    forwarded = b"".join(observer.feed(raw[i : i + 97], more_body=i + 97 < len(raw)) for i in range(0, len(raw), 97))
    observer.finish()
    assert forwarded == raw
    (figures_, outcome, timing), timings = seen[0], last_timings(raw)
    sample, _ = response_sample(figures_, timing)
    assert outcome == "ok" and sample.source == "engine"
    assert sample.rate == pytest.approx(timings["predicted_per_second"], rel=1e-9)
    if "draft_n" in timings:
        assert figures_.accepted == timings["draft_n_accepted"] and figures_.drafted == timings["draft_n"]


def test_llamacpp_strip_keeps_the_payload():
    payload = {"timings": {}}
    assert get_adapter("llamacpp").strip(payload, NO_INJECTION) is payload
