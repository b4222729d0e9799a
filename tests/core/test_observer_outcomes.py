"""ResponseObserver: other engines' streams, outcomes and failures (failing open), a real stream over
loopback, and token chunks alike but for their text (the template fast path)."""

from __future__ import annotations

import httpx
import pytest
from support.adapters import USAGE_FORCED
from support.observing import (
    EXPECTED,
    SPEC,
    SSE,
    USAGE_ONLY,
    VLLM_STREAM,
    Recorder,
    block,
    content,
    json_body,
    observe,
    run,
)
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

from ace_mw.acceptance import AcceptanceFigures
from ace_mw.adapters import NO_INJECTION, get_adapter
from ace_mw.directive import SpecDirective
from ace_mw.observe.observer import (
    ABORTED,
    HTTP_ERROR,
    NOT_OBSERVED,
    OBSERVER_ERROR,
    OK,
    SERVER_ERROR,
    ResponseObserver,
)

# -- other engines' streams ---------------------------------------------------------------------


def test_llamacpp_figures_come_from_the_last_chunk():
    last = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "timings": {"predicted_n": 13, "draft_n": 12, "draft_n_accepted": 9},
    }
    observer, _ = observe("llamacpp")
    run(observer, block(content("a")) + block(last) + block("[DONE]"))
    # 13 tokens: the first from the prefill, then 12 in 3 decode steps of 1 + accepted drafts
    assert observer.figures == AcceptanceFigures(drafted=12, accepted=9, steps=3, output_tokens=13)


def test_running_figures_keep_the_latest_report():
    chunks = [{"choices": [{"index": 0, "delta": {}, "avg_decoded_tokens_per_iter": tau}]} for tau in (1.0, 2.0, 2.5)]
    observer, _ = observe("trtllm")
    run(observer, b"".join(block(c) for c in chunks))
    assert observer.figures.tau == 2.5


# -- outcomes and failure handling --------------------------------------------------------------


@pytest.mark.parametrize(
    "status, outcome", [(400, HTTP_ERROR), (429, HTTP_ERROR), (500, SERVER_ERROR), (503, SERVER_ERROR)]
)
def test_error_status_yields_no_figures(status, outcome):
    """A 5xx says the pool did not serve the request (outliers.py counts it); a 4xx is the client's."""
    observer, recorder = observe(status=status, content_type="application/json")
    body = json_body(metrics={"speculative_decoding": SPEC})
    assert run(observer, body) == body
    assert recorder.calls == [(None, outcome)]


def test_an_unread_response_still_says_its_pool_failed():
    observer, recorder = observe(status=502, content_type="application/json", reads=False)
    assert run(observer, b"{}") == b"{}"
    assert recorder.calls == [(None, SERVER_ERROR)]


def test_other_content_types_are_not_observed():
    observer, recorder = observe(content_type="text/plain")
    assert run(observer, block(USAGE_ONLY)) == block(USAGE_ONLY)
    assert recorder.calls == [(None, NOT_OBSERVED)]


def test_feed_before_start_passes_bytes_through():
    observer = ResponseObserver(get_adapter("vllm"), None, Recorder())
    assert observer.feed(b"data: x\n\n") == b"data: x\n\n"


def test_finish_is_idempotent_and_reports_once():
    observer, recorder = observe()
    observer.feed(block(USAGE_ONLY))
    assert observer.finish() == observer.finish() == EXPECTED
    assert len(recorder.calls) == 1


def test_finish_with_error_reports_aborted_with_partial_figures():
    observer, recorder = observe()
    observer.feed(block(USAGE_ONLY) + b'data: {"cho')
    observer.finish(error="disconnect")
    assert recorder.calls == [(EXPECTED, ABORTED)] and observer.error == "disconnect"


def test_on_finish_raising_does_not_reach_the_caller():
    def explode(figures, outcome, timing):
        raise RuntimeError("callback bug")

    observer = ResponseObserver(get_adapter("vllm"), None, explode)
    observer.start(200, SSE)
    observer.finish()
    assert observer.errors == 1


