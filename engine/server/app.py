"""An OpenAI-compatible HTTP server for the in-process engine.

`create_app(engine)` returns a Starlette app serving `/v1/chat/completions`, `/v1/completions`
(streaming SSE and not), `/v1/models` and `/health`. Each request may switch speculation with the
top-level body fields a client's `extra_body` (or the ace-mw middleware) sends:
`use_speculative_decoding`, `speculative_algorithm`, `num_speculative_tokens`,
`speculative_draft_model`, `tree_choices`. Per-request acceptance comes back in vLLM's shape,
top-level `metrics.speculative_decoding` (for every request, baseline included, with the engine's
decode time, share of plain steps and expected speedup), so the middleware's vLLM adapter reads
it unchanged.

Concurrency: the engine owns one static KV cache, so requests run one at a time behind a FIFO
semaphore of one (a lock that a streaming body may release from another task). Engine calls run
in worker threads, the stream is produced chunk by chunk from `engine.stream()`, and a client that
disconnects mid-stream stops generation and frees the engine for the next request.

    python -m ace_mw.engine.server --target models/ace-tiny-chat \
        --eagle models/ace-tiny-chat-eagle --draft models/ace-tiny-chat-draft --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, overload

import anyio
import torch
from anyio import to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.engine.bundled import exit_if_missing
from ace_mw.engine.engine import GenerationStats, StreamChunk
from ace_mw.engine.model.transformer import DTYPES, resolve_dtype
from ace_mw.engine.params import EngineError, SamplingParams, SpecParams, chat_messages
from ace_mw.vocabulary import SPECULATIVE, Algorithm

logger = logging.getLogger(__name__)

DEFAULT_DTYPE = "float32"  # see docs/engine.md: bf16 is only the default where it measured faster


class RequestError(Exception):
    """A request the server refuses, answered in the OpenAI error shape."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind

    def to_openai_error(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_openai_error(), status_code=self.status)


# --- reading the request body ---------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {value!r}", name, "invalid_type")
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", name, "invalid_value")
    return float(value)


@overload
def _integer(body: dict, name: str, default: int, lo: int, hi: int | None = None) -> int: ...


@overload
def _integer(body: dict, name: str, default: None, lo: int, hi: int | None = None) -> int | None: ...


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name, "invalid_type")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{name} must be {bound}, got {value}", name, "invalid_value")
    return value


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name, "invalid_type")
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {value!r}", name, "invalid_type")
    return value


def _messages(body: dict) -> list[dict]:
    try:
        return chat_messages(body.get("messages"))
    except EngineError as exc:
        raise RequestError(str(exc), exc.param, exc.code) from None


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string (one prompt per request)", "prompt", "invalid_prompt")
    return prompt


def _tree_choices(body: dict) -> list[list[int]] | None:
    tree = body.get("tree_choices")
    if tree is None:
        return None
    valid = (
        isinstance(tree, list)
        and tree
        and all(
            isinstance(path, list)
            and path
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path)
            for path in tree
        )
    )
    if not valid:
        raise RequestError(
            "tree_choices must be a non-empty list of non-empty lists of child indices >= 0",
            "tree_choices",
            "invalid_tree_choices",
        )
    return tree


@dataclass(frozen=True)
class ServerOptions:
    """What the server does when a request leaves something out."""

    model_name: str
    draft_model_name: str | None = None  # the draft the engine loaded, as clients name it
    default_speculative: SpecParams | None = None  # None: baseline unless the request asks
    preferred_algorithm: str = Algorithm.EAGLE_2  # when a request asks for speculation but names no algorithm
    default_max_tokens: int = 256
    self_gate: bool = True  # the engine drafts per step only what pays (False: always the configured size)


