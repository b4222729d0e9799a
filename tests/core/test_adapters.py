"""Engine adapters: what each one injects, reads in every documented field shape, and strips."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time

import pytest
from support.paths import FIXTURES

from ace_mw import AceConfig, AceController, RequestView, adapters
from ace_mw.acceptance import AcceptanceFigures, combine
from ace_mw.adapters import NO_INJECTION, Injection, get_adapter, register_adapter
from ace_mw.adapters.base import FORCED_META_INFO, FORCED_USAGE, count, figures
from ace_mw.decide.samples import response_sample
from ace_mw.directive import BASELINE_POOL, SPECULATIVE_POOL, SpecDirective
from ace_mw.errors import ConfigError
from ace_mw.observe.observer import ResponseObserver

ON = SpecDirective(True, "eagle_2", 4, pool=SPECULATIVE_POOL, reason="ok", measure=True)
OFF = SpecDirective(False, pool=BASELINE_POOL, reason="temperature")
NAMES = ("ace", "vllm", "sglang", "trtllm", "llamacpp")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
STREAM = {**CHAT, "stream": True}
USAGE_FORCED = Injection(SPECULATIVE_POOL, ("stream_options.include_usage",), frozenset({FORCED_USAGE}))
META_FORCED = Injection(SPECULATIVE_POOL, ("return_meta_info",), frozenset({FORCED_META_INFO}))


def extract(name: str, payload: dict) -> AcceptanceFigures | None:
    return get_adapter(name).extract(payload)


# -- registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_get_adapter_returns_the_named_engine(name):
    assert get_adapter(name).name == name


def test_unknown_adapter_raises_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"^adapter: unknown engine adapter 'tgi'") as caught:
        get_adapter("tgi")
    assert caught.value.path == "adapter"


class CustomEngine:
    """A custom engine's adapter, written to the contract in docs/adapters.md: figures are the
    top-level `drafted` / `accepted` of any JSON body or SSE event, nothing is forced."""

    name = "custom-test-engine"
    figure_markers = ("",)  # every event may hold figures
    strip_markers = ()  # nothing is ever forced, so nothing to strip

    def inject(self, body, directive):
        return body, Injection(directive.pool)

    def extract(self, payload):
        return figures(drafted=count(payload.get("drafted")), accepted=count(payload.get("accepted")))

    def strip(self, payload, injection):
        return payload


@pytest.mark.usefixtures("adapter_registry")
def test_registered_adapter_is_returned_by_name():
    custom = CustomEngine()
    register_adapter(custom)
    assert get_adapter("custom-test-engine") is custom


@pytest.mark.usefixtures("adapter_registry")
def test_registered_adapter_feeds_the_breaker_from_every_event():
    register_adapter(CustomEngine())
    controller = AceController(AceConfig.from_dict({"mode": "prod", "adapter": "custom-test-engine"}))
    decision = controller.decide(RequestView("POST", "/v1/chat/completions", {}, {"model": "m", "temperature": 0}))
    observer = controller.observe(decision)
    observer.start(200, "text/event-stream")
    stream = b'data: {"text": "hi"}\n\ndata: {"drafted": 10, "accepted": 7}\n\ndata: [DONE]\n\n'
    assert observer.feed(stream, more_body=False) == stream
    observer.finish()
    assert controller.store.view(("anonymous", "m")).rolling_alpha == pytest.approx(0.7)


@pytest.mark.usefixtures("adapter_registry")
@pytest.mark.parametrize(
    "missing, message",
    [
        ("figure_markers", r"`figure_markers` must be a tuple of str, got None"),
        ("strip_markers", r"`strip_markers` must be a tuple of str, got None"),
        ("extract", r"has no extract\(\) method"),
        ("name", r"needs a non-empty str `name`, got None"),
    ],
)
def test_adapter_missing_part_of_the_contract_is_refused_at_registration(missing, message):
    # What docs/adapters.md described before the markers were listed: this adapter used to be
    # accepted, then fail inside every response observer, so the breaker never learned.
    contract = {k: v for k, v in vars(CustomEngine).items() if not k.startswith("__")}
    partial = type("Partial", (), {k: v for k, v in contract.items() if k != missing})()
    with pytest.raises(TypeError, match=message):
        register_adapter(partial)
    assert "custom-test-engine" not in adapters._REGISTRY


@pytest.mark.usefixtures("adapter_registry")
def test_adapter_markers_must_be_strings():
    wrong = type("Wrong", (CustomEngine,), {"figure_markers": (b"spec",)})()
    with pytest.raises(TypeError, match=r"`figure_markers` must be a tuple of str"):
        register_adapter(wrong)


# -- inject: common rules ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("directive", [ON, OFF], ids=["on", "off"])
@pytest.mark.parametrize(
    "body",
    [CHAT, STREAM, {**STREAM, "stream_options": {"include_usage": False}}],
    ids=["chat", "stream", "stream_options"],
)
def test_inject_never_mutates_the_input_body(name, directive, body):
    original = copy.deepcopy(body)
    get_adapter(name).inject(body, directive)
    assert body == original


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("directive", [ON, OFF], ids=["on", "off"])
def test_injection_names_the_directive_pool(name, directive):
    assert get_adapter(name).inject(CHAT, directive)[1].pool == directive.pool


@pytest.mark.parametrize("name", ["vllm", "trtllm"])
def test_pool_routed_engine_leaves_a_plain_body_as_the_same_object(name):
    new, injection = get_adapter(name).inject(CHAT, ON)
    assert new is CHAT and injection.fields == () and injection.forced == frozenset()


# -- ace ----------------------------------------------------------------------------------------


def test_ace_enabled_writes_the_extra_body_fields():
    directive = SpecDirective(True, "draft_model", 3, draft_model="tiny-draft", tree_choices=((0,), (0, 1)))
    new, injection = get_adapter("ace").inject(CHAT, directive)
    assert {k: new[k] for k in injection.fields} == {
        "use_speculative_decoding": True,
        "num_speculative_tokens": 3,
        "speculative_algorithm": "draft_model",
        "speculative_draft_model": "tiny-draft",
        "tree_choices": [[0], [0, 1]],
    }


def test_ace_enabled_omits_unset_draft_model_and_tree():
    new, _ = get_adapter("ace").inject(CHAT, ON)
    assert "speculative_draft_model" not in new and "tree_choices" not in new


def test_ace_directive_overrides_client_sent_fields():
    body = {**CHAT, "num_speculative_tokens": 9, "use_speculative_decoding": False}
    new, _ = get_adapter("ace").inject(body, ON)
    assert new["num_speculative_tokens"] == 4 and new["use_speculative_decoding"] is True


def test_ace_disabled_turns_speculation_off_only():
    new, injection = get_adapter("ace").inject(CHAT, OFF)
    assert new == {**CHAT, "use_speculative_decoding": False} and injection.fields == ("use_speculative_decoding",)


def test_ace_stream_forces_usage_like_vllm():
    new, injection = get_adapter("ace").inject(STREAM, ON)
    assert new["stream_options"] == {"include_usage": True} and FORCED_USAGE in injection.forced


def test_ace_reads_vllm_shaped_metrics():
    payload = {
        "metrics": {
            "speculative_decoding": {"num_draft_tokens": 8, "num_accepted_draft_tokens": 6, "num_spec_steps": 2}
        },
        "usage": {"completion_tokens": 8},
    }
    assert extract("ace", payload) == AcceptanceFigures(drafted=8, accepted=6, steps=2, output_tokens=8)


# -- vLLM ---------------------------------------------------------------------------------------


def test_vllm_stream_forces_include_usage_keeping_other_stream_options():
    body = {**STREAM, "stream_options": {"continuous_usage_stats": False}}
    new, injection = get_adapter("vllm").inject(body, ON)
    assert new["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert injection.forced == frozenset({FORCED_USAGE})


def test_vllm_stream_already_asking_for_usage_forces_nothing():
    body = {**STREAM, "stream_options": {"include_usage": True}}
    new, injection = get_adapter("vllm").inject(body, ON)
    assert new is body and injection.forced == frozenset()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("payload", [STREAM, CHAT], ids=["stream", "json"])
def test_an_unread_response_gets_the_switch_but_nothing_forced(name, payload):
    """Past gate.max_measured_per_s the directive still switches speculation, measures nothing."""
    unread = dataclasses.replace(ON, measure=False)
    body, injection = get_adapter(name).inject(payload, unread)
    read_body, read = get_adapter(name).inject(payload, ON)
    assert injection.forced == frozenset() and injection.pool == read.pool
    assert body == {key: value for key, value in read_body.items() if key not in ("stream_options", "return_meta_info")}


def test_vllm_disabled_stream_forces_nothing():
    new, injection = get_adapter("vllm").inject(STREAM, OFF)
    assert new is STREAM and injection.forced == frozenset()


def test_vllm_malformed_stream_options_are_left_for_the_engine_to_reject():
    body = {**STREAM, "stream_options": "yes"}
    new, injection = get_adapter("vllm").inject(body, ON)
    assert new is body and injection.forced == frozenset()


def test_vllm_reads_top_level_metrics_in_every_name():
    payload = {
        "choices": [],
        "usage": {"completion_tokens": 31},
        "metrics": {
            "speculative_decoding": {
                "num_draft_tokens": 40,
                "num_accepted_draft_tokens": 20,
                "num_spec_steps": 10,
                "mean_acceptance_length": 3.0,
                "draft_acceptance_rate": 0.5,
                "acceptance_histogram": [1, 2],
            }
        },
    }
    figures = extract("vllm", payload)
    # 31 tokens: the prefill's first, then 10 steps of 1 + 2 accepted each
    assert figures == AcceptanceFigures(40, 20, 10, 31, reported_alpha=0.5, reported_tau=3.0)
    assert (figures.alpha, figures.tau) == (0.5, 3.0)


def test_vllm_reads_older_per_choice_stats_summed_over_choices():
    payload = {
        "choices": [
            {
                "index": 0,
                "speculative_decoding_stats": {"num_draft_tokens": 10, "num_accepted_tokens": 5, "num_drafts": 2},
            },
            {
                "index": 1,
                "speculative_decoding_stats": {"num_draft_tokens": 10, "num_accepted_tokens": 9, "num_drafts": 2},
            },
        ],
        "usage": {"completion_tokens": 22},
    }
    # vLLM counts drafting steps only: the decode steps are the tokens after each choice's first,
    # less the accepted drafts (22 - 2 - 14)
    assert extract("vllm", payload) == AcceptanceFigures(drafted=20, accepted=14, steps=6, output_tokens=22)


def test_vllm_response_without_metrics_has_no_figures():
    assert extract("vllm", {"choices": [{"index": 0, "message": {}}], "usage": {"completion_tokens": 5}}) is None


@pytest.mark.parametrize("bad", [-1, "10", True, None, 1.5, float("nan"), [3], {"n": 1}])
def test_vllm_ignores_ill_typed_counts(bad):
    stats = {"num_draft_tokens": bad, "num_accepted_draft_tokens": 4, "num_spec_steps": 2}
    figures = extract("vllm", {"metrics": {"speculative_decoding": stats}})
    assert figures.drafted is None and figures.accepted == 4
    # a field present with an unusable value is absurd: counted, never learned
    assert figures.absurd is (bad is not None)


def test_vllm_ignores_non_finite_reported_rates():
    stats = {"draft_acceptance_rate": math.inf, "mean_acceptance_length": 2.5}
    figures = extract("vllm", {"metrics": {"speculative_decoding": stats}})
    assert figures.reported_alpha is None and figures.reported_tau == 2.5
    assert figures.absurd and figures.alpha is None and figures.tau is None


def test_vllm_ignores_metrics_of_the_wrong_type():
    assert extract("vllm", {"metrics": [1, 2], "choices": "none"}) is None


def test_vllm_strip_drops_the_usage_only_chunk():
    assert get_adapter("vllm").strip({"choices": [], "usage": {"completion_tokens": 3}}, USAGE_FORCED) is None


def test_vllm_strip_removes_usage_from_a_content_chunk():
    payload = {"choices": [{"index": 0, "delta": {}}], "usage": None}
    assert get_adapter("vllm").strip(payload, USAGE_FORCED) == {"choices": [{"index": 0, "delta": {}}]}


def test_vllm_strip_keeps_an_error_event_minus_usage():
    payload = {"error": {"message": "boom"}, "usage": {"completion_tokens": 1}}
    assert get_adapter("vllm").strip(payload, USAGE_FORCED) == {"error": {"message": "boom"}}


def test_vllm_strip_keeps_chunks_without_usage_as_the_same_object():
    payload = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert get_adapter("vllm").strip(payload, USAGE_FORCED) is payload


def test_vllm_strip_keeps_usage_the_client_asked_for():
    payload = {"choices": [], "usage": {"completion_tokens": 3}}
    assert get_adapter("vllm").strip(payload, NO_INJECTION) is payload


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


# -- AcceptanceFigures.combine ------------------------------------------------------------------


def test_combine_adds_counts_and_averages_reported_ratios():
    parts = [
        AcceptanceFigures(10, 5, 2, None, 0.25, None),
        AcceptanceFigures(10, 9, None, 7, 0.5, 2.0),
        AcceptanceFigures(None, None, 3, None, 0.75, None),
    ]
    assert combine(parts) == AcceptanceFigures(20, 14, 5, 7, reported_alpha=0.5, reported_tau=2.0)


def test_combine_of_nothing_is_none():
    assert combine([]) is None


def test_figures_with_output_tokens_keep_every_other_field():
    fields = dataclasses.fields(AcceptanceFigures)
    full = AcceptanceFigures(**{f.name: i + 1 for i, f in enumerate(fields)})  # no field at its default
    assert full.with_output_tokens(999) == dataclasses.replace(full, output_tokens=999)
