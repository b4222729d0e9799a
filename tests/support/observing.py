"""What the response observer's tests share (core/test_observer.py, core/test_observer_outcomes.py):
vLLM-shaped chunks and figures, an observer of a named adapter with a recorder of what it reported,
and a way to feed it a stream cut anywhere."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from ace_mw.acceptance import AcceptanceFigures
from ace_mw.adapters import NO_INJECTION, get_adapter
from ace_mw.observe.observer import ResponseObserver

SSE = "text/event-stream"
# 13 tokens: the prefill's first, then 3 decode steps of 1 + 3 accepted drafts each
SPEC = {"num_draft_tokens": 12, "num_accepted_draft_tokens": 9, "num_spec_steps": 3}
EXPECTED = AcceptanceFigures(drafted=12, accepted=9, steps=3, output_tokens=13)


def content(text: str) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE_ONLY = {"id": "c", "choices": [], "usage": {"completion_tokens": 13}, "metrics": {"speculative_decoding": SPEC}}


def block(payload, ending: bytes = b"\n") -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return b"data: " + data.encode() + ending + ending


class Recorder:
    """on_finish target: what the observer reported, and how often."""

    def __init__(self) -> None:
        self.calls: list[tuple[AcceptanceFigures | None, str]] = []
        self.timings: list = []

    def __call__(self, figures, outcome, timing) -> None:
        self.calls.append((figures, outcome))
        self.timings.append(timing)


def observe(adapter="vllm", injection=NO_INJECTION, status=200, content_type=SSE, **options):
    recorder = Recorder()
    observer = ResponseObserver(get_adapter(adapter), injection, recorder, **options)
    observer.start(status, content_type)
    return observer, recorder


def run(observer: ResponseObserver, stream: bytes, cuts=()) -> bytes:
    """Feed `stream` cut at `cuts`, the last chunk flagged, and return what would be forwarded."""
    out, start = [], 0
    for cut in sorted(set(cuts)) + [len(stream)]:
        out.append(observer.feed(stream[start:cut], more_body=cut < len(stream)))
        start = cut
    observer.finish()
    return b"".join(out)


VLLM_STREAM = block(content("Hel")) + block(content("lo")) + block(USAGE_ONLY) + block("[DONE]")
endings = st.sampled_from([b"\n", b"\r", b"\r\n"])  # what may end an SSE line


def json_body(**extra) -> bytes:
    """A JSON answer of 13 tokens, with `extra` fields."""
    return json.dumps(
        {
            "id": "x",
            "choices": [{"index": 0, "message": {"content": "hi"}}],
            "usage": {"completion_tokens": 13},
            **extra,
        }
    ).encode()