def speculative_params(body: dict, options: ServerOptions) -> SpecParams | None:
    """The request's speculation (None = baseline), from its body fields and the server defaults."""
    use = _boolean(body, "use_speculative_decoding")
    algorithm = _string(body, "speculative_algorithm")
    draft = _string(body, "speculative_draft_model")
    k = _integer(body, "num_speculative_tokens", None, lo=1, hi=MAX_SPECULATIVE_TOKENS)
    tree = _tree_choices(body)
    if draft is not None and draft != options.draft_model_name:
        loaded = options.draft_model_name or "none"
        raise RequestError(
            f"unknown speculative_draft_model {draft!r}: this server loaded {loaded!r}",
            "speculative_draft_model",
            "unknown_draft_model",
        )
    if use is False or algorithm == Algorithm.BASELINE:
        return None
    asked = use or any(v is not None for v in (algorithm, draft, k, tree))
    if not asked:
        return options.default_speculative
    default = options.default_speculative or SpecParams(algorithm=options.preferred_algorithm)
    algorithm = algorithm or (Algorithm.DRAFT_MODEL if draft is not None else default.algorithm)
    if algorithm not in SPECULATIVE:
        raise RequestError(
            f"unknown speculative_algorithm {algorithm!r}: expected one of " + ", ".join(Algorithm),
            "speculative_algorithm",
            "unknown_speculative_algorithm",
        )
    return SpecParams(
        algorithm=algorithm,
        num_speculative_tokens=k if k is not None else default.num_speculative_tokens,
        tree_choices=tree if tree is not None else default.tree_choices,
        total_tokens=default.total_tokens,
        self_gate=options.self_gate,
    )


@dataclass(frozen=True)
class CompletionRequest:
    """One parsed, validated request: everything the engine call and the reply need."""

    chat: bool
    prompt: Any  # list of messages (chat) or a string (completions)
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    speculative: SpecParams | None

    @classmethod
    def parse(cls, body: dict, chat: bool, options: ServerOptions) -> CompletionRequest:
        model = body.get("model")
        if model is not None and model != options.model_name:
            raise RequestError(
                f"The model {model!r} does not exist; this server serves {options.model_name!r}",
                "model",
                "model_not_found",
                status=404,
            )
        if _integer(body, "n", 1, lo=1, hi=1) != 1 or body.get("logprobs") not in (None, False):
            raise RequestError("n > 1 and logprobs are not supported", "n", "unsupported")
        max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", options.default_max_tokens, lo=1)
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", "stream_options", "invalid_type")
        top_k = _integer(body, "top_k", 0, lo=-1)
        try:
            sampling = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's range
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                top_k=max(top_k, 0),  # vLLM spells "no top-k" as -1
                seed=_integer(body, "seed", None, lo=-(2**63)),
                stop=body.get("stop"),
            )
        except EngineError as exc:
            raise RequestError(str(exc), exc.param, exc.code) from None
        return cls(
            chat=chat,
            prompt=_messages(body) if chat else _prompt(body),
            sampling=sampling,
            stream=bool(_boolean(body, "stream")),
            include_usage=bool(_boolean(stream_options, "include_usage")),
            speculative=speculative_params(body, options),
        )

    def engine_kwargs(self) -> dict:
        return {"sampling": self.sampling, "speculative": self.speculative}


# --- building the response --------------------------------------------------------------------


def speculative_metrics(stats: GenerationStats, speculative: SpecParams | None) -> dict:
    """vLLM's per-request `metrics.speculative_decoding`, for every request (baseline included,
    so a caller can measure the plain arm too), plus the engine's own speed figures.

    `num_draft_tokens` is the engine's `drafted`: the draft positions the verifier tried along the
    accepted path, so `draft_acceptance_rate` is the per-position acceptance (EAGLE's alpha),
    comparable between chains and trees (null when nothing was drafted); every token sent for
    verification is in `num_proposed_draft_tokens`. `decode_time_s` runs from the first output
    token to the last (decode tokens/s = (completion_tokens - 1) / decode_time_s),
    `plain_step_fraction` is the share of verify steps that drafted nothing, and
    `expected_speedup` the engine's estimate of this request's tokens/s over plain decoding's.
    """
    return {
        "num_draft_tokens": stats.drafted,
        "num_accepted_draft_tokens": stats.accepted,
        "num_spec_steps": stats.steps,
        "mean_acceptance_length": stats.accepted_per_step,
        "draft_acceptance_rate": stats.acceptance_rate if stats.drafted else None,
        "num_proposed_draft_tokens": stats.proposed,
        "algorithm": speculative.algorithm if speculative is not None else Algorithm.BASELINE,
        "decode_time_s": stats.decode_time_s,
        "plain_step_fraction": stats.plain_step_fraction,
        "expected_speedup": stats.expected_speedup,
    }


