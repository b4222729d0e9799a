"""ResponseObserver: forwards every byte (minus only what we forced), reads figures, fails open."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from support.adapters import META_FORCED, USAGE_FORCED
from support.observing import (
    EXPECTED,
    SPEC,
    USAGE_ONLY,
    VLLM_STREAM,
    block,
    content,
    endings,
    json_body,
    observe,
    run,
)

from ace_mw.adapters import NO_INJECTION
from ace_mw.observe.observer import (
    NO_FIGURES,
    OK,
    TOO_LARGE,
)

# -- pass-through ------------------------------------------------------------------------------


def test_sse_chunks_are_forwarded_as_the_same_objects():
    observer, _ = observe()
    chunks = [block(content("a")), b'data: {"cho', b'ices": []}\n\n']
    assert all(observer.feed(chunk) is chunk for chunk in chunks)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), ending=endings, noise=st.binary(max_size=30))
def test_forwarded_bytes_equal_the_input_for_any_split(data, ending, noise):
    stream = (
        b"\xef\xbb\xbf: ping"
        + ending
        + block(content("h\u2028i"), ending)
        + noise
        + ending * 2
        + block(USAGE_ONLY, ending)
        + block("[DONE]", ending)
    )
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    observer, recorder = observe()
    assert run(observer, stream, cuts) == stream
    assert recorder.calls == [(EXPECTED, OK)]


def test_events_without_a_marker_are_never_json_parsed():
    observer, _ = observe()
    run(observer, b"data: {not json\n\n" + block(USAGE_ONLY))
    assert observer.garbage == 0 and observer.figures == EXPECTED


def test_broken_json_carrying_a_marker_is_counted_and_skipped():
    observer, recorder = observe()
    run(observer, b'data: {"speculative_decoding": oops\n\n' + block(USAGE_ONLY))
    assert observer.garbage == 1 and recorder.calls == [(EXPECTED, OK)]


def test_stream_without_figures_finishes_with_no_figures():
    observer, recorder = observe()
    run(observer, block(content("x")) + block("[DONE]"))
    assert recorder.calls == [(None, NO_FIGURES)]


def test_content_type_parameters_and_case_are_ignored():
    observer, _ = observe(content_type="Text/Event-Stream; charset=utf-8")
    run(observer, block(USAGE_ONLY))
    assert observer.figures == EXPECTED


# -- removing what we forced -------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.data(), ending=endings)
def test_forced_usage_chunk_is_removed_for_any_split(data, ending):
    kept = [block(content("Hel"), ending), b": ping" + ending + ending, block(content("lo"), ending)]
    stream = kept[0] + kept[1] + kept[2] + block(USAGE_ONLY, ending) + block("[DONE]", ending)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    observer, recorder = observe(injection=USAGE_FORCED)
    assert run(observer, stream, cuts) == b"".join(kept) + block("[DONE]", ending)
    assert recorder.calls == [(EXPECTED, OK)]


def test_usage_field_on_a_content_chunk_is_rewritten_in_place():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "é"}}], "usage": None}
    original = b"event: delta\nid: 7\ndata: " + json.dumps(chunk).encode() + b"\n\n"
    observer, _ = observe(injection=USAGE_FORCED)
    forwarded = run(observer, block(content("a")) + original + block("[DONE]"))
    # only the member goes, with its comma: every other byte as the engine wrote it (an escape too)
    data = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "\\u00e9"}}]}'
    rewritten = b"event: delta\nid: 7\ndata: " + data + b"\n\n"
    assert forwarded == block(content("a")) + rewritten + block("[DONE]")


def test_a_stripped_chunk_keeps_every_number_as_the_engine_wrote_it():
    """vLLM writes -0.000014781842764932662 where Python writes -1.4781842764932662e-05: a chunk
    whose forced usage is cut out (continuous_usage_stats puts it on every chunk) keeps the rest
    byte for byte, spacing, escapes and numbers alike."""
    text = (
        '{"id":"c","choices":[{"index":0,"delta":{"content":"\\u00e9 x"},'
        '"logprobs":{"content":[{"logprob":-0.000014781842764932662,"top":1E+2}]}}],'
        '"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1} , "z" : 1.50}'
    )
    observer, _ = observe(injection=USAGE_FORCED)
    forwarded = run(observer, b"data: " + text.encode() + b"\n\n" + block("[DONE]"))
    kept = text.replace(',"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}', "")
    assert forwarded == b"data: " + kept.encode() + b"\n\n" + block("[DONE]")


def test_rewritten_event_keeps_a_lone_surrogate_escape_as_valid_json():
    original = b'data: {"choices":[{"index":0,"delta":{"content":"\\ud800"}}],"usage":null}\n\n'
    observer, _ = observe(injection=USAGE_FORCED)
    forwarded = run(observer, original)
    assert json.loads(forwarded[len(b"data: ") :]) == {"choices": [{"index": 0, "delta": {"content": "\ud800"}}]}


def test_removed_event_ending_in_a_cut_crlf_takes_its_lf_along():
    observer, _ = observe(injection=USAGE_FORCED)
    usage = block(USAGE_ONLY, b"\r\n")
    stream = block(content("a"), b"\r\n") + usage + block("[DONE]", b"\r\n")
    cut = len(stream) - len(block("[DONE]", b"\r\n")) - 1  # between the usage event's last CR and LF
    assert run(observer, stream, [cut]) == block(content("a"), b"\r\n") + block("[DONE]", b"\r\n")


def test_unfinished_event_is_held_until_its_blank_line():
    observer, _ = observe(injection=USAGE_FORCED)
    first = block(content("a"))
    assert observer.feed(first + b'data: {"cho') == first
    assert observer.feed(b'ices": []}\n\n') == b'data: {"choices": []}\n\n'


def test_unterminated_tail_is_forwarded_with_the_last_chunk():
    observer, _ = observe(injection=USAGE_FORCED)
    assert observer.feed(b"data: partial") == b""
    assert observer.feed(b"", more_body=False) == b"data: partial"


def test_block_larger_than_the_line_cap_is_not_held():
    observer, _ = observe(injection=USAGE_FORCED, max_line=64)
    big = b"data: " + b"x" * 100
    assert observer.feed(big) == big


def test_usage_the_client_asked_for_is_kept():
    observer, _ = observe(injection=NO_INJECTION)
    assert run(observer, VLLM_STREAM, range(0, len(VLLM_STREAM), 7)) == VLLM_STREAM


# -- JSON bodies -------------------------------------------------------------------------------


def test_json_chunks_are_forwarded_at_once_and_read_at_finish():
    body = json_body(metrics={"speculative_decoding": SPEC})
    observer, recorder = observe(content_type="application/json")
    assert [observer.feed(body[:10]), observer.feed(body[10:])] == [body[:10], body[10:]]
    observer.finish()
    assert recorder.calls == [(EXPECTED, OK)]


def test_json_body_over_the_cap_is_forwarded_unread():
    body = json_body(metrics={"speculative_decoding": SPEC})
    observer, recorder = observe(content_type="application/json", max_body=32)
    assert run(observer, body, [16]) == body
    assert recorder.calls == [(None, TOO_LARGE)]


def test_forced_meta_info_is_removed_from_a_held_json_body():
    meta = {"completion_tokens": 13, "spec_verify_ct": 3, "spec_num_correct_drafts": 9, "spec_num_proposed_drafts": 12}
    body = json.dumps({"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "meta_info": meta}]}).encode()
    observer, recorder = observe("sglang", META_FORCED, content_type="application/json")
    assert observer.holds_body and observer.rewrites_body
    assert observer.feed(body[:20]) == b""
    kept = b'{"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}}]}'
    assert observer.feed(body[20:], more_body=False) == kept
    observer.finish()
    assert recorder.calls == [(EXPECTED, OK)]


def test_held_json_body_never_flushed_still_yields_figures():
    meta = {"completion_tokens": 13, "spec_verify_ct": 4}
    body = json.dumps({"choices": [{"index": 0, "meta_info": meta}]}).encode()
    observer, recorder = observe("sglang", META_FORCED, content_type="application/json")
    observer.feed(body)
    observer.finish()
    assert recorder.calls[0][0].steps == 4


def test_held_json_body_over_the_cap_is_released_whole():
    body = json_body()
    observer, recorder = observe("sglang", META_FORCED, content_type="application/json", max_body=40)
    assert observer.feed(body[:30]) + observer.feed(body[30:]) == body
    observer.finish()
    assert recorder.calls == [(None, TOO_LARGE)]


def test_held_json_body_that_is_not_json_is_forwarded_unchanged():
    observer, _ = observe("sglang", META_FORCED, content_type="application/json")
    assert run(observer, b"<html>oops</html>", [5]) == b"<html>oops</html>"


def test_batch_json_answer_combines_its_items():
    items = [
        {"text": "a", "meta_info": {"completion_tokens": 6, "spec_verify_ct": 2}},
        {"text": "b", "meta_info": {"completion_tokens": 7, "spec_verify_ct": 2}},
    ]
    observer, _ = observe("sglang", content_type="application/json")
    run(observer, json.dumps(items).encode())
    assert (observer.figures.steps, observer.figures.output_tokens) == (4, 13)
