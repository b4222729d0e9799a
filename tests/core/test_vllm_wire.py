"""The vLLM adapter on what vLLM 0.32.0 really sends (tests/support/fixtures/vllm-0.32.0/, captured
from the real server): a vLLM that changes its wire fails here first."""

from __future__ import annotations

import json

import pytest
from support.paths import FIXTURES

from ace_mw import AceConfig, AceController, GateConfig, RequestView
from ace_mw.adapters import get_adapter
from ace_mw.adapters.base import FORCED_USAGE, Injection
from ace_mw.decide.samples import response_sample
from ace_mw.directive import SPECULATIVE_POOL
from ace_mw.observe.observer import ResponseObserver
from ace_mw.state import TenantState

VERSION = "vllm-0.32.0"
WIRE = FIXTURES / VERSION
VLLM = get_adapter("vllm")
USAGE_FORCED = Injection(SPECULATIVE_POOL, ("stream_options.include_usage",), frozenset({FORCED_USAGE}))


def payload(name: str) -> dict:
    return json.loads((WIRE / name).read_text())


def events(name: str) -> list[bytes]:
    """The stream's SSE blocks, each with its blank line."""
    return [block + b"\n\n" for block in (WIRE / name).read_bytes().split(b"\n\n") if block]


def test_the_captures_are_of_the_version_named():
    for path in WIRE.glob("*.json"):
        assert payload(path.name)["system_fingerprint"].startswith(VERSION + "-"), path.name


def test_a_response_that_drafted_nothing_is_no_evidence_about_acceptance():
    """vLLM reports draft_acceptance_rate 0.0 when prompt lookup found no match: not a zero."""
    raw = payload("ngram_chat_nonstream_nodraft.json")
    assert raw["metrics"]["speculative_decoding"]["draft_acceptance_rate"] == 0.0
    figures = VLLM.extract(raw)
    assert figures.drafted == 0 and figures.drafted_nothing
    assert figures.alpha is None
    assert figures.tau == 1.0  # every step emitted one token: that much is known


