"""gRPC server interceptors: the same per-request decision as `AceSpecDec`, for generation RPCs.

`AceSpecDecInterceptor` (``grpc.server(..., interceptors=[...])``) and `AceSpecDecAioInterceptor`
(``grpc.aio.server(interceptors=[...])``) read invocation metadata (the override header,
``authorization``) and the request message through a `MessageFields` mapping, decide, write the
directive onto the message where it has matching fields, and publish the decision to the servicer
through `current_decision()`. Unary-unary and unary-stream handlers of the RPCs listed in the
config's `paths` (full names, "/package.Service/Method") are rebuilt with their own serializers;
responses (yielded, returned, or aio ``context.write()``) are read for acceptance figures. Other
RPCs and handler kinds pass through untouched.

A bad override value aborts the call with INVALID_ARGUMENT; everything else we cannot read (binary
or garbled metadata, absent fields) is ignored, and our own internal errors fail open.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from ace_mw.acceptance import AcceptanceFigures
from ace_mw.adapters.base import count, vllm_named
from ace_mw.controller import AceController
from ace_mw.decision import Decision
from ace_mw.errors import ClientError
from ace_mw.observe.observer import ResponseObserver
from ace_mw.operate.reload import DEFAULT_RELOAD_INTERVAL_S
from ace_mw.request import RequestView, conflicting

from .common import ConfigLike, FailOpen, build_controller

# A handler's behaviour: (request, context) -> response(s), a plain or async function or generator.
Behavior = Callable[..., Any]
if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    AioContext = grpc.aio.ServicerContext[Any, Any]

_current: contextvars.ContextVar[Decision | None] = contextvars.ContextVar("ace_decision", default=None)


def current_decision() -> Decision | None:
    """The decision for the RPC being served (its `.directive` says what to run), or None."""
    return _current.get()


@dataclass(frozen=True)
class MessageFields:
    """How request and response messages map onto the OpenAI body fields the core understands.

    `body` maps a body field name to a message field name: mapped fields present on the request are
    read into the request view, and body fields the adapter writes (``use_speculative_decoding``,
    ``num_speculative_tokens``...) are set on the message when it has the mapped field. `figures`
    names the response field (a message with vLLM's counter names) that carries acceptance figures;
    `text` the response field whose non-empty value marks a message that carries output, timed for
    the speed policy (first to last such message of a stream).
    """

    body: Mapping[str, str] = field(
        default_factory=lambda: {
            name: name
            for name in (
                "model",
                "temperature",
                "stream",
                "user",
                "use_speculative_decoding",
                "num_speculative_tokens",
                "speculative_algorithm",
                "speculative_draft_model",
            )
        }
    )
    figures: str | None = "speculative_decoding"
    text: str | None = "text"


class _Interceptor(ABC):
    """Decision, injection and observation, shared by the sync and aio interceptors; each of those
    supplies `_unary` and `_stream`, the wrappers of its own handler behaviours."""

    def __init__(
        self,
        config: ConfigLike | None = None,
        *,
        controller: AceController | None = None,
        fields: MessageFields = MessageFields(),
        reload_interval_s: float | None = DEFAULT_RELOAD_INTERVAL_S,
    ) -> None:
        self.controller = build_controller(config, controller, reload_interval_s)
        self.fields = fields
        self.failures = FailOpen(self.controller)

    def close(self) -> None:
        """Stop following the config file and the store's background work: `controller.close()`
        (call it after `server.stop()`)."""
        self.controller.close()

    @abstractmethod
    def _unary(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        """A unary-unary behaviour wrapped to decide, publish the decision and read the response."""

    @abstractmethod
    def _stream(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        """The same for a unary-stream behaviour."""

    def wrap(self, handler: Handler | None, details: grpc.HandlerCallDetails) -> Handler | None:
        """The handler rebuilt around our behaviour, for unary-request RPCs whose full method name
        ("/pkg.Service/Method") the config's `paths` list (one list of routes for HTTP and gRPC);
        any other handler (or None) as it is."""
        method = details.method
        if handler is None or handler.request_streaming or not self.controller.config.handles("POST", method):
            return handler
        metadata = details.invocation_metadata
        return _rebuild(
            handler,
            lambda behavior: self._unary(behavior, method, metadata),
            lambda behavior: self._stream(behavior, method, metadata),
        )

    def begin(self, method: str, metadata: Any, request: Any) -> _Call | None:
        """Decide for one RPC and rewrite its message; None when we failed and must step aside.
        Raises a ClientError for the caller to turn into INVALID_ARGUMENT."""
        try:
            headers, conflicts = _headers(metadata)
            body = _read_fields(request, self.fields.body)
            view = RequestView("POST", method, headers, body, None, headers.get("x-request-id"), conflicts)
            decision, observer = self.controller.begin(
                view, lambda new: _write_fields(request, self.fields.body, body, new)
            )
        except ClientError:
            raise
        except Exception:
            self.failures.record("begin")
            return None
        try:
            if observer is not None:
                observer.start(200, "application/json")
        except Exception:
            self.failures.record("observe")
            observer = None
        return _Call(decision, observer, self.fields, self.failures)


class _Call:
    """One RPC's decision and observer."""

    def __init__(
        self, decision: Decision, observer: ResponseObserver | None, fields: MessageFields, failures: FailOpen
    ) -> None:
        self.decision = decision
        self._observer = [observer] if observer is not None else []  # list.pop: finish is once, even across threads
        self.figures_field = fields.figures
        self.text_field = fields.text if decision.learns_speed else None
        self.failures = failures
        self.figures: dict[str, Any] | None = None
        self.trailing = tuple((k.decode(), v.decode()) for k, v in decision.response_headers())

    def see(self, response: Any) -> None:
        """Time a message that carries output; remember the latest acceptance figures a response
        message carries (hot: per message)."""
        if self.text_field is not None:
            self._time(response, self.text_field)
        field = self.figures_field
        if field is None:
            return
        try:
            if not response.HasField(field):
                return
            stats = getattr(response, field)
            self.figures = {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}
        except Exception:  # the response type has no such message field: stop looking, once
            self.figures_field = None
            self.failures.record("observe.message")

    def _time(self, response: Any, name: str) -> None:
        try:
            if getattr(response, name) and self._observer:
                self._observer[0].tick()
        except Exception:  # no such field on this response type: stop timing, once
            self.text_field = None
            self.failures.record("observe.time")

    @contextmanager
    def track(self) -> Iterator[None]:
        """Finish once when the handler ends: cleanly, by an error, or cancelled by the client."""
        error: str | None = "cancelled"
        try:
            yield
            error = None
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            self.finish(error)

    def cancelled(self) -> None:
        self.finish("cancelled")

    def finish(self, error: str | None) -> None:
        """Hand the figures to the controller (through the observer) once. The figures message is
        this integration's own contract (vLLM's counter names, `num_spec_steps` counting every
        decode step), read the same whatever the adapter: the adapter speaks to HTTP engines.
        Also registered as the RPC's termination callback, so a stream the server never iterated
        (cancelled early) still releases what its decision holds."""
        try:
            observer = self._observer.pop()
        except IndexError:
            return
        try:
            if self.figures is not None:
                observer.read_figures(message_figures(self.figures))
            observer.finish(error=error)
        except Exception:
            self.failures.record("observe.finish")


def message_figures(fields: Mapping[str, Any]) -> AcceptanceFigures | None:
    """The figures of a `SpeculativeDecodingStats`-shaped message (proto3: an unset count reads 0,
    so a zero output count is no count)."""
    found = vllm_named(dict(fields))
    output = count(fields.get("output_tokens"))
    if found is None or not output:
        return found
    return found.with_output_tokens(output)


def _headers(metadata: Any) -> tuple[dict[str, str], frozenset[str]]:
    """Text metadata only, names lower-cased; binary (-bin) values and garbage are skipped. With
    the identity keys repeated with different values (the call is then refused)."""
    pairs: list[tuple[str, str]] = []
    for item in metadata or ():
        try:
            key, value = item
        except (TypeError, ValueError):
            continue
        if isinstance(key, str) and isinstance(value, str):
            pairs.append((key.lower(), value))
    headers = dict(pairs)
    return headers, frozenset() if len(headers) == len(pairs) else conflicting(pairs)


def _read_fields(message: Any, mapping: Mapping[str, str]) -> dict[str, Any]:
    """The mapped fields the message has and sets, as an OpenAI-style body."""
    body: dict[str, Any] = {}
    by_name = message.DESCRIPTOR.fields_by_name
    for key, name in mapping.items():
        descriptor = by_name.get(name)
        if descriptor is None or (descriptor.has_presence and not message.HasField(name)):
            continue
        body[key] = getattr(message, name)
    return body


def _write_fields(message: Any, mapping: Mapping[str, str], old: dict[str, Any], new: dict[str, Any]) -> None:
    """Set on the message the mapped fields the adapter changed; values that do not fit the
    message's field type are skipped (the servicer still sees the directive via the contextvar)."""
    if new is old:
        return
    by_name = message.DESCRIPTOR.fields_by_name
    for key, value in new.items():
        name = mapping.get(key)
        if name is None or name not in by_name or old.get(key, _MISSING) == value:
            continue
        try:
            setattr(message, name, value)
        except (TypeError, ValueError, AttributeError):
            continue


_MISSING = object()


def _rebuild(
    handler: Handler, unary: Callable[[Behavior], Behavior], stream: Callable[[Behavior], Behavior]
) -> Handler:
    """The same handler, serializers included, with a wrapped behaviour (grpc sets the one
    behaviour that matches the handler's kind; `wrap` passes only unary-request kinds)."""
    if handler.response_streaming:
        assert handler.unary_stream is not None
        return grpc.unary_stream_rpc_method_handler(
            stream(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    assert handler.unary_unary is not None
    return grpc.unary_unary_rpc_method_handler(
        unary(handler.unary_unary),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AceSpecDecInterceptor(_Interceptor, grpc.ServerInterceptor):
    """For ``grpc.server(executor, interceptors=[AceSpecDecInterceptor(config=...)])``."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        return self.wrap(continuation(handler_call_details), handler_call_details)

    def _start(
        self, method: str, metadata: Any, request: Any, context: grpc.ServicerContext
    ) -> tuple[_Call | None, contextvars.Context]:
        if not self.controller.synced:  # a replica's first requests: the fleet's state first
            self.controller.wait_synced()
        try:
            call = self.begin(method, metadata, request)
        except ClientError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        scope = contextvars.copy_context()
        if call is not None:
            scope.run(_current.set, call.decision)
            context.set_trailing_metadata(call.trailing)
            context.add_callback(call.cancelled)
        return call, scope

    def _unary(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            call, scope = self._start(method, metadata, request, context)
            if call is None:
                return behavior(request, context)
            with call.track():
                response = scope.run(behavior, request, context)
                call.see(response)
                return response

        return unary

    def _stream(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        def stream(request: Any, context: grpc.ServicerContext) -> Any:
            call, scope = self._start(method, metadata, request, context)
            if call is None:
                return behavior(request, context)
            try:
                responses = scope.run(behavior, request, context)
            except BaseException as exc:
                call.finish(type(exc).__name__)
                raise
            return _observed(call, scope, responses)

        return stream


def _observed(call: _Call, scope: contextvars.Context, responses: Iterator[Any]) -> Iterator[Any]:
    """Yield each response at once, noting figures; each step runs in the RPC's context."""
    run, see = scope.run, call.see
    with call.track():
        while True:
            try:
                response = run(next, responses)
            except StopIteration:
                return
            see(response)
            yield response


class AceSpecDecAioInterceptor(_Interceptor, grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server(interceptors=[AceSpecDecAioInterceptor(config=...)])``; handles
    coroutine, async-generator and ``context.write()`` handlers (sync handlers, which an aio server
    runs in its migration thread pool, pass through undecided)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        return self.wrap(await continuation(handler_call_details), handler_call_details)

    async def _start(self, method: str, metadata: Any, request: Any, context: AioContext) -> _Call | None:
        if not self.controller.synced:  # a replica's first requests: the fleet's state first
            await asyncio.to_thread(self.controller.wait_synced)
        try:
            call = self.begin(method, metadata, request)
        except ClientError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if call is not None:
            _current.set(call.decision)  # the RPC runs in its own task: nothing leaks to others
            context.set_trailing_metadata(call.trailing)
            # types-grpcio declares the callback type as a class, which no function can match.
            context.add_done_callback(lambda _: call.cancelled())  # type: ignore[arg-type]
        return call

    def _unary(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # a sync handler (run in grpc's migration thread pool): left alone

        async def unary(request: Any, context: AioContext) -> Any:
            call = await self._start(method, metadata, request, context)
            if call is None:
                return await behavior(request, context)
            with call.track():
                response = await behavior(request, context)
                call.see(response)
                return response

        return unary

    def _stream(self, behavior: Behavior, method: str, metadata: Any) -> Behavior:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: AioContext) -> AsyncIterator[Any]:
                call = await self._start(method, metadata, request, context)
                if call is None:
                    async for response in behavior(request, context):
                        yield response
                    return
                with call.track():
                    async for response in behavior(request, context):
                        call.see(response)
                        yield response

            return stream
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # a sync generator (run in grpc's migration thread pool): left alone

        async def write_stream(request: Any, context: AioContext) -> Any:
            call = await self._start(method, metadata, request, context)
            if call is None:
                return await behavior(request, context)
            with call.track():
                return await behavior(request, _WritingContext(context, call))

        return write_stream


class _WritingContext:
    """The servicer context, with `write()` noting figures before sending the message on."""

    def __init__(self, context: AioContext, call: _Call) -> None:
        self._context = context
        self._call = call

    async def write(self, message: Any) -> None:
        self._call.see(message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
