"""`AceSpecDec`: pure ASGI middleware that decides speculative decoding per request.

For OpenAI-compatible routes it reads the JSON body (under a cap), asks the controller for a
decision, injects the directive into the body, exposes the decision in ``scope["state"]`` and in
response headers, and watches the response bytes for acceptance figures as they pass. When the
config has an `admin` table, ``/ace/*`` is the admin API (admin.py). Everything else (other paths
and methods, websockets) goes straight to the app; the lifespan too, with the controller started on
startup and closed on shutdown.

Like Starlette's GZip/CORS middleware, the middleware only dispatches; `AceResponder` holds one
request's state. Any internal error of ours is logged, counted in `AceSpecDec.failures`, and the
request proceeds exactly as the client sent it.
"""

from __future__ import annotations

import json
import json.scanner
import logging
from collections import deque
from collections.abc import Awaitable
from functools import lru_cache
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ace_mw.controller import AceController
from ace_mw.directive import BASELINE_POOL
from ace_mw.errors import AceError, ClientError, ConfigError
from ace_mw.observe.observer import ResponseObserver
from ace_mw.operate.reload import DEFAULT_RELOAD_INTERVAL_S
from ace_mw.request import RequestView, conflicting

from .admin import ADMIN_PREFIX, admin_endpoint
from .common import ConfigLike, FailOpen, build_controller
from .json_body import BodyWriter, parse_body

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# A response chunk larger than this is read by the observer in a worker thread: however many lines
# or events one chunk packs (an engine's or a hostile upstream's), the event loop serving the other
# requests is never held by our parsing for longer than the interpreter's switch interval.
OFFLOAD_CHUNK_BYTES = 64 * 1024

# Keys in scope["state"] (Starlette: request.state.ace_decision / request.state.ace_pool).
STATE_DECISION = "ace_decision"
STATE_POOL = "ace_pool"


