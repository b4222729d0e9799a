"""A fake OpenAI-compatible engine: the test double behind the middleware, gateway and benchmarks.

It serves `POST /v1/chat/completions` and `/v1/completions`, streaming (SSE) and not, and follows a
mutable `Script` so a test can change its behaviour between requests: per-chunk delays, acceptance
figures in vLLM's `metrics.speculative_decoding` shape, malformed SSE, dying mid-stream, or holding
back a chunk until the test says go (to prove nobody in between buffers). It records what it received
and the exact bytes it sent, so tests can compare them with what the client got.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MALFORMED_EVENTS = (
    b": keep-alive comment\n\n",
    b"data: {not json at all\n\n",
    b"event: weird\ndata: \xff\xfe not utf-8\n\n",
    b"data: " + b"x" * 2048 + b"\n\n",
)


class UpstreamDied(RuntimeError):
    """Raised inside the fake engine to cut a stream off mid-way (the server drops the connection)."""


@dataclass
class Script:
    """How the fake engine answers the next requests."""

    chunks: tuple[str, ...] = ("Hel", "lo", ", ", "wor", "ld")
    delay_s: float = 0.0  # sleep before every chunk
    # Per-arm delay before every chunk, overriding delay_s, for requests in the in-process engine's
    # wire format: "plain" when use_speculative_decoding is false, else the speculative_algorithm.
    arm_delay_s: dict[str, float] | None = None
    # The same per API key (the bearer token), over arm_delay_s: traffic that makes an arm pay for
    # one tenant and not for the others.
    key_arm_delay_s: dict[str, dict[str, float]] | None = None
    # vLLM per-request metrics, e.g. {"num_draft_tokens": 10, "num_accepted_draft_tokens": 8,
    # "num_spec_steps": 2}; streamed on the usage chunk (only when the request asks for usage),
    # and as SGLang's choices[0].meta_info on JSON answers to requests with return_meta_info.
    figures: dict[str, Any] | None = None
    malformed: bool = False  # interleave comments, broken JSON, bad UTF-8 and an overlong line
    die_after: int | None = None  # raise after sending this many content chunks
    hold_after: int | None = None  # after this many content chunks, wait for `release`
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class FakeUpstream:
    """The fake engine; `.app` is the ASGI app to serve (alone or behind middleware)."""

    def __init__(self, script: Script | None = None, name: str = "upstream") -> None:
        self.script = script or Script()
        self.name = name
        self.received: list[Received] = []
        self.sent: list[list[bytes]] = []  # per request, every body chunk as sent
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "test"}]})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "name": self.name})

    async def _complete(self, request: Request) -> Response:
        raw = await request.body()
        self.received.append(Received(request.url.path, dict(request.headers), raw))
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse(_error("request body is not valid JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error("request body must be a JSON object"), status_code=400)
        temperature = body.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature:
            return JSONResponse(_error("temperature must be a non-negative number"), status_code=400)
        chat = request.url.path.endswith("/chat/completions")
        script, sent = self.script, []
        self.sent.append(sent)
        headers = {"x-upstream-name": self.name}
        if script.arm_delay_s is not None:
            arm = body.get("speculative_algorithm", "") if body.get("use_speculative_decoding") else "plain"
            key = request.headers.get("authorization", "").removeprefix("Bearer ")
            delays = {**script.arm_delay_s, **(script.key_arm_delay_s or {}).get(key, {})}
            script = replace(script, delay_s=delays.get(arm, script.delay_s))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = _stream(script, chat, body.get("model", ""), usage, sent)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        completion = _completion(script, chat, body.get("model", ""))
        if body.get("return_meta_info") and script.figures:  # SGLang's OpenAI API extension
            completion["choices"][0]["meta_info"] = _meta_info(script)
        payload = json.dumps(completion).encode()
        sent.append(payload)
        return Response(payload, media_type="application/json", headers=headers)


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def _usage(script: Script) -> dict:
    return {"prompt_tokens": 7, "completion_tokens": len(script.chunks), "total_tokens": 7 + len(script.chunks)}


def _metrics(script: Script) -> dict:
    return {"speculative_decoding": dict(script.figures)} if script.figures else {}


def _meta_info(script: Script) -> dict:
    stats = script.figures
    return {
        "completion_tokens": len(script.chunks),
        "spec_verify_ct": stats["num_spec_steps"],
        "spec_num_proposed_drafts": stats["num_draft_tokens"],
        "spec_num_correct_drafts": stats["num_accepted_draft_tokens"],
    }


def _completion(script: Script, chat: bool, model: str) -> dict:
    text = "".join(script.chunks)
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "logprobs": None}
        if chat
        else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    )
    body = {
        "id": "cmpl-fake",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": model,
        "choices": [choice],
        "usage": _usage(script),
    }
    if script.figures:
        body["metrics"] = _metrics(script)
    return body


def _chunk(chat: bool, model: str, text: str | None, finish: str | None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if text is not None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {
        "id": "cmpl-fake",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": model,
        "choices": [choice],
    }


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _stream(script: Script, chat: bool, model: str, usage: bool, sent: list[bytes]):
    """The SSE body, chunk by chunk, recording each chunk just before it goes out."""
    loop = asyncio.get_running_loop()
    for i, text in enumerate(script.chunks):
        if script.die_after is not None and i == script.die_after:
            raise UpstreamDied(f"fake upstream died after {i} chunks")
        if script.hold_after is not None and i == script.hold_after:
            released = await loop.run_in_executor(None, script.release.wait, 30.0)
            if not released:
                raise UpstreamDied("fake upstream was never released")
        if script.delay_s:
            await asyncio.sleep(script.delay_s)
        if script.malformed:
            garbage = MALFORMED_EVENTS[i % len(MALFORMED_EVENTS)]
            sent.append(garbage)
            yield garbage
        data = _event(_chunk(chat, model, text, None))
        sent.append(data)
        yield data
    tail = [_event(_chunk(chat, model, None, "stop"))]
    if usage:
        final = {
            "id": "cmpl-fake",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": model,
            "choices": [],
            "usage": _usage(script),
        }
        if script.figures:
            final["metrics"] = _metrics(script)
        tail.append(_event(final))
    tail.append(b"data: [DONE]\n\n")
    for data in tail:
        sent.append(data)
        yield data


def figures(drafted: int, accepted: int, steps: int) -> dict[str, Any]:
    """vLLM's per-request `metrics.speculative_decoding` object for these counts."""
    return {
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "num_spec_steps": steps,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / steps if steps else 0.0,
    }
