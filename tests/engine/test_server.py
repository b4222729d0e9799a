"""The engine's OpenAI-compatible server: real engine, real uvicorn on loopback, real `openai` client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.batching import DRAFT
from support.engine_costs import ALTERNATING
from support.engine_server import (
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    SPECULATIVE,
    chat,
    messages,
)
from support.servers import serve_asgi

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.engine import Engine
from ace_mw.engine.server.app import create_app
from ace_mw.errors import ConfigError
from ace_mw.integrations import AceSpecDec


@pytest.fixture(scope="module")
def base_url(engine):
    with serve_asgi(create_app(engine, model_name=MODEL, draft_model_name=DRAFT.name)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def test_chat_completion_returns_baseline_text_and_usage(client, solo):
    response = chat(client, PROMPTS[0])
    assert response.choices[0].message.content == solo[PROMPTS[0]]
    assert response.usage.completion_tokens <= MAX_TOKENS
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def assert_decode_speed_figures(stats: dict, completion_tokens: int, wall_s: float) -> None:
    """The engine's own speed figures: decode time after the first token, plain share, estimate."""
    assert 0 < stats["decode_time_s"] < wall_s and completion_tokens > 1
    assert 0.0 <= stats["plain_step_fraction"] <= 1.0 and stats["expected_speedup"] > 0


