"""Engine adapters: the registry, the rules every adapter keeps, and what ace and vLLM inject, read in
every documented field shape, and strip (SGLang, TensorRT-LLM and llama.cpp: test_adapters_engines.py)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from support.adapters import CHAT, OFF, ON, STREAM, USAGE_FORCED, extract

from ace_mw import AceConfig, AceController, RequestView, adapters
from ace_mw.acceptance import AcceptanceFigures, combine
from ace_mw.adapters import NO_INJECTION, Injection, get_adapter, register_adapter
from ace_mw.adapters.base import FORCED_USAGE, count, figures
from ace_mw.directive import SpecDirective
from ace_mw.errors import ConfigError

NAMES = ("ace", "vllm", "sglang", "trtllm", "llamacpp")


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