@dataclass(frozen=True)
class Reply:
    """The response envelope of one request: id, timestamps and the OpenAI object shapes."""

    request: CompletionRequest
    model: str
    id: str
    created: int

    @classmethod
    def start(cls, request: CompletionRequest, model: str) -> Reply:
        prefix = "chatcmpl" if request.chat else "cmpl"
        return cls(request, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.request.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool, role: bool = False) -> dict:
        if not self.request.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if chunk else "message"
        message: dict = {"role": "assistant"} if role or not chunk else {}
        if text is not None:
            message["content"] = text
        return {"index": 0, key: message, "logprobs": None, "finish_reason": finish_reason}

    def _finish(self, payload: dict, stats: GenerationStats, usage: bool) -> dict:
        if usage:
            payload["usage"] = {
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.output_tokens,
                "total_tokens": stats.prompt_tokens + stats.output_tokens,
            }
        payload["metrics"] = {"speculative_decoding": speculative_metrics(stats, self.request.speculative)}
        return payload

    def body(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        return self._finish(self._envelope([self._choice(text, finish_reason, chunk=False)], chunk=False), stats, True)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        return self._envelope([self._choice(text, finish_reason, chunk=True, role=role)], chunk=True)

    def final_chunks(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        """The finish chunk, then the usage chunk when asked; metrics ride the last one."""
        finish = self.chunk(None if self.request.chat else "", finish_reason)
        if not self.request.include_usage:
            return [self._finish(finish, stats, usage=False)]
        return [finish, self._finish(self._envelope([], chunk=True), stats, usage=True)]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# --- running the engine ------------------------------------------------------------------------


def _advance(chunks: Iterator[StreamChunk]) -> StreamChunk | None:
    # Inference mode is thread-local and each hop may land on another worker thread: re-enter it,
    # or the engine's per-request tensors (made in inference mode) could not be updated in place.
    with torch.inference_mode():
        return next(chunks, None)


class EngineStream:
    """One streaming request's hold on the engine: its chunk iterator and the engine slot.

    `open()` takes the slot and pulls the first chunk before any header is sent, so a bad
    request still gets a 400; `close()` (idempotent, shielded) stops generation and frees the slot.
    """

    def __init__(self, engine: Any, slot: anyio.Semaphore, request: CompletionRequest) -> None:
        self._engine = engine
        self._slot = slot
        self._request = request
        self._chunks: Iterator[StreamChunk] | None = None
        self._held = False
        self.first: StreamChunk | None = None

    def _start(self) -> StreamChunk | None:
        self._chunks = iter(self._engine.stream(self._request.prompt, **self._request.engine_kwargs()))
        return _advance(self._chunks)

    async def open(self) -> None:
        await self._slot.acquire()
        self._held = True
        try:
            self.first = await to_thread.run_sync(self._start)
        except BaseException:
            await self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        chunk = self.first
        while chunk is not None:
            yield chunk
            if chunk.finish_reason is not None:
                return
            chunks = self._chunks
            if chunks is None:  # closed meanwhile
                return
            chunk = await to_thread.run_sync(_advance, chunks)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            chunks, self._chunks = self._chunks, None
            if chunks is not None and hasattr(chunks, "close"):
                await to_thread.run_sync(chunks.close)
            if self._held:
                self._held = False
                self._slot.release()


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always frees the engine, whether the body finished, failed or the client left."""

    def __init__(self, hold: EngineStream, content: AsyncIterator[bytes]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )
        self._hold = hold

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._hold.close()


async def _events(hold: EngineStream, reply: Reply) -> AsyncIterator[bytes]:
    if reply.request.chat:
        yield sse(reply.chunk("", role=True))
    try:
        async for chunk in hold:
            if chunk.text:
                yield sse(reply.chunk(chunk.text))
            if chunk.finish_reason is not None:
                assert chunk.stats is not None  # the engine's final chunk carries them
                for payload in reply.final_chunks(chunk.finish_reason, chunk.stats):
                    yield sse(payload)
    except Exception as exc:  # headers are gone: report in-band, as OpenAI-compatible servers do
        logger.exception("generation failed mid-stream")
        yield sse(
            {"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None, "code": None}}
        )
        return
    yield b"data: [DONE]\n\n"


class CompletionsEndpoint:
    """The shared handler of /v1/chat/completions (chat=True) and /v1/completions."""

    def __init__(self, engine: Any, slot: anyio.Semaphore, options: ServerOptions, chat: bool) -> None:
        self._engine = engine
        self._slot = slot
        self._options = options
        self._chat = chat

    async def handle(self, request: Request) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as exc:
                raise RequestError(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
            if not isinstance(body, dict):
                raise RequestError("request body must be a JSON object", None, "invalid_json")
            parsed = CompletionRequest.parse(body, self._chat, self._options)
            reply = Reply.start(parsed, self._options.model_name)
            if parsed.stream:
                hold = EngineStream(self._engine, self._slot, parsed)
                await hold.open()
                return EngineStreamingResponse(hold, _events(hold, reply))
            async with self._slot:
                result = await to_thread.run_sync(
                    partial(self._engine.generate, parsed.prompt, **parsed.engine_kwargs())
                )
            return JSONResponse(reply.body(result.text, result.finish_reason, result.stats))
        except EngineError as exc:
            return RequestError(str(exc), exc.param, exc.code).response()
        except RequestError as exc:
            return exc.response()


def create_app(
    engine: Any,
    *,
    model_name: str | None = None,
    draft_model_name: str | None = None,
    default_speculative: SpecParams | None = None,
    preferred_algorithm: str | None = None,
    default_max_tokens: int = 256,
    self_gate: bool = True,
) -> Starlette:
    """The OpenAI-compatible app around one loaded `Engine` (requests are serialised on it).

    `default_speculative` applies to requests that say nothing about speculation (None: baseline,
    so the client or the middleware decides per request); `preferred_algorithm` is used when a
    request asks for speculation without naming an algorithm; `self_gate` False makes every
    speculative request draft its configured size each step (the engine never falls back to
    plain steps on its own).
    """
    options = ServerOptions(
        model_name=model_name or engine.model_name,
        draft_model_name=draft_model_name,
        default_speculative=default_speculative,
        preferred_algorithm=preferred_algorithm or _best_algorithm(engine),
        default_max_tokens=default_max_tokens,
        self_gate=self_gate,
    )
    slot = anyio.Semaphore(1)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": options.model_name, "object": "model", "created": 0, "owned_by": "ace-mw"}],
            }
        )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": options.model_name})

    return Starlette(
        routes=[
            Route(
                "/v1/chat/completions", CompletionsEndpoint(engine, slot, options, chat=True).handle, methods=["POST"]
            ),
            Route("/v1/completions", CompletionsEndpoint(engine, slot, options, chat=False).handle, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


# The strongest drafters first, as measured on the fixture (docs/benchmarks.md).
STRONGEST_FIRST = (Algorithm.EAGLE_3, Algorithm.EAGLE_2, Algorithm.DRAFT_MODEL, Algorithm.NGRAM)


def _best_algorithm(engine: Any) -> str:
    """The strongest drafter this engine has loaded (prompt lookup needs nothing loaded)."""
    return next(a for a in STRONGEST_FIRST if engine.runs(a))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from ace_mw.engine import Engine

    parser = argparse.ArgumentParser(prog="python -m ace_mw.engine.server", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="local Hugging Face folder of the target model")
    parser.add_argument(
        "--eagle", nargs="+", help="EAGLE-1/2 and/or EAGLE-3 head folders (published formats, told apart by config)"
    )
    parser.add_argument("--draft", help="draft model folder (same tokenizer)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=("auto", *DTYPES),
        help=f"default {DEFAULT_DTYPE}; auto = bf16 on a GPU or an AMX CPU (see docs/engine.md)",
    )
    parser.add_argument(
        "--default-algorithm",
        default=Algorithm.BASELINE.value,
        choices=[a.value for a in Algorithm],
        help="speculation for requests that do not ask (default: baseline; the client decides)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K for --default-algorithm (default: the engine's per-algorithm default)",
    )
    parser.add_argument(
        "--fixed-drafting",
        action="store_true",
        help="draft the configured size every step instead of only what pays on this machine",
    )
    parser.add_argument("--model-name", help="name served in /v1/models (default: the target folder's name)")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="max_tokens when a request gives none (default: 256)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    args = parser.parse_args(argv)
    folders = [("--target", args.target), *(("--eagle", head) for head in args.eagle or ()), ("--draft", args.draft)]
    for flag, folder in folders:
        if folder:
            exit_if_missing(folder, flag)

    engine = Engine.from_pretrained(
        args.target,
        eagle=args.eagle,
        draft=args.draft,
        device=args.device,
        dtype=resolve_dtype(args.dtype, args.device),
    )
    default = (
        None
        if args.default_algorithm == Algorithm.BASELINE
        else SpecParams(
            algorithm=args.default_algorithm,
            num_speculative_tokens=args.num_speculative_tokens,
            self_gate=not args.fixed_drafting,
        )
    )
    app = create_app(
        engine,
        model_name=args.model_name or Path(args.target).name,
        draft_model_name=Path(args.draft).name if args.draft else None,
        default_speculative=default,
        default_max_tokens=args.max_tokens,
        self_gate=not args.fixed_drafting,
    )
    uvicorn.run(app, host=args.host, port=args.port)
