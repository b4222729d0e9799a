"""AceSpecDec behind uvicorn, driven by the real `openai` client and by raw httpx."""

from __future__ import annotations

import httpx
import openai
import pytest
from support.servers import serve_asgi
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw.config import AceConfig, hash_key
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDec

CONFIG = {
    "mode": "prod",
    "allow_header_override": True,
    "keys": {
        "sk-off": {"mode": "off"},
        hash_key("sk-three"): {"speculative": {"num_speculative_tokens": 3, "algorithm": "eagle"}},
        "sk-no-override": {"allow_header_override": False},
    },
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def upstream():
    return FakeUpstream(Script(figures=figures(10, 8, 4)))


@pytest.fixture(scope="module")
def controller():
    return AceController(AceConfig.from_dict(CONFIG))


@pytest.fixture(scope="module")
def base_url(upstream, controller):
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        yield url


def client(base_url: str, key: str = "sk-default") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=10)


def test_streaming_chat_content_reaches_openai_client(base_url):
    stream = client(base_url).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] == 10


def test_non_streaming_chat_reaches_openai_client(base_url):
    response = client(base_url).chat.completions.create(model="m", messages=MESSAGES, temperature=0.2)
    assert response.choices[0].message.content == "Hello, world"
    assert response.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] == 8


def test_streamed_bytes_equal_upstream_bytes(base_url, upstream):
    body = {
        "model": "m",
        "messages": MESSAGES,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-default"}
    ) as response:
        received = b"".join(response.iter_raw())
    assert received == b"".join(upstream.sent[-1])


def test_json_response_bytes_equal_upstream_bytes(base_url, upstream):
    body = {"model": "m", "messages": MESSAGES, "temperature": 0}
    response = httpx.post(base_url + "/v1/chat/completions", json=body)
    assert response.content == b"".join(upstream.sent[-1])


def test_applied_directive_is_injected_into_upstream_body(base_url, upstream):
    client(base_url).chat.completions.create(model="m", messages=MESSAGES, temperature=0.0)
    sent = upstream.received[-1].json
    assert sent["use_speculative_decoding"] is True
    assert sent["num_speculative_tokens"] == 5
    assert sent["speculative_algorithm"] == "eagle_2"
    assert int(upstream.received[-1].headers["content-length"]) == len(upstream.received[-1].body)


def test_extra_body_fields_survive_injection(base_url, upstream):
    client(base_url).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, extra_body={"top_k": 3, "repetition_penalty": 1.1}
    )
    sent = upstream.received[-1].json
    assert (sent["top_k"], sent["repetition_penalty"], sent["messages"]) == (3, 1.1, MESSAGES)


def test_decision_headers_reach_client(base_url):
    raw = client(base_url).chat.completions.with_raw_response.create(model="m", messages=MESSAGES, temperature=0.0)
    assert raw.headers["x-ace-speculative-decoding"] == "applied"
    assert raw.headers["x-ace-speculative-decoding-reason"] == "ok"


def test_high_temperature_is_gated(base_url, upstream):
    raw = client(base_url).chat.completions.with_raw_response.create(model="m", messages=MESSAGES, temperature=1.3)
    assert (raw.headers["x-ace-speculative-decoding"], raw.headers["x-ace-speculative-decoding-reason"]) == (
        "gated",
        "temperature",
    )
    assert upstream.received[-1].json["use_speculative_decoding"] is False


def test_key_in_mode_off_leaves_body_untouched(base_url, upstream):
    raw = client(base_url, "sk-off").chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0.0
    )
    assert raw.headers["x-ace-speculative-decoding"] == "off"
    assert "use_speculative_decoding" not in upstream.received[-1].json


def test_key_settings_choose_speculative_parameters(base_url, upstream):
    client(base_url, "sk-three").chat.completions.create(model="m", messages=MESSAGES, temperature=0.0)
    sent = upstream.received[-1].json
    assert (sent["num_speculative_tokens"], sent["speculative_algorithm"]) == (3, "eagle")


def test_override_header_turns_speculation_off(base_url, upstream):
    raw = client(base_url).chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0.0, extra_headers={"X-ACE-Skill-Speculative-Decoding": "OFF"}
    )
    assert raw.headers["x-ace-speculative-decoding"] == "off"
    assert "use_speculative_decoding" not in upstream.received[-1].json


def test_override_header_ignored_for_key_without_permission(base_url):
    raw = client(base_url, "sk-no-override").chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0.0, extra_headers={"X-ACE-Skill-Speculative-Decoding": "off"}
    )
    assert raw.headers["x-ace-speculative-decoding"] == "applied"


def test_invalid_override_header_returns_400(base_url, upstream):
    before = len(upstream.received)
    with pytest.raises(openai.BadRequestError) as caught:
        client(base_url).chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"X-ACE-Skill-Speculative-Decoding": "turbo"}
        )
    assert caught.value.code == "invalid_speculative_decoding_mode"
    assert "turbo" in caught.value.message
    assert len(upstream.received) == before


def test_legacy_completions_stream_through(base_url, upstream):
    stream = client(base_url).completions.create(model="m", prompt="hi", temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Hello, world"
    assert upstream.received[-1].json["use_speculative_decoding"] is True


def test_forced_usage_chunk_is_removed_from_stream(base_url, upstream):
    stream = client(base_url).chat.completions.create(model="m", messages=MESSAGES, temperature=0.0, stream=True)
    chunks = list(stream)
    assert upstream.received[-1].json["stream_options"] == {"include_usage": True}
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"


def test_acceptance_figures_reach_the_breaker(upstream, controller):
    # A key of its own, so the count is this test's alone.
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        for _ in range(3):
            list(
                client(url, "sk-figures").chat.completions.create(
                    model="fig", messages=MESSAGES, temperature=0.0, stream=True
                )
            )
    view = controller.store.view((tenant("sk-figures"), "fig"))
    assert view.samples == 3 and view.rolling_alpha == pytest.approx(0.8)
