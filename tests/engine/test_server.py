"""The engine's OpenAI-compatible server: real engine, real uvicorn on loopback, real `openai` client."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_costs import ALTERNATING
from support.paths import MODELS
from support.servers import serve_asgi, wait_for

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.engine import Engine
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.planning.batch import BatchCosts
from ace_mw.engine.planning.cost import CostCurve
from ace_mw.engine.server.app import create_app
from ace_mw.errors import ConfigError
from ace_mw.integrations import AceSpecDec

TARGET = MODELS / "ace-tiny-chat"
DRAFT = MODELS / "ace-tiny-chat-draft"
EAGLE, EAGLE3 = MODELS / "ace-tiny-chat-eagle", MODELS / "ace-tiny-chat-eagle3"
HAS_EAGLE, HAS_EAGLE3 = (EAGLE / "config.json").exists(), (EAGLE3 / "config.json").exists()
MODEL = "ace-tiny-chat"
MAX_TOKENS = 16
PROMPTS = (
    "Write a Python function that reverses a string.",
    "Summarize the plot of Hamlet in one sentence.",
    "What is the capital of France?",
    "Solve for x: 2x + 3 = 11.",
)
SPECULATIVE = (
    ("draft_model", "ngram") + (("eagle", "eagle_2") if HAS_EAGLE else ()) + (("eagle_3",) if HAS_EAGLE3 else ())
)


# Batched steps priced as a memory-bound machine's: fixed per forward, a little per token.
BATCH_COSTS = BatchCosts({b: CostCurve({1: 10.0 + b, 16: 12.0 + 4 * b}) for b in (1, 2, 4, 8)})


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine():
    # A forced cost table: self-gated requests mix plain and speculative steps, on any machine.
    heads = [str(h) for h, shipped in ((EAGLE, HAS_EAGLE), (EAGLE3, HAS_EAGLE3)) if shipped]
    return Engine.from_pretrained(str(TARGET), eagle=heads, draft=str(DRAFT), costs=ALTERNATING, compile_decode=False)


@pytest.fixture(scope="module")
def base_url(engine):
    with serve_asgi(create_app(engine, model_name=MODEL, draft_model_name=DRAFT.name)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def solo(engine) -> dict[str, str]:
    """Each prompt's greedy baseline text, decoded alone (the reference every server answer must equal)."""
    return {p: engine.generate(messages(p), max_new_tokens=MAX_TOKENS, temperature=0.0).text for p in PROMPTS}


def chat(client: openai.OpenAI, text: str, temperature: float = 0.0, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages(text), max_tokens=MAX_TOKENS, temperature=temperature, **kwargs
    )


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
    expected = "eagle_3" if HAS_EAGLE3 else "eagle_2" if HAS_EAGLE else "draft_model"
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


class SpyEngine:
    """The real engine, with a record of how far each stream was pulled and whether it was closed."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.model_name = engine.model_name
        self.max_num_seqs = engine.max_num_seqs
        self.pulled = 0
        self.closed = threading.Event()

    def runs(self, algorithm):
        return self._engine.runs(algorithm)

    def generate(self, *args, **kwargs):
        return self._engine.generate(*args, **kwargs)

    async def astream(self, *args, **kwargs):
        try:
            async for chunk in self._engine.astream(*args, **kwargs):
                self.pulled += 1
                yield chunk
        finally:
            self.closed.set()


def test_client_disconnect_mid_stream_stops_generation_and_frees_the_engine(engine, solo):
    spy = SpyEngine(engine.one_row())
    body = {
        "model": MODEL,
        "messages": messages(PROMPTS[3]),
        "max_tokens": 1000,
        "temperature": 0.0,
        "stream": True,
        "speculative_algorithm": "baseline",
    }
    with serve_asgi(create_app(spy, model_name=MODEL)) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            next(response.iter_raw())
        wait_for(spy.closed.is_set, timeout=30, what="the engine stream to be closed")
        again = httpx.post(
            url + "/v1/chat/completions", timeout=60, json={**body, "stream": False, "max_tokens": MAX_TOKENS}
        ).json()
    assert spy.pulled < 1000
    assert again["choices"][0]["message"]["content"] == solo[PROMPTS[3]]


class HeldEngine(SpyEngine):
    """The real engine, whose streams pause after their first chunk until `go` is set: a request
    that holds the engine for as long as a test needs."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.go = threading.Event()

    async def astream(self, *args, **kwargs):
        i = 0
        async for chunk in super().astream(*args, **kwargs):
            if i == 1:
                await anyio.to_thread.run_sync(self.go.wait, 60)
            i += 1
            yield chunk