class BrokenAdapter:
    """An adapter whose reader crashes: the observer must fail open around it."""

    name = "broken"
    figure_markers = ("usage",)
    strip_markers = ("usage",)

    def extract(self, payload):
        raise RuntimeError("adapter bug")

    def strip(self, payload, injection):
        return payload


def test_adapter_failure_fails_open_forwarding_every_byte():
    recorder = Recorder()
    observer = ResponseObserver(BrokenAdapter(), None, recorder)
    observer.start(200, SSE)
    assert run(observer, VLLM_STREAM, [5, 40]) == VLLM_STREAM
    assert recorder.calls == [(None, OBSERVER_ERROR)] and observer.errors == 1


def test_adapter_failure_while_holding_releases_the_held_bytes():
    recorder = Recorder()
    observer = ResponseObserver(BrokenAdapter(), USAGE_FORCED, recorder)
    observer.start(200, SSE)
    usage = block(USAGE_ONLY)
    assert observer.feed(usage[:10]) + observer.feed(usage[10:]) + observer.feed(b"rest") == usage + b"rest"


# -- a real stream over loopback ----------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream():
    fake = FakeUpstream(Script(chunks=tuple("Hello, world! 123"), figures=figures(12, 9, 4)))
    with serve_asgi(fake.app) as url:
        yield fake, url


def test_real_stream_loses_only_the_forced_usage_chunk(upstream):
    fake, url = upstream
    body, injection = get_adapter("vllm").inject(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        SpecDirective(True, measure=True),
    )
    recorder = Recorder()
    observer = ResponseObserver(get_adapter("vllm"), injection, recorder)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        observer.start(response.status_code, response.headers["content-type"])
        forwarded = b"".join(observer.feed(chunk) for chunk in response.iter_raw())
    forwarded += observer.feed(b"", more_body=False)
    observer.finish()
    sent = fake.sent[-1]
    assert forwarded == b"".join(c for c in sent if b'"usage"' not in c)
    assert recorder.calls == [
        (
            AcceptanceFigures(
                # vLLM's steps counted drafting steps only: the decode took 17 - 1 - 9 steps
                drafted=12,
                accepted=9,
                steps=7,
                output_tokens=17,
                reported_alpha=0.75,
                reported_tau=3.25,
            ),
            OK,
        )
    ]


def test_real_json_response_is_forwarded_unchanged_and_read(upstream):
    fake, url = upstream
    recorder = Recorder()
    observer = ResponseObserver(get_adapter("vllm"), NO_INJECTION, recorder)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": "m", "messages": []}) as response:
        observer.start(response.status_code, response.headers["content-type"])
        forwarded = b"".join(observer.feed(chunk) for chunk in response.iter_raw())
    observer.finish()
    assert forwarded == fake.sent[-1][0]
    assert recorder.calls[0][0].alpha == 0.75


# -- token chunks alike but for their text (the template fast path) ------------------------------


def chunk_feed(observer: ResponseObserver, chunks: list[bytes]) -> bytes:
    """Feed whole chunks, one per event as engines stream them, the last flagged."""
    out = [observer.feed(c, more_body=i < len(chunks) - 1) for i, c in enumerate(chunks)]
    observer.finish()
    return b"".join(out)


LOOKALIKES = [
    content("tok"),
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": 'a "quoted" b'}}]},
    content("back\\slash"),
    content("line\nbreak"),
    content(""),  # the same shape, but no token
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": None}}]},
    content("mid"),
]


def judged(chunks: list[bytes], shortcut: bool, measured: bool) -> tuple:
    observer, recorder = observe("vllm", USAGE_FORCED, clock=iter(range(1000)).__next__ if measured else None)
    if not shortcut:
        observer._template_misses = 99  # every chunk through the full checks
    forwarded = chunk_feed(observer, chunks)
    timing = recorder.timings[0]
    timed = (timing.chunks, timing.first, timing.last, timing.usage_tokens) if measured else None
    return forwarded, timed, recorder.calls


