"""An OpenAI-compatible HTTP server for the in-process engine.

`create_app(engine)` returns a Starlette app serving `/v1/chat/completions`, `/v1/completions`
(streaming SSE and not), `/v1/models`, `/health` and `/metrics` (Prometheus, metrics.py). Each
request may switch speculation with the top-level body fields a client's `extra_body` (or the
ace-mw middleware) sends: `use_speculative_decoding`, `speculative_algorithm`,
`num_speculative_tokens`, `speculative_draft_model`, `tree_choices`. Per-request acceptance comes
back in vLLM's shape, top-level `metrics.speculative_decoding` (for every request, baseline included, with the engine's
decode time, share of plain steps and expected speedup), so the middleware's vLLM adapter reads
it unchanged.

Concurrency: the engine's loop (`BatchEngine`) runs `max_num_seqs` requests at once, a row of its
KV cache each; the rest wait behind a FIFO (`slot.EngineSlot`, which a streaming body may release
from another task); past `max_waiting` waiting requests the server answers 429 with `Retry-After`
at once. A request is checked and tokenized in a worker thread; then the engine's loop hands its
steps to the event loop (`engine.astream()`), streamed or not, so no worker thread waits on the
engine; a client that disconnects mid-stream stops generation and frees the engine for the next
request.

    python -m ace_mw.engine.server --target models/ace-tiny-chat \
        --eagle models/ace-tiny-chat-eagle --draft models/ace-tiny-chat-draft --port 8000
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio import to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.batching.scheduler import PREFILL_CHUNK
from ace_mw.engine.bundled import exit_if_missing
from ace_mw.engine.engine import Engine
from ace_mw.engine.generation import GenerationStats, StreamChunk, result_of
from ace_mw.engine.model.dtypes import DTYPES, resolve_dtype
from ace_mw.engine.params import EngineError, SpecParams
from ace_mw.usage import Parser
from ace_mw.vocabulary import Algorithm

from .metrics import ServerMetrics
from .request import CompletionRequest, RequestError, ServerOptions
from .slot import EngineSlot

logger = logging.getLogger(__name__)

DEFAULT_DTYPE = "float32"  # see docs/engine.md: bf16 is only the default where it measured faster


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
                "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
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


class EngineStream:
    """One request's hold on the engine, streamed or not: its chunks and the engine slot.

    `open()` takes the slot and pulls the first chunk before any header is sent, so a bad
    request still gets a 400; `close()` (idempotent, shielded) stops generation and frees the slot.
    The engine's loop hands each step to this event loop as it ends (`BatchEngine.astream`): one
    thread hop a token, and no worker thread held while the stream runs.
    """

    def __init__(self, engine: Any, slot: EngineSlot, request: CompletionRequest) -> None:
        self._engine = engine
        self._slot = slot
        self._request = request
        self._chunks: AsyncGenerator[StreamChunk, None] | None = None
        self._held_since: float | None = None
        self.first: StreamChunk | None = None

    def _start(self, loop: asyncio.AbstractEventLoop) -> AsyncGenerator[StreamChunk, None]:
        # Inference mode is thread-local: the request's tensors are made in it, as the loop's
        # thread that updates them runs in it.
        with torch.inference_mode():
            request = self._request
            # A stream's reader, and a stop string's check, need each step's text as it comes; a
            # whole answer otherwise takes one thread hop at its end, not one a token.
            every_step = request.stream or bool(request.sampling.stops)
            return self._engine.astream(loop, request.prompt, every_step=every_step, **request.engine_kwargs())

    async def open(self, gone: Callable[[], Awaitable[bool]]) -> None:
        """Wait for the engine (`gone`: whether the client left meanwhile), then start."""
        self._held_since = await self._slot.acquire(gone)
        try:
            # validated and tokenized off the event loop; a bad request raises here
            self._chunks = await to_thread.run_sync(self._start, asyncio.get_running_loop())
            self.first = await anext(self._chunks, None)
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
            chunk = await anext(chunks, None)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            chunks, self._chunks = self._chunks, None
            if chunks is not None:
                await chunks.aclose()
            held_since, self._held_since = self._held_since, None
            if held_since is not None:
                self._slot.release(held_since)


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


async def _events(hold: EngineStream, reply: Reply, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    if reply.request.chat:
        yield sse(reply.chunk("", role=True))
    try:
        async for chunk in hold:
            if chunk.text:
                yield sse(reply.chunk(chunk.text))
            if chunk.finish_reason is not None:
                assert chunk.stats is not None  # the engine's final chunk carries them
                metrics.finished(chunk.stats, reply.request.speculative)
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

    def __init__(
        self, engine: Any, slot: EngineSlot, options: ServerOptions, chat: bool, metrics: ServerMetrics
    ) -> None:
        self._engine = engine
        self._slot = slot
        self._metrics = metrics
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
            hold = EngineStream(self._engine, self._slot, parsed)
            await hold.open(request.is_disconnected)
            if parsed.stream:
                return EngineStreamingResponse(hold, _events(hold, reply, self._metrics))
            try:  # read on this event loop as a stream is: no worker thread waits on the engine
                result = result_of([chunk async for chunk in hold])
            finally:
                await hold.close()
            self._metrics.finished(result.stats, parsed.speculative)
            return JSONResponse(reply.body(result.text, result.finish_reason, result.stats))
        except EngineError as exc:
            return self._refuse(RequestError(str(exc), exc.param, exc.code))
        except RequestError as exc:
            return self._refuse(exc)

    def _refuse(self, error: RequestError) -> Response:
        self._metrics.refused(error.status)
        return error.response()


def create_app(
    engine: Any,
    *,
    model_name: str | None = None,
    draft_model_name: str | None = None,
    default_speculative: SpecParams | None = None,
    preferred_algorithm: str | None = None,
    default_max_tokens: int = 256,
    self_gate: bool = True,
    max_waiting: int = 64,
) -> Starlette:
    """The OpenAI-compatible app around a `BatchEngine` (`max_num_seqs` requests run at once), or
    an `Engine` (its one-row loop: requests take turns).

    `default_speculative` applies to requests that say nothing about speculation (None: baseline,
    so the client or the middleware decides per request); `preferred_algorithm` is used when a
    request asks for speculation without naming an algorithm; `self_gate` False makes every
    speculative request draft its configured size each step (the engine never falls back to
    plain steps on its own). Past `max_waiting` requests waiting for the engine, a request gets
    429 with `Retry-After` instead of a place in the line.
    """
    if isinstance(engine, Engine):
        engine = engine.one_row()
    options = ServerOptions(
        model_name=model_name or engine.model_name,
        draft_model_name=draft_model_name,
        default_speculative=default_speculative,
        preferred_algorithm=preferred_algorithm or _best_algorithm(engine),
        default_max_tokens=default_max_tokens,
        self_gate=self_gate,
    )
    slot = EngineSlot(max_waiting, engine.max_num_seqs)
    metrics = ServerMetrics(slot, engine if isinstance(engine, BatchEngine) else None)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": options.model_name, "object": "model", "created": 0, "owned_by": "ace-mw"}],
            }
        )

    async def health(request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "model": options.model_name, "running": slot.running, "waiting": slot.waiting}
        )

    return Starlette(
        routes=[
            Route(
                "/v1/chat/completions",
                CompletionsEndpoint(engine, slot, options, True, metrics).handle,
                methods=["POST"],
            ),
            Route(
                "/v1/completions",
                CompletionsEndpoint(engine, slot, options, False, metrics).handle,
                methods=["POST"],
            ),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


# The strongest drafters first, as measured on the fixture (docs/benchmarks.md).
STRONGEST_FIRST = (Algorithm.EAGLE_3, Algorithm.EAGLE_2, Algorithm.DRAFT_MODEL, Algorithm.NGRAM)


def _best_algorithm(engine: Any) -> str:
    """The strongest drafter this engine has loaded (prompt lookup needs nothing loaded)."""
    return next(a for a in STRONGEST_FIRST if engine.runs(a))


def unsupported_hint(exc: Exception) -> str:
    """What to do about a model the in-process engine does not run."""
    if "model_type" in str(exc):
        return (
            " (the in-process engine runs Llama-architecture models; serve others with vLLM, SGLang or "
            "llama.cpp and put `ace-mw gateway` in front)"
        )
    return ""


def main(argv: Sequence[str] | None = None, prog: str = "python -m ace_mw.engine.server") -> None:
    import uvicorn

    parser = Parser(prog=prog, description=__doc__.split("\n")[0])
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
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests that may wait for the engine; past them 429 with Retry-After (default: 64)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="requests decoding at once, in one batch (default: 16; 1 = one at a time, every algorithm drafting)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=PREFILL_CHUNK,
        help=f"tokens per batched step, decoding rows' included; prompts get at least half (default: {PREFILL_CHUNK})",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (default: a request starts in the free row that holds most of its prompt)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="decode one or two streams eagerly (default: their step compiles at start where that is faster, "
        "on a CPU in fp32 without the bf16 panel kernel)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    args = parser.parse_args(argv)
    if args.max_waiting < 0:
        parser.error(f"--max-waiting must be 0 or more, got {args.max_waiting}")
    if args.max_num_seqs < 1 or args.prefill_chunk < 1:
        parser.error("--max-num-seqs and --prefill-chunk must be 1 or more")
    folders = [("--target", args.target), *(("--eagle", head) for head in args.eagle or ()), ("--draft", args.draft)]
    for flag, folder in folders:
        if folder:
            exit_if_missing(folder, flag)

    # What a first start does for a minute or more (measuring this machine's step costs), as it goes.
    logging.basicConfig(level=logging.INFO, format=f"{prog}: %(message)s")
    try:
        engine = Engine.from_pretrained(
            args.target,
            eagle=args.eagle,
            draft=args.draft,
            device=args.device,
            dtype=resolve_dtype(args.dtype, args.device),
            compile_decode=False if args.no_compile else None,
        )
    except (ValueError, OSError) as exc:  # a model this engine cannot load: one line, what to do
        raise SystemExit(f"{prog}: error: cannot load the model: {exc}{unsupported_hint(exc)}") from None
    served = BatchEngine(engine, args.max_num_seqs, args.prefill_chunk, prefix_caching=not args.no_prefix_caching)
    logger.info("%s", served.describe())
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
        served,
        model_name=args.model_name or Path(args.target).name,
        draft_model_name=Path(args.draft).name if args.draft else None,
        default_speculative=default,
        default_max_tokens=args.max_tokens,
        self_gate=not args.fixed_drafting,
        max_waiting=args.max_waiting,
    )
    uvicorn.run(app, host=args.host, port=args.port)