def test_past_the_queue_bound_a_request_gets_429_with_retry_after_and_the_line_still_moves(engine, solo):
    """One request holds the engine, one waits (the bound is 1): the next is refused at once, with
    Retry-After; the waiting one is served, unchanged, once the engine is free."""
    held = HeldEngine(engine.one_row())
    hold = {"model": MODEL, "messages": messages(PROMPTS[0]), "max_tokens": 64, "temperature": 0.0, "stream": True}
    with serve_asgi(create_app(held, model_name=MODEL, max_waiting=1)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)

        def health() -> dict:
            return httpx.get(url + "/health", timeout=10).json()

        with httpx.stream("POST", url + "/v1/chat/completions", json=hold, timeout=60) as stream:
            # kept: an iterator dropped at once would close the connection, and a stream whose
            # client left frees the engine at once
            received = stream.iter_raw()
            next(received)
            assert health()["running"] == 1
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(chat, client, PROMPTS[3])
                wait_for(lambda: health()["waiting"] == 1, timeout=30, what="the second request to wait")
                # Refused while the held request still runs: had it queued, it would wait for a
                # request that is only released below, and time out instead.
                with pytest.raises(openai.RateLimitError) as refused:
                    chat(client, PROMPTS[2])
                assert int(refused.value.response.headers["retry-after"]) >= 1
                assert refused.value.body["code"] == "queue_full"
                assert "--max-waiting" in refused.value.body["message"]
                assert scrape(url)[("ace_engine_requests_total", (("status", "429"),))] == 1
                held.go.set()
                assert waiting.result(timeout=60).choices[0].message.content == solo[PROMPTS[3]]
        assert health() == {"status": "ok", "model": MODEL, "running": 0, "waiting": 0}