@pytest.mark.parametrize(
    "name, alpha, steps",
    [
        # 64 tokens: the first from the prefill, 21 accepted drafts, so 42 decode steps; vLLM's
        # num_spec_steps (11) counts only the steps that drafted
        ("ngram_chat_nonstream_summary.json", 21 / 44, 64 - 1 - 21),
        # every step drafted, the last one's accepted drafts cut by max_tokens: its 43 drafting steps
        ("eagle3_chat_nonstream_summary.json", 21 / 172, 43),
        ("chat_nonstream_detailed.json", 17 / 32, 48 - 1 - 17),
        ("completions_nonstream.json", 29 / 56, 48 - 1 - 29),
    ],
)
def test_tokens_per_step_counts_every_decode_step(name, alpha, steps):
    raw = payload(name)
    figures = VLLM.extract(raw)
    accepted = raw["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    assert figures.alpha == pytest.approx(alpha)
    assert figures.steps == steps
    assert figures.tau == pytest.approx(1 + accepted / steps)
    assert figures.steps >= raw["metrics"]["speculative_decoding"]["num_spec_steps"]


def test_generation_time_is_the_engines_decode_time():
    """--enable-per-request-metrics: a non-streaming answer gives the speed policy a sample."""
    raw = payload("chat_nonstream_per_request_metrics.json")
    figures = VLLM.extract(raw)
    assert figures.decode_seconds == pytest.approx(raw["metrics"]["generation_time_ms"] / 1000)
    assert figures.decode_tokens == raw["usage"]["completion_tokens"] - 1
    sample, garbage = response_sample(figures, None)
    assert not garbage and sample.source == "engine"
    # mean_itl_ms is the same time per token
    assert sample.seconds / sample.tokens == pytest.approx(raw["metrics"]["mean_itl_ms"] / 1000, rel=1e-6)


@pytest.mark.parametrize("name", ["chat_n2_nonstream.json", "plain_chat_nonstream.json"])
def test_no_metrics_no_figures(name):
    """n = 2 (metrics: null) and a plain server (no metrics) report nothing to learn."""
    assert VLLM.extract(payload(name)) is None


def observed(name: str, injection: Injection) -> tuple[bytes, list]:
    calls: list = []
    observer = ResponseObserver(VLLM, injection, lambda *args: calls.append(args[:2]))
    observer.start(200, "text/event-stream")
    forwarded = b"".join(observer.feed(chunk) for chunk in events(name))
    forwarded += observer.feed(b"", more_body=False)
    observer.finish()
    return forwarded, calls


def test_a_forced_usage_chunk_is_the_only_thing_removed_from_a_real_stream():
    chunks = events("chat_stream_include_usage.sse")
    usage = [c for c in chunks if b'"usage"' in c]
    assert len(usage) == 1 and b'"choices":[]' in usage[0]  # vLLM: usage on its own chunk
    forwarded, calls = observed("chat_stream_include_usage.sse", USAGE_FORCED)
    assert forwarded == b"".join(c for c in chunks if c is not usage[0])
    ((figures, outcome),) = calls
    assert outcome == "ok" and figures.output_tokens == 32 and figures.alpha == pytest.approx(0.6)
    assert figures.steps == 32 - 1 - 12


def test_a_stream_the_client_asked_usage_of_passes_untouched():
    raw = (WIRE / "chat_stream_detailed.sse").read_bytes()
    forwarded, calls = observed("chat_stream_detailed.sse", Injection(SPECULATIVE_POOL))
    assert forwarded == raw
    ((figures, _),) = calls
    assert figures.decode_seconds == pytest.approx(0.22020395399977133)  # null fields left out, times kept


def test_a_stream_without_usage_reports_nothing():
    forwarded, calls = observed("chat_stream_no_include_usage.sse", Injection(SPECULATIVE_POOL))
    assert forwarded == (WIRE / "chat_stream_no_include_usage.sse").read_bytes()
    assert calls == [(None, "no_figures")]


def test_no_draft_responses_never_trip_a_tenants_breaker():
    """The loop's side of defect 1: a tenant whose prompt lookup often finds no match, and accepts
    0.65 when it does, keeps speculating (were the no-draft answers zeros, its rolling acceptance
    would sit near 0.22 and trip the 0.55 breaker)."""
    gate = {"policy": "acceptance", "max_measured_per_s": 1000}
    controller = AceController(AceConfig.from_dict({"mode": "prod", "adapter": "vllm", "gate": gate}))
    nothing = payload("ngram_chat_nonstream_nodraft.json")
    drafted = payload("ngram_chat_nonstream_summary.json")
    drafted["metrics"]["speculative_decoding"].update(num_draft_tokens=20, num_accepted_draft_tokens=13)
    drafted["usage"]["completion_tokens"] = 40
    body = {"model": "ace-tiny-chat", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    for i in range(40):
        decision = controller.decide(RequestView("POST", "/v1/chat/completions", {}, body, "sk-mixed"))
        assert (decision.outcome, decision.breaker_state) == ("applied", "closed"), (i, decision.reason)
        observer = controller.observe(decision)
        observer.start(200, "application/json")
        observer.feed(json.dumps(drafted if i % 3 == 0 else nothing).encode(), more_body=False)
        observer.finish()


def test_a_request_sample_covers_the_time_to_the_first_token_too():
    """gate.speed_counts = "request": every token over queueing, prefill and decode, for arms
    whose prefill costs differ (a draft-model pool prefills the draft too); the prefill apart, with
    the prompt's length (`usage.prompt_tokens`), to be learnt at the tenant's usual prompt."""
    raw = payload("chat_nonstream_per_request_metrics.json")
    figures = VLLM.extract(raw)
    assert figures.first_token_seconds == pytest.approx(raw["metrics"]["time_to_first_token_ms"] / 1000)
    assert figures.prompt_tokens == raw["usage"]["prompt_tokens"] == 33
    decode, _ = response_sample(figures, None)
    request, _ = response_sample(figures, None, "request")
    assert decode.tokens == request.tokens == 47 and request.prompt_tokens == 33
    learnt = TenantState().record_speed("plain", request, GateConfig(), 0.0)  # the tenant's first: its usual
    assert learnt.tokens == 48
    assert learnt.seconds == pytest.approx(
        (raw["metrics"]["time_to_first_token_ms"] + raw["metrics"]["generation_time_ms"]) / 1000
    )