def test_baseline_request_reports_plain_metrics_for_the_plain_arm(client):
    started = time.perf_counter()
    response = chat(client, PROMPTS[0], extra_body={"use_speculative_decoding": False})
    stats = response.model_extra["metrics"]["speculative_decoding"]
    assert_decode_speed_figures(stats, response.usage.completion_tokens, time.perf_counter() - started)
    assert stats["algorithm"] == "baseline"
    assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"], stats["num_proposed_draft_tokens"]) == (
        0,
        0,
        0,
    )
    assert stats["num_spec_steps"] == response.usage.completion_tokens - 1  # one plain step per token after the first
    assert stats["draft_acceptance_rate"] is None  # nothing drafted: no rate to learn from
    assert (stats["plain_step_fraction"], stats["expected_speedup"], stats["mean_acceptance_length"]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("algorithm", SPECULATIVE)
def test_self_gated_speculation_reports_its_plain_share_and_expected_speedup(client, solo, algorithm):
    started = time.perf_counter()
    response = chat(client, PROMPTS[1], extra_body={"speculative_algorithm": algorithm})
    stats = response.model_extra["metrics"]["speculative_decoding"]
    assert response.choices[0].message.content == solo[PROMPTS[1]]
    assert_decode_speed_figures(stats, response.usage.completion_tokens, time.perf_counter() - started)
    assert 0.0 < stats["plain_step_fraction"] < 1.0  # the forced costs make it mix
    assert stats["num_draft_tokens"] > 0 and stats["algorithm"] == algorithm


@pytest.mark.parametrize("algorithm", SPECULATIVE)
def test_extra_body_speculation_is_lossless_and_reports_vllm_metrics(client, solo, algorithm):
    response = chat(
        client,
        PROMPTS[0],
        extra_body={"use_speculative_decoding": True, "speculative_algorithm": algorithm, "num_speculative_tokens": 3},
    )
    stats = response.model_extra["metrics"]["speculative_decoding"]
    assert response.choices[0].message.content == solo[PROMPTS[0]]
    assert stats["num_spec_steps"] > 0
    assert 0 <= stats["num_accepted_draft_tokens"] <= stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(
        1 + stats["num_accepted_draft_tokens"] / stats["num_spec_steps"]
    )  # vLLM's definition, bonus token included


def test_speculation_without_an_algorithm_uses_the_best_loaded_drafter(client, solo):
    response = chat(client, PROMPTS[0], extra_body={"use_speculative_decoding": True})
    expected = "eagle_3"  # the best loaded: the engine has both heads (support/batching.every_drafter)
    assert response.model_extra["metrics"]["speculative_decoding"]["algorithm"] == expected
    assert response.choices[0].message.content == solo[PROMPTS[0]]


def test_streaming_chat_equals_non_streaming_text(client, solo):
    stream = chat(client, PROMPTS[1], stream=True, extra_body={"speculative_algorithm": "ngram"})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solo[PROMPTS[1]]


@pytest.mark.parametrize("algorithm", ["baseline", "draft_model"])
def test_stream_usage_chunk_carries_usage_and_metrics(client, algorithm):
    started = time.perf_counter()
    stream = chat(
        client,
        PROMPTS[1],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculative_algorithm": algorithm},
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens > 0
    stats = last.model_extra["metrics"]["speculative_decoding"]
    assert stats["num_spec_steps"] > 0 and stats["algorithm"] == algorithm
    assert_decode_speed_figures(stats, last.usage.completion_tokens, time.perf_counter() - started)
    assert all("metrics" not in c.model_extra for c in chunks[:-1])  # only the last chunk carries them


@pytest.mark.parametrize("algorithm", ["baseline", "draft_model"])
def test_stream_without_usage_puts_metrics_on_finish_chunk(client, algorithm):
    chunks = list(chat(client, PROMPTS[1], stream=True, extra_body={"speculative_algorithm": algorithm}))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage is None
    stats = chunks[-1].model_extra["metrics"]["speculative_decoding"]
    assert stats["decode_time_s"] > 0 and stats["algorithm"] == algorithm
    assert (stats["num_draft_tokens"] > 0) == (algorithm != "baseline")


def test_completions_endpoint_streams_the_same_text_as_it_returns(client):
    kwargs = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": MAX_TOKENS, "temperature": 0.0}
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole


def test_seeded_sampling_is_reproducible(client):
    first, second = (chat(client, PROMPTS[2], temperature=0.9, seed=7).choices[0].message.content for _ in range(2))
    assert first == second


def test_concurrent_requests_each_equal_their_solo_output(client, solo):
    algorithms = ("baseline",) + SPECULATIVE
    jobs = [(p, algorithms[i % len(algorithms)], stream) for i, p in enumerate(PROMPTS) for stream in (False, True)]

    def run(job):
        prompt, algorithm, stream = job
        extra = {"speculative_algorithm": algorithm}
        if not stream:
            return chat(client, prompt, extra_body=extra).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or "" for c in chat(client, prompt, stream=True, extra_body=extra) if c.choices
        )

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    assert texts == [solo[prompt] for prompt, _, _ in jobs]


BAD_BODIES = {
    "invalid_messages": {"messages": [{"role": "robot", "content": "hi"}]},
    "empty_messages": {"messages": []},
    "unknown_algorithm": {"messages": messages("hi"), "speculative_algorithm": "medusa"},
    "k_out_of_range": {"messages": messages("hi"), "speculative_algorithm": "draft_model", "num_speculative_tokens": 0},
    "k_too_large": {
        "messages": messages("hi"),
        "speculative_algorithm": "draft_model",
        "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1,
    },
    "bad_temperature": {"messages": messages("hi"), "temperature": 7},
    "prompt_too_long": {"messages": messages("word " * 5000)},
    "unknown_draft_model": {"messages": messages("hi"), "speculative_draft_model": "gpt-5-draft"},
    "bad_tree_choices": {"messages": messages("hi"), "speculative_algorithm": "eagle", "tree_choices": [[-1]]},
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_request_returns_openai_400(base_url, case):
    response = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, **BAD_BODIES[case]}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_invalid_json_returns_400(base_url):
    response = httpx.post(
        base_url + "/v1/chat/completions",
        content=b'{"messages": [',
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_openai_client_raises_bad_request_with_param(client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "hi", extra_body={"speculative_algorithm": "medusa"})
    assert raised.value.body["param"] == "speculative_algorithm"


def test_streaming_bad_request_is_a_400_not_a_broken_stream(base_url):
    body = {"model": MODEL, "messages": messages("word " * 5000), "stream": True}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


def test_unknown_model_returns_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages("hi"), max_tokens=2)


def test_models_endpoint_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


# --- the ace-mw middleware in front of the engine server --------------------------------------


@pytest.fixture(scope="module")
def gated_url(engine):
    config = AceConfig.from_dict(
        {
            "mode": "prod",
            "adapter": "ace",
            "speculative": {"algorithm": "draft_model", "num_speculative_tokens": 4, "draft_model": DRAFT.name},
        }
    )
    app = AceSpecDec(
        create_app(engine, model_name=MODEL, draft_model_name=DRAFT.name), controller=AceController(config)
    )
    with serve_asgi(app) as url:
        yield url


def test_middleware_applies_speculation_at_temperature_zero(gated_url, solo):
    body = {"model": MODEL, "messages": messages(PROMPTS[0]), "max_tokens": MAX_TOKENS, "temperature": 0.0}
    response = httpx.post(gated_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.headers["x-ace-speculative-decoding"] == "applied"
    assert response.json()["metrics"]["speculative_decoding"]["algorithm"] == "draft_model"
    assert response.json()["choices"][0]["message"]["content"] == solo[PROMPTS[0]]


def test_middleware_gates_hot_temperature_to_baseline(gated_url):
    body = {"model": MODEL, "messages": messages(PROMPTS[0]), "max_tokens": MAX_TOKENS, "temperature": 1.0}
    response = httpx.post(gated_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.headers["x-ace-speculative-decoding"] == "gated"
    stats = response.json()["metrics"]["speculative_decoding"]  # the plain arm is measured too
    assert (stats["algorithm"], stats["plain_step_fraction"], stats["num_draft_tokens"]) == ("baseline", 1.0, 0)


def test_middleware_applied_stream_reports_metrics_to_the_openai_client(gated_url):
    client = openai.OpenAI(base_url=gated_url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
    chunks = list(chat(client, PROMPTS[2], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].model_extra["metrics"]["speculative_decoding"]["algorithm"] == "draft_model"


def test_the_largest_k_a_config_accepts_is_served_by_the_engine(engine, solo):
    """The config's limit on K is the engine's (one constant): at the boundary the middleware gets
    speculation with every step drafting K tokens (the server drafts fixed sizes here, not only what
    pays), not a 400; one more is a ConfigError at load."""
    speculative = {"algorithm": "draft_model", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS}
    config = AceConfig.from_dict({"mode": "prod", "adapter": "ace", "speculative": speculative})
    server = create_app(engine, model_name=MODEL, draft_model_name=DRAFT.name, self_gate=False)
    app = AceSpecDec(server, config=config)
    # room for the first step's K drafts and its bonus token after the first token
    body = {
        "model": MODEL,
        "messages": messages(PROMPTS[1]),
        "max_tokens": MAX_SPECULATIVE_TOKENS + 2,
        "temperature": 0.0,
    }
    with serve_asgi(app) as url:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200
    assert response.headers["x-ace-speculative-decoding"] == "applied"
    metrics = response.json()["metrics"]["speculative_decoding"]
    # the first step drafts all K; later ones as many as the answer's budget can still emit
    assert (
        MAX_SPECULATIVE_TOKENS
        <= metrics["num_proposed_draft_tokens"]
        <= MAX_SPECULATIVE_TOKENS * metrics["num_spec_steps"]
    )
    assert response.json()["choices"][0]["message"]["content"].startswith(solo[PROMPTS[1]])
    speculative["num_speculative_tokens"] += 1
    with pytest.raises(ConfigError, match=rf"num_speculative_tokens: must be in \[1, {MAX_SPECULATIVE_TOKENS}\]"):
        AceConfig.from_dict({"mode": "prod", "adapter": "ace", "speculative": speculative})


def test_n_above_one_says_what_to_do(base_url):
    body = {"model": MODEL, "messages": messages("hi"), "n": 2}
    error = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()["error"]
    assert (
        error["param"] == "n"
        and error["message"] == "n = 2: this server returns one choice per request; send 2 requests instead"
    )


def test_a_drafter_the_server_did_not_load_names_the_flag_that_loads_it(engine):
    bare = Engine(engine.model, engine.tokenizer, max_context=engine.max_context, costs=ALTERNATING)
    body = {"model": MODEL, "messages": messages("hi"), "speculative_algorithm": "eagle_3"}
    with serve_asgi(create_app(bare, model_name=MODEL)) as url:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "missing_drafter"
    assert "needs an EAGLE-3 head" in error["message"] and "--eagle DIR (ace-mw serve)" in error["message"]