@pytest.mark.parametrize("measured", [True, False])
def test_chunks_alike_but_for_their_text_are_judged_like_any_other(measured):
    """Token chunks that differ only in their text take a shortcut after the first one; what is
    forwarded, timed, read and stripped is what the full checks give for every one of them."""
    chunks = [block(content(f"t{i}")) for i in range(5)]
    # The same bytes around the value, but the value closes the object and adds a top-level usage.
    smuggled = block(content("t0")).replace(
        b'"t0"}}]', b'"x"}}], "usage": {"completion_tokens": 42}, "more": [{"delta": {"content": "z"}}]'
    )
    chunks += [block(p) for p in LOOKALIKES] + [smuggled, block(content("t9")), block("[DONE]")]
    with_shortcut = judged(chunks, shortcut=True, measured=measured)
    assert with_shortcut == judged(chunks, shortcut=False, measured=measured)
    forwarded = with_shortcut[0]
    assert b"completion_tokens" not in forwarded  # the forced usage was cut out of the smuggling chunk
    if measured:  # token-bearing: t0..t4, 5 lookalikes, the smuggling chunk, t9; usage read from it
        assert with_shortcut[1] == (12, 0, 11, 42)  # the clock ticks once per token chunk


def test_a_value_that_is_not_a_plain_string_teaches_no_shortcut():
    tool_call = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}
    chunks = [block(tool_call), block(tool_call), block(content("a")), block(content("b")), block("[DONE]")]
    observer, recorder = observe("vllm", clock=iter(range(100)).__next__)
    assert chunk_feed(observer, chunks) == b"".join(chunks)
    assert recorder.timings[0].chunks == 4


def test_a_stream_whose_chunks_keep_differing_stops_trying_the_shortcut():
    chunks = [block({**content(f"t{i}"), "id": f"chunk-{i}"}) for i in range(12)] + [block("[DONE]")]
    observer, recorder = observe("vllm", clock=iter(range(100)).__next__)
    assert chunk_feed(observer, chunks) == b"".join(chunks)
    assert recorder.timings[0].chunks == 12
    assert observer._template is None  # gave up: every chunk took the full checks


@pytest.mark.parametrize("ending", [b"\n", b"\r", b"\r\n"])
def test_keep_alive_comments_between_events_pass_at_once_while_stripping(ending):
    """A ping line with no blank line after it (idle-timeout heartbeats during a long prefill) is
    forwarded as it arrives, not held until the next event ends."""
    observer, recorder = observe(injection=USAGE_FORCED)
    ping = b": ping" + ending
    assert observer.feed(ping) == ping
    assert observer.feed(ping + ping) == ping + ping
    first = block(content("a"), ending)
    assert observer.feed(first + ping) == first + ping
    assert observer.feed(b"data: {" + ending + b": inside an event" + ending) == b""  # part of a block
    assert observer.feed(b"}" + ending) == b""
    assert observer.feed(ending) == b"data: {" + ending + b": inside an event" + ending + b"}" + ending + ending
    assert run(observer, ping + block(USAGE_ONLY, ending) + block("[DONE]", ending)) == ping + block("[DONE]", ending)
    assert recorder.calls[0][1] == OK


def test_a_deeply_nested_event_is_garbage_not_a_reason_to_stop_stripping():
    """json.loads raises RecursionError on deep nesting: that event is not ours, so it is kept and
    counted as garbage; the forced usage chunk after it is still removed."""
    nested = '{"usage": ' + "[" * 100_000 + "]" * 100_000 + "}"
    stream = block(content("a")) + block(nested) + block(USAGE_ONLY) + block("[DONE]")
    observer, recorder = observe(injection=USAGE_FORCED)
    assert run(observer, stream) == block(content("a")) + block(nested) + block("[DONE]")
    assert (observer.errors, observer.garbage, observer.unstripped) == (0, 1, False)
    assert recorder.calls == [(EXPECTED, OK)]