class AceSpecDec:
    """``app.add_middleware(AceSpecDec, config=...)`` or ``AceSpecDec(app, config=...)``.

    `config` is an AceConfig, a dict or a TOML/JSON path; a path is followed, polled every
    `reload_interval_s` seconds (None: loaded once). Pass `controller` instead to share one
    controller (and its state) between several apps or with a gRPC interceptor. The routes it acts
    on are the config's `paths` (POST only), so a new config moves them.
    """

    def __init__(
        self,
        app: ASGIApp,
        config: ConfigLike | None = None,
        *,
        controller: AceController | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        reload_interval_s: float | None = DEFAULT_RELOAD_INTERVAL_S,
    ) -> None:
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        # A bad config cannot raise here under Starlette (which builds middleware on the first ASGI
        # call, where uvicorn's default `--lifespan auto` swallows the error): it is kept, logged
        # now, refuses the app's start-up and answers every request with a 500 that names it.
        self.config_error: ConfigError | None = None
        try:
            self.controller = build_controller(config, controller, reload_interval_s)
            self.failures = FailOpen(self.controller)
        except ConfigError as exc:
            self.config_error = exc
            logger.error("ace-mw: invalid configuration, the app will not start: %s", exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.config_error is not None:
            await self._refuse(scope, receive, send, self.config_error)
            return
        if scope["type"] == "lifespan":
            await self.lifespan(scope, receive, send)
            return
        if scope["type"] == "http":
            config = self.controller.config
            if config.handles(scope["method"], scope["path"]):
                await AceResponder(self)(scope, receive, send)
                return
            if config.admin is not None and scope["path"].startswith(ADMIN_PREFIX):
                await admin_endpoint(self.controller, config.admin, self.failures, scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ConfigError) -> None:
        """The state of an app whose config is invalid: its start-up fails (uvicorn exits, whatever
        its lifespan setting, and prints the message); a request, with `--lifespan off`, gets a 500."""
        message = f"ace-mw: invalid configuration: {error}"
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.startup":
                pass
            await send({"type": "lifespan.startup.failed", "message": message})
            return
        logger.error("%s (the request is refused)", message)
        if scope["type"] != "http":
            return  # a websocket is closed by the server when the app returns without accepting
        body = json.dumps({"error": {"message": message, "type": "ace_config_error"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 500, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def close(self) -> None:
        """Stop following the config file and the store's background work: `controller.close()`
        (lifespan shutdown does the same)."""
        if self.config_error is None:
            self.controller.close()

    async def lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, with the controller started on startup and closed on shutdown. An
        app that does not speak the protocol (a bare ASGI app that raises or returns at once, as
        the spec allows) gets it spoken for it: the middleware's start-up still runs."""
        started: list[Message] = []
        try:
            await self.app(scope, self.lifespan_receive(receive, send, started), send)
        except Exception:
            if started:
                raise  # the app's own start-up or shutdown failed
            logger.info("ace-mw: the app does not run the ASGI lifespan; ace-mw runs its own")
        if not started:
            await self.own_lifespan(receive, send)

    async def own_lifespan(self, receive: Receive, send: Send) -> None:
        """The lifespan for an app that does not run it: our start-up and shutdown, completed."""
        lifespan = self.lifespan_receive(receive, send, [])
        while True:
            message = await lifespan()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def lifespan_receive(self, receive: Receive, send: Send, seen: list[Message]) -> Receive:
        """The app's lifespan, with the controller's pool probes started on startup and the
        controller closed on shutdown (its store syncs from the moment it is built). A store
        that must be reachable and is not (`state.required`) fails the start-up: uvicorn exits.
        `seen` collects the messages the app received."""

        async def lifespan() -> Message:
            message = await receive()
            seen.append(message)
            if message["type"] == "lifespan.startup":
                try:
                    self.controller.start()
                except AceError as exc:
                    logger.error("ace-mw: the app cannot start: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": f"ace-mw: {exc}"})
                    raise
            elif message["type"] == "lifespan.shutdown":
                await anyio.to_thread.run_sync(self.controller.close)
            return message

        return lifespan


class AceResponder:
    """One request: read the body, decide and rewrite it, then hand the response to the one of
    two senders it needs (chosen once, by class, as Starlette's GZip picks its responder)."""

    __slots__ = ("app", "controller", "max_body_bytes", "failures", "receive", "pending", "disconnected")

    def __init__(self, middleware: AceSpecDec) -> None:
        self.app = middleware.app
        self.controller = middleware.controller
        self.max_body_bytes = middleware.max_body_bytes
        self.failures = middleware.failures
        self.receive: Receive = unattached_receive
        self.pending: deque[Message] = deque()  # request messages to replay before the real receive
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.receive = receive
        scope = _with_state(scope)
        headers, conflicts = _plain(scope["headers"])
        raw, body, body_error = await self.read_body(headers)
        if body_error == "disconnected":
            # Nothing will be served: let the app see the messages (and the disconnect) as they came.
            await self.app(scope, self.receive_replayed, send)
            return
        view = RequestView("POST", scope["path"], headers, body, body_error, headers.get("x-request-id"), conflicts)
        if not self.controller.synced:  # a replica's first requests: the fleet's state first
            await anyio.to_thread.run_sync(self.controller.wait_synced)
        writer = BodyWriter(raw, body)
        try:
            decision, observer = self.controller.begin(view, writer.write)
        except ClientError as exc:
            await _send_json(send, exc.status_code, exc.to_openai_error())
            return
        except Exception:
            self.failures.record("begin")
            await self.app(scope, self.receive_replayed, send)
            return
        scope["state"][STATE_DECISION] = decision
        scope["state"][STATE_POOL] = decision.pool
        if writer.encoded is not None:
            scope = self.replace_body(scope, writer.encoded)
        ours = decision.response_headers()
        # The request as read and parsed is not needed past here: a long conversation's parsed
        # body would otherwise live for the whole response, aging in the garbage collector.
        del raw, body, view, writer, decision
        if observer is None:
            # Nothing reads the response: every message leaves as the server's own awaitable, the
            # start with our headers (none to add: the server's own send).
            await self.app(scope, self.receive_replayed, HeadersSender(send, ours).send if ours else send)
            return
        sender = ObservedSender(send, ours, observer, self.failures)
        try:
            await self.app(scope, self.receive_replayed, sender.send)
        except BaseException as exc:
            sender.finish(error=type(exc).__name__)
            raise
        if not sender.completed:
            sender.finish(error="client_disconnect" if self.disconnected else "incomplete")

    async def read_body(self, headers: dict[str, str]) -> tuple[bytes, dict[str, Any] | None, str | None]:
        """Collect the body under the cap: (the bytes when read whole, the parsed object, why not).
        Every message read is queued for replay as received."""
        content_type = headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            return b"", None, "unsupported_content_type"
        encoding = headers.get("content-encoding")
        if encoding is not None and encoding.lower() != "identity":
            return b"", None, "unsupported_content_type"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return b"", None, "too_large"
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            self.pending.append(message)
            if message["type"] != "http.request":
                self.disconnected = True
                return b"", None, "disconnected"
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", None, "too_large"
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if not raw:
            return raw, None, "empty"
        try:
            # Decoded here when plain UTF-8 (nearly always): json.loads would first detect it, in Python.
            body = parse_body(raw)
        except (ValueError, RecursionError):
            return raw, None, "not_json"
        if not isinstance(body, dict):
            return raw, None, "not_object"
        return raw, body, None

    def replace_body(self, scope: Scope, raw: bytes) -> Scope:
        self.pending = deque([{"type": "http.request", "body": raw, "more_body": False}])
        headers = [
            (name, value) for name, value in scope["headers"] if name not in (b"content-length", b"transfer-encoding")
        ]
        headers.append((b"content-length", str(len(raw)).encode()))
        scope["headers"] = headers
        return scope

    async def receive_replayed(self) -> Message:
        """The body messages once (rewritten or as received), then the real receive, so the app
        still sees `http.disconnect`."""
        if self.pending:
            return self.pending.popleft()
        message = await self.receive()
        if message["type"] == "http.disconnect":
            self.disconnected = True
        return message


class HeadersSender:
    """The app's `send` for a response that no observer reads: our headers join its start."""

    __slots__ = ("_send", "headers")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self.headers = headers

    def send(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
        return self._send(message)


class ObservedSender:
    """The app's `send` for a response the observer reads on its way out: every chunk forwarded
    at once, what we forced cut out again, the figures handed to the controller at the end."""

    __slots__ = ("_send", "headers", "observer", "failures", "held_start", "passing", "completed")

    def __init__(
        self, send: Send, headers: list[tuple[bytes, bytes]], observer: ResponseObserver, failures: FailOpen
    ) -> None:
        self._send = send
        self.headers = headers
        self.observer: ResponseObserver | None = observer
        self.failures = failures
        self.held_start: Message | None = None  # response start held with a held JSON body
        self.passing = False  # no observer reads the chunks (none, or it passes them): all but the last skip it
        self.completed = False

    def send(self, message: Message) -> Awaitable[None]:
        """A plain function, so that a body chunk the observer would return as it is (only body
        chunks say more_body; e.g. of a response not measured) goes out as the server's own
        awaitable, with no coroutine of ours around it: the per-chunk hot path."""
        if self.passing and message.get("more_body"):
            return self._send(message)
        return self.send_observed(message)

    async def send_observed(self, message: Message) -> None:
        """The whole state machine over response messages; its body branch is the hot path of a
        response that is read."""
        kind = message["type"]
        if kind == "http.response.body":
            # Forward each chunk at once; the observer changes bytes only to remove what the
            # adapter forced, and holds bytes only while rewriting a JSON body.
            more_body = message.get("more_body", False)
            observer = self.observer
            if observer is not None:
                chunk = message.get("body", b"")
                try:
                    if len(chunk) > OFFLOAD_CHUNK_BYTES:
                        forwarded = await anyio.to_thread.run_sync(observer.feed, chunk, more_body)
                    else:
                        forwarded = observer.feed(chunk, more_body)
                except Exception:
                    self.drop_observer("observe.feed")
                    forwarded = chunk
                if forwarded is not chunk:
                    message = {**message, "body": forwarded}
            if not more_body:
                # Record before the last bytes leave: a client that has the whole response can
                # count on the breaker having seen it.
                self.completed = True
                self.finish(error=None)
            if self.held_start is not None:
                if more_body and not message["body"]:
                    return  # still held by the observer
                start, self.held_start = self.held_start, None
                await self._send(start)
        elif kind == "http.response.start":
            started = self.start_response(message)
            if started is None:
                return  # a JSON body being rewritten: the start leaves with its end
            message = started
        await self._send(message)

    def start_response(self, message: Message) -> Message | None:
        """The start with our headers added, or None when it must wait for the held body; tells
        the observer the status and media type."""
        headers = list(message.get("headers", ()))  # any iterable (ASGI): read twice below
        hold = False
        if self.observer is not None:
            try:
                content_type, encoding = _content_headers(headers)
                # A compressed body cannot be read as it passes: treat it as unobservable.
                if encoding is not None and encoding.lower() != b"identity":
                    content_type = None
                self.observer.start(message["status"], None if content_type is None else content_type.decode("latin-1"))
                if self.observer.rewrites_body:
                    # An event the adapter forced will be cut out: a declared length would lie.
                    headers = [(name, value) for name, value in headers if name.lower() != b"content-length"]
                hold = self.observer.holds_body
            except Exception:
                self.drop_observer("observe.start")
        self.passing = self.observer is None or self.observer.passes_through
        message = {**message, "headers": [*headers, *self.headers]}
        if hold:
            self.held_start = message
            return None
        return message

    def finish(self, error: str | None) -> None:
        """Close the observer once (it feeds figures and releases probe slots)."""
        observer, self.observer = self.observer, None
        if observer is not None:
            try:
                observer.finish(error=error)
            except Exception:
                self.failures.record("observe.finish")
            if observer.unstripped:
                self.failures.count("observe.unstripped", "could not remove what it forced into the response")
            elif observer.errors:
                self.failures.count("observe.fallback", "stopped reading a response after an error of its own")

    def drop_observer(self, stage: str) -> None:
        """Stop observing after our own error, releasing what the observer holds."""
        self.failures.record(stage)
        self.finish(error="internal")


def _with_state(scope: Scope) -> Scope:
    """A copy of the scope whose state says "baseline, undecided" until a decision replaces it,
    so an app reading `request.state.ace_pool` works even when we step aside."""
    scope = dict(scope)
    state = scope.get("state")
    scope["state"] = state = {} if state is None else state
    state[STATE_DECISION] = None
    state[STATE_POOL] = BASELINE_POOL
    return scope


def _content_headers(headers: Any) -> tuple[bytes | None, bytes | None]:
    """The response's content-type and content-encoding (the first of each, as Starlette reads them)."""
    content_type = encoding = None
    for name, value in headers:
        if name == b"content-type":
            if content_type is None:
                content_type = value
        elif name == b"content-encoding" and encoding is None:
            encoding = value
    return content_type, encoding


@lru_cache(maxsize=64)  # clients send a handful of distinct content types
def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _plain(raw: list[tuple[bytes, bytes]]) -> tuple[dict[str, str], frozenset[str]]:
    """Request headers by name (ASGI sends names lower-cased; the last of repeated headers wins),
    and the identity headers repeated with different values (the request is then refused)."""
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in raw}
    if len(headers) == len(raw):  # no name repeated: nearly every request
        return headers, frozenset()
    return headers, conflicting((name.decode("latin-1"), value.decode("latin-1")) for name, value in raw)


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def unattached_receive() -> Message:  # pragma: no cover - a wiring bug guard
    raise RuntimeError("receive awaited before the responder was called")


async def unattached_send(message: Message) -> None:  # pragma: no cover - a wiring bug guard
    raise RuntimeError("send awaited before the responder was called")
