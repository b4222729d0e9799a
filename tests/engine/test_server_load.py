"""The engine's server under load and faults: a client that leaves, a full line (429), a hundred
abrupt disconnects, /metrics, and the batching loop behind it (real engine, uvicorn, `openai`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_server import (
    BATCH_COSTS,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    chat,
    messages,
)
from support.servers import serve_asgi, wait_for

from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.server.app import create_app


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