class CountingEngine(SpyEngine):
    """The real engine, counting the streams it started and those that ended (closed or finished)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.started = self.ended = 0
        self._lock = threading.Lock()

    async def astream(self, *args, **kwargs):
        with self._lock:
            self.started += 1
        try:
            async for chunk in super().astream(*args, **kwargs):
                yield chunk
        finally:
            with self._lock:
                self.ended += 1


@pytest.mark.parametrize("rows", [1, 4], ids=["one-at-a-time", "batching"])
def test_a_hundred_abrupt_disconnects_under_load_leak_nothing(engine, solo, rows):
    """Eight clients, 100 streams in all, each dropped abruptly: after its first chunk, or while it
    still waits for the engine. Every engine stream ends, the line empties (a batch's rows too),
    and the server answers the next request as it would have alone."""
    served = engine.one_row() if rows == 1 else BatchEngine(engine, rows, costs=BATCH_COSTS)
    counting = CountingEngine(served)
    body = {"model": MODEL, "messages": messages(PROMPTS[1]), "max_tokens": 1000, "temperature": 0.0, "stream": True}

    def drop(i: int) -> None:
        try:
            # odd ones give up after 50 ms: most of them while they wait for the engine
            timeout = httpx.Timeout(60, read=0.05) if i % 2 else 60
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as response:
                next(response.iter_raw())
        except httpx.ReadTimeout:
            pass

    with serve_asgi(create_app(counting, model_name=MODEL)) as url:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(drop, range(100)))

        def idle() -> bool:
            state = httpx.get(url + "/health", timeout=10).json()
            return state["running"] == 0 and state["waiting"] == 0 and counting.ended == counting.started

        wait_for(idle, timeout=60, what="every dropped stream to free the engine")
        wait_for(lambda: getattr(served, "running", 0) == 0, timeout=5, what="every batch row to be freed")
        assert counting.started >= 50  # the even half all reached the engine
        # those that left while they waited cost the engine nothing when their turn came
        gone = scrape(url).get(("ace_engine_requests_total", (("status", "499"),)), 0)
        assert gone >= 1 and counting.started == 100 - gone
        after = httpx.post(
            url + "/v1/chat/completions", timeout=60, json={**body, "stream": False, "max_tokens": MAX_TOKENS}
        ).json()
    assert after["choices"][0]["message"]["content"] == solo[PROMPTS[1]]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics, parsed by prometheus_client: (sample name, its labels) -> value."""
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_answers_tokens_latency_and_acceptance_per_algorithm(engine):
    with serve_asgi(create_app(engine, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
        before = scrape(url)
        plain = chat(client, PROMPTS[0])
        streamed = list(chat(client, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
        lookup = chat(client, PROMPTS[2], extra_body={"speculative_algorithm": "ngram"})
        with pytest.raises(openai.BadRequestError):
            chat(client, "hi", extra_body={"speculative_algorithm": "medusa"})
        after = scrape(url)
    assert before[("ace_engine_requests_running", ())] == 0 and before[("ace_engine_requests_waiting", ())] == 0
    assert after[("ace_engine_requests_total", (("status", "200"),))] == 3
    assert after[("ace_engine_requests_total", (("status", "400"),))] == 1
    tokens = plain.usage.completion_tokens + streamed[-1].usage.completion_tokens + lookup.usage.completion_tokens
    assert after[("ace_engine_output_tokens_total", ())] == tokens
    assert after[("ace_engine_time_to_first_token_seconds_count", ())] == 3
    assert 0 < after[("ace_engine_time_to_first_token_seconds_sum", ())] < 30
    spec = lookup.model_extra["metrics"]["speculative_decoding"]
    ngram = (("algorithm", "ngram"),)
    assert after[("ace_engine_draft_tokens_total", ngram)] == spec["num_draft_tokens"]
    assert after[("ace_engine_accepted_draft_tokens_total", ngram)] == spec["num_accepted_draft_tokens"]
    assert after[("ace_engine_draft_tokens_total", (("algorithm", "baseline"),))] == 0


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


# --- the batching engine behind the server ------------------------------------------------------


def test_concurrent_streams_share_the_batch_and_each_gets_its_solo_answer(engine, solo):
    """Eight streaming `openai` clients on four rows: answers as each prompt alone gets them, and
    /metrics shows steps that ran several rows."""
    batch = BatchEngine(engine, 4, costs=BATCH_COSTS)
    with serve_asgi(create_app(batch, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)

        def streamed(text: str) -> str:
            chunks = chat(client, text, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(streamed, PROMPTS * 2))
        figures = scrape(url)
    assert answers == [solo[p] for p in PROMPTS * 2]
    steps, rows = figures[("ace_engine_batch_steps_total", ())], figures[("ace_engine_batch_rows_total", ())]
    assert rows > 1.5 * steps  # mean decoding rows per step
    assert ("ace_engine_batch_speculating_rows_total", ()) in figures


def test_a_repeated_system_prompt_is_reported_as_cached_prompt_tokens(engine, solo):
    """Prefix caching through the real client: the second request with the same system prompt reports
    the tokens its row held in `usage.prompt_tokens_details.cached_tokens` (and /metrics sums them),
    and answers what the same request gets from a server that computes every prompt."""
    system = {"role": "system", "content": "You are a terse assistant who answers in one short sentence."}
    answers, cached = {}, {}
    for caching in (True, False):
        batch = BatchEngine(engine, 2, costs=BATCH_COSTS, prefix_caching=caching)
        with serve_asgi(create_app(batch, model_name=MODEL)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
            for text in PROMPTS[:2]:
                response = client.chat.completions.create(
                    model=MODEL, messages=[system, *messages(text)], max_tokens=MAX_TOKENS, temperature=0.0
                )
                answers[caching, text] = response.choices[0].message.content
                cached[caching, text] = response.usage.prompt_tokens_details.cached_tokens
            figures = scrape(url)
        assert figures[("ace_engine_prefix_cached_tokens_total", ())] == sum(
            n for (on, _), n in cached.items() if on == caching
        )
    system_tokens = len(engine._encode([system, *messages("")])) - 8  # the system turn, less a margin for the user's
    assert cached[True, PROMPTS[0]] == 0 and cached[True, PROMPTS[1]] >= system_tokens
    assert cached[False, PROMPTS[1]] == 0
    assert all(answers[True, p] == answers[False, p] for p in PROMPTS[:2])


@pytest.mark.parametrize("rows", [1, 4], ids=["one-at-a-time", "batching"])
def test_a_prompt_beyond_the_context_gets_a_400_naming_the_limit(engine, rows):
    served = engine if rows == 1 else BatchEngine(engine, rows, costs=BATCH_COSTS)
    with serve_asgi(create_app(served, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, "tell me more " * 1000, stream=True)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert f"context is {engine.max_context}" in refused.value.body["message"]
