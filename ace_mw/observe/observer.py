"""Watches one response on its way to the client and reads the engine's acceptance figures (and,
for the speed policy, when its tokens passed).

The observer sits on the hot path of every chunk, so it does as little as it can: SSE is parsed
incrementally and only events whose data contains one of the adapter's markers are JSON-parsed;
a JSON body is copied (under a cap) and parsed once at the end. It never raises into the caller:
any failure is counted, the observer switches to plain pass-through and forwards every byte it
was given. Bytes change only where the adapter forced something into the response
(`Injection.forced`): then the event carrying it is removed or rewritten, and everything else is
forwarded byte-identical. A response the controller chose not to measure (`reads=False`, nothing
forced) is not read at all; once `passes_through` is true an integration may skip `feed` for every
chunk but the last.

Integration contract: call `start` with the status and content type, `feed` every body chunk in
order and forward what it returns, pass `more_body=False` with the last chunk (an empty one is
fine), then call `finish` (also on errors and disconnects). When `rewrites_body` is true the body
length may change, so drop `content-length`; when `holds_body` is true, `feed` returns b"" until
the last chunk and then the whole (rewritten) body, so send the response start only then.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from ..acceptance import AcceptanceFigures, combine
from ..adapters.base import MAX_HELD_BODY, NO_INJECTION, EngineAdapter, Injection, count
from ..decide.samples import StreamTiming
from .json_edit import without_removed
from .sse import DEFAULT_MAX_LINE, SSEEvent, SSEParser

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = MAX_HELD_BODY  # JSON bodies larger than this are forwarded unread

# Outcomes handed to on_finish with the figures.
OK = "ok"  # response complete, figures found
NO_FIGURES = "no_figures"  # response complete, the engine reported none
HTTP_ERROR = "http_error"  # non-2xx status: not a generation, nothing to learn
SERVER_ERROR = "server_error"  # a 5xx status: the same, and the pool did not serve it (outliers.py)
NOT_OBSERVED = "not_observed"  # neither SSE nor JSON (or never started)
TOO_LARGE = "too_large"  # JSON body over the cap: forwarded unread
ABORTED = "aborted"  # finish(error=...): the response broke off (figures may be partial)
OBSERVER_ERROR = "observer_error"  # the observer failed and fell back to pass-through
UNMEASURED = "unmeasured"  # not read, by the controller's choice (gate.max_measured_per_s)

_SSE, _JSON, _PASS = "sse", "json", "pass"
_UNPARSED = object()

OnFinish = Callable[[AcceptanceFigures | None, str, StreamTiming | None], None]

# A stream chunk carries generated output when one of these fields holds a non-empty value (a
# role-only first chunk, a finish-only chunk or a usage chunk does not): not "", null or [].
_TOKEN_FIELDS = tuple((name, len(name)) for name in ('"content":', '"text":', '"reasoning_content":', '"tool_calls":'))
_EMPTY_VALUES = frozenset(('""', "nu", "[]"))  # the first two characters of each
_USAGE_MARKER = '"usage"'
_MAX_TEMPLATE_MISSES = 4  # a stream whose chunks differ beyond one value stops trying templates


class ResponseObserver:
    """Per-response state: parser, held bytes, figures. Create one per request."""

    def __init__(
        self,
        adapter: EngineAdapter,
        injection: Injection | None,
        on_finish: OnFinish,
        *,
        max_body: int = DEFAULT_MAX_BODY,
        max_line: int = DEFAULT_MAX_LINE,
        clock: Callable[[], float] | None = None,
        reads: bool = True,
    ) -> None:
        self.adapter = adapter
        self.injection = injection or NO_INJECTION
        self.figures: AcceptanceFigures | None = None
        self.errors = 0  # failures caught (observer bugs, on_finish raising)
        # It stopped stripping with what was forced possibly still in the response (an error of
        # ours, or a held body past its cap): the integration counts it.
        self.unstripped = False
        self.garbage = 0  # events or bodies that were not the JSON they claimed to be
        self.error: str | None = None  # what finish(error=...) was told
        self._on_finish = on_finish
        self._max_body = max_body
        self._max_line = max_line
        # With a clock the response is also a speed sample: token-bearing chunks are timed and the
        # usage's output token count is read, whatever the adapter.
        self._clock = clock if clock is not None else time.monotonic
        self.timing = StreamTiming() if clock is not None else None
        self._strip_markers = adapter.strip_markers
        self._figure_markers, self._markers, templates = _markers_of(
            tuple(adapter.figure_markers), tuple(adapter.strip_markers), clock is not None
        )
        # A stream's token chunks usually differ only in the text of one string value. Once a chunk
        # passed the full checks below and was skipped, a next chunk that is the same bytes with
        # other text in that value (no quote, backslash or line break in it) passes them too: it
        # has the same events, fields and lines. That holds while every marker is a JSON key
        # (text inside a string cannot hold one); a stream whose chunks keep differing elsewhere
        # stops trying after a few misses.
        # (the bytes before and after the value in the last skipped chunk, and their lengths)
        self._template: tuple[bytes, bytes, int, int] | None = None
        self._passed = 0  # bytes the template let through since the parser last saw the stream
        self._template_misses = 0 if templates else _MAX_TEMPLATE_MISSES
        self._strips = bool(self.injection.forced)
        # An unread response passes untouched, unless something forced into it must come out again.
        self._reads = reads or self._strips
        self._mode: str | None = None
        self._outcome: str | None = None
        self._finished = False
        self._parser: SSEParser | None = None
        self._body: bytearray | None = None  # JSON copy, or the bytes held back while stripping
        self._held_at = 0  # SSE stream offset of _body[0] while stripping
        self._skip_lf_at = -1  # offset of an LF that belongs to a removed event's final CR

    @property
    def rewrites_body(self) -> bool:
        """The body may differ from the upstream's (drop content-length)."""
        return self._strips and self._mode in (_SSE, _JSON)

    @property
    def passes_through(self) -> bool:
        """`feed` returns every chunk as given from now on (unread, not an observable response, or
        an error); only `more_body=False` and `finish` still matter."""
        return self._mode is _PASS

    @property
    def holds_body(self) -> bool:
        """A JSON body is held until its last chunk so a forced field can be removed from it."""
        return self._strips and self._mode == _JSON

    def start(self, status: int, content_type: str | None) -> None:
        """Choose how to read the body from the response status and media type."""
        if not self._reads:
            self._pass(SERVER_ERROR if status >= 500 else UNMEASURED)
            return
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if not 200 <= status < 300:
            self._pass(SERVER_ERROR if status >= 500 else HTTP_ERROR)
        elif media == "text/event-stream":
            self._mode = _SSE
            self._parser = SSEParser(self._max_line)
            if self._strips:
                self._body = bytearray()
        elif media == "application/json" or media.endswith("+json"):
            self._mode = _JSON
            self._body = bytearray()
        else:
            self._pass(NOT_OBSERVED)

    def feed(self, chunk: bytes, more_body: bool = True) -> bytes:
        """Take one body chunk; return the bytes to forward now (`chunk` itself when unchanged)."""
        # The hot path of a stream: a token chunk that is the last skipped one with other text in
        # its value (see __init__) is only counted and timed. A template exists only right after a
        # skipped chunk, in an SSE response, with the parser between events and nothing held.
        # Written out inline, every call and lookup saved counts here (a try block costs nothing
        # in Python 3.11 until it catches).
        try:
            template = self._template
            if template is not None:
                before, after, start, tail = template
                size = len(chunk)
                if more_body and size <= self._max_line and chunk.startswith(before) and chunk.endswith(after):
                    value = chunk[start : size - tail]  # no quote, backslash or line break in it:
                    if value and 34 not in value and 92 not in value and 10 not in value and 13 not in value:
                        self._passed += size
                        timing = self.timing
                        if timing is not None:  # what timing.tick does once the first token chunk is timed
                            timing.last = self._clock()
                            timing.chunks += 1
                        return chunk
                self._template = None  # learn again from the next chunk the full checks skip
                self._template_misses += 1
            mode = self._mode
            if mode is _SSE:
                return self._feed_sse(chunk, more_body)
            if mode is _JSON:
                return self._feed_json(chunk, more_body)
            return chunk
        except Exception:  # fail open: forward everything not yet forwarded
            logger.exception("ace-mw response observer failed; passing the response through")
            self.errors += 1
            held = self._body if self._strips else None
            self.unstripped = self._strips
            self._pass(OBSERVER_ERROR)
            return bytes(held) if held is not None else chunk

    def read_figures(self, figures: AcceptanceFigures | None) -> None:
        """Figures an integration read itself (a gRPC message's fields: ace-mw's own contract,
        whatever the adapter); nothing when the response is not read (`start` chose pass-through)."""
        if self._mode != _JSON or figures is None:
            return
        self._take(figures)
        if self.timing is not None and figures.output_tokens is not None:
            self.timing.usage_tokens = figures.output_tokens

    def tick(self) -> None:
        """A token-bearing message passed (for integrations whose messages are not SSE, e.g. gRPC)."""
        if self.timing is not None:
            self.timing.tick(self._clock())

    def finish(self, *, error: str | None = None) -> AcceptanceFigures | None:
        """End of the response (complete or not). Idempotent; calls on_finish exactly once."""
        if self._finished:
            return self.figures
        self._finished = True
        self.error = error
        try:
            if self._mode == _JSON and self._body and error is None:
                # The copy of an unstripped body, or a held one whose last chunk never came
                # (its bytes went out unchanged, but the figures are still good).
                self._read_json(bytes(self._body))
            elif self._mode == _SSE:
                assert self._parser is not None
                self._parser.close()
        except Exception:
            logger.exception("ace-mw response observer failed at finish")
            self.errors += 1
            self._outcome = self._outcome or OBSERVER_ERROR
        self._body = None
        outcome = ABORTED if error is not None else self._outcome or (OK if self.figures else NO_FIGURES)
        try:
            self._on_finish(self.figures, outcome, self.timing)
        except Exception:
            logger.exception("ace-mw on_finish callback failed")
            self.errors += 1
        return self.figures

    # -- SSE ---------------------------------------------------------------------------------

    def _feed_sse(self, chunk: bytes, more_body: bool) -> bytes:
        """The full checks: a chunk of whole events that hold no marker (most token chunks) is
        neither parsed nor decoded, only counted past, and may become the template of the next.
        While stripping, the bytes of an unfinished block may be held back: then the chunk
        continues them."""
        parser, strips, timing = self._parser, self._strips, self.timing
        assert parser is not None  # start() made one for an SSE response
        passed = self._passed
        if passed:  # the chunks the template let through since the last full check
            self._passed = 0
            parser.pass_events(passed)
            if strips:
                self._held_at += passed
                self._skip_lf_at = -1
        # Every search below runs on one latin-1 view of the chunk (a character per byte, so
        # offsets and matches are the bytes'): `in` on a str costs half of a bytes.find, which
        # parses its arguments on each call.
        text = chunk.decode("latin-1")
        if timing is not None and _bears_tokens(text):
            timing.tick(self._clock())
        if more_body and not (strips and self._body) and parser.skip_events(text, self._markers):
            if strips:
                self._held_at += len(text)
                self._skip_lf_at = -1
            if self._template_misses < _MAX_TEMPLATE_MISSES:
                self._template = _template_of(text)
            return chunk
        if strips:
            return self._feed_sse_stripping(chunk, more_body)
        for event in parser.feed(chunk):
            self._read_event(event)
        return chunk

    def _read_event(self, event: SSEEvent) -> Any:
        """Figures from one event if its data may hold any; returns its JSON or _UNPARSED."""
        data = event.data
        for marker in self._figure_markers:
            if marker in data:
                payload = self._loads(data)
                if isinstance(payload, dict):
                    self._take(self.adapter.extract(payload))
                    self._read_usage(payload)
                return payload
        return _UNPARSED

    def _feed_sse_stripping(self, chunk: bytes, more_body: bool) -> bytes:
        """Forward complete event blocks, minus the events that carry only what we forced.

        The unfinished block at the end is held back until its blank line arrives: a client
        cannot act on half an event, so this costs no latency, and it lets a block be removed
        before any of its bytes went out."""
        held = self._body
        assert held is not None and self._parser is not None  # start() made both when stripping SSE
        held.extend(chunk)
        held_at = self._held_at
        end = held_at + len(held)
        cursor = held_at
        if self._skip_lf_at == cursor and held[:1] == b"\n":
            cursor += 1  # second half of the CRLF that ended a removed event
        if chunk:
            self._skip_lf_at = -1
        pieces: list[bytes | bytearray] = []
        for event in self._parser.feed(chunk):
            payload = self._read_event(event)
            if event.start < cursor:
                continue  # already forwarded whole (a block too large to hold)
            replacement = self._strip_event(event, payload)
            if replacement is None:
                continue
            pieces.append(held[cursor - held_at : event.start - held_at])
            pieces.append(replacement)
            cursor = event.end
            if cursor == end and held[-1:] == b"\r":
                self._skip_lf_at = cursor
        boundary = self._parser.block_start if more_body else end
        if end - boundary > self._max_line:
            boundary = end  # a huge unfinished block: stop holding, it can no longer be removed
        boundary = max(boundary, cursor)
        if not pieces and cursor == held_at and boundary == end and len(chunk) == len(held):
            held.clear()
            self._held_at = end
            return chunk  # nothing held before, nothing removed: forward the very same object
        pieces.append(held[cursor - held_at : boundary - held_at])
        del held[: boundary - held_at]
        self._held_at = boundary
        if not more_body:
            self._parser.close()
        return b"".join(pieces)

    def _strip_event(self, event: SSEEvent, payload: Any) -> bytes | None:
        """The bytes that replace `event` (b"" to remove it), or None to keep it as it is."""
        data = event.data
        for marker in self._strip_markers:
            if marker in data:
                break
        else:
            return None
        if payload is _UNPARSED:
            payload = self._loads(data)
        if not isinstance(payload, dict):
            return None
        kept = self.adapter.strip(payload, self.injection)
        if kept is payload:
            return None
        if kept is None:
            return b""
        return _encode_event(event, _edited(data, payload, kept))

    # -- JSON --------------------------------------------------------------------------------

    def _feed_json(self, chunk: bytes, more_body: bool) -> bytes:
        body = self._body
        assert body is not None  # a JSON response's copy, dropped only when it passes through
        body.extend(chunk)
        if len(body) > self._max_body:
            self._body = None
            self.unstripped = self._strips
            self._pass(TOO_LARGE)
            return bytes(body) if self._strips else chunk
        if not self._strips:
            return chunk
        if more_body:
            return b""
        original = bytes(body)
        payload = self._read_json(original)
        kept = self.adapter.strip(payload, self.injection) if isinstance(payload, dict) else payload
        body.clear()  # only now: if anything above failed, feed forwards the held bytes
        if kept is payload or kept is None:
            return original
        try:
            text = original.decode("utf-8")
        except UnicodeDecodeError:
            return _dumps(kept).encode("utf-8", "backslashreplace")
        return _edited(text, payload, kept).encode("utf-8", "backslashreplace")

    def _read_json(self, raw: bytes) -> Any:
        payload = self._loads(raw)
        if isinstance(payload, dict):
            self._read_object(payload)
        elif isinstance(payload, list):  # SGLang's native batch answer: one object per prompt
            self._take(combine([f for f in map(self._extract_item, payload) if f is not None]))
        return payload

    def _read_object(self, payload: dict[str, Any]) -> None:
        self._take(self.adapter.extract(payload))
        self._read_usage(payload)

    def _extract_item(self, item: Any) -> AcceptanceFigures | None:
        return self.adapter.extract(item) if isinstance(item, dict) else None

    # -- shared ------------------------------------------------------------------------------

    def _take(self, figures: AcceptanceFigures | None) -> None:
        # Engines report running totals (llama.cpp, SGLang native, TensorRT-LLM), so the latest wins.
        if figures is not None:
            self.figures = figures

    def _read_usage(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if self.timing is not None and isinstance(usage, dict):
            produced = count(usage.get("completion_tokens"))
            if produced is not None:
                self.timing.usage_tokens = produced

    def _loads(self, data: Any) -> Any:
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # JSONDecodeError, undecodable bytes, nesting too deep
            self.garbage += 1
            return None

    def _pass(self, outcome: str) -> None:
        self._mode = _PASS
        self._template = None
        self._outcome = outcome


@lru_cache(maxsize=64)
def _markers_of(
    figure_markers: tuple[str, ...], strip_markers: tuple[str, ...], timed: bool
) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """Worked out once per adapter: (the markers of events that may hold figures, every marker the
    full checks search for, whether templates may be tried). A timed response also reads the
    usage. The second are searched for in a chunk's latin-1 view (see _feed_sse), so in their
    UTF-8 bytes' latin-1 form; templates hold while every marker is a JSON key (see __init__)."""
    figure_markers = figure_markers + ((_USAGE_MARKER,) if timed else ())
    every = tuple(dict.fromkeys(m.encode().decode("latin-1") for m in (*figure_markers, *strip_markers)))
    return figure_markers, every, all(m[:1] == '"' for m in every)


def _bears_tokens(text: str) -> bool:
    """Whether a stream chunk (its latin-1 view) carries generated output: a token field whose
    value is not empty. A few searches, no parsing (this runs on every chunk of a measured stream)."""
    find = text.find
    for name, size in _TOKEN_FIELDS:
        at = find(name)
        while at >= 0:
            at += size
            value = text[at : at + 8].lstrip()
            if value and value[:2] not in _EMPTY_VALUES:
                return True
            at = find(name, at)
    return False


def _template_of(text: str) -> tuple[bytes, bytes, int, int] | None:
    """(the bytes before, the bytes from the closing quote of, and their lengths) the first token
    field's value, when that value is a non-empty string without escapes; else None. `text` is the
    chunk's latin-1 view."""
    for name, size in _TOKEN_FIELDS:
        at = text.find(name)
        if at < 0:
            continue
        start = at + size
        while text[start : start + 1] == " ":
            start += 1
        if text[start : start + 1] != '"':
            return None
        start += 1
        end = text.find('"', start)
        if end <= start or "\\" in text[start:end]:
            return None
        return text[:start].encode("latin-1"), text[end:].encode("latin-1"), start, len(text) - end
    return None


def _edited(text: str, payload: Any, kept: Any) -> str:
    """The JSON text of `kept`: `text` with the members it lacks cut out (every other byte as the
    engine wrote it), or `kept` serialised when it is more than a removal."""
    try:
        return without_removed(text, payload, kept)
    except (ValueError, IndexError, RecursionError):  # NotARemoval, or text that is not that JSON
        return _dumps(kept)


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _encode_event(event: SSEEvent, data: str) -> bytes:
    """A rewritten event: the same event type and id, the new data (a line per line of it)."""
    head = b"" if event.event == "message" else b"event: " + event.event.encode() + b"\n"
    if event.id is not None:
        head += b"id: " + event.id.encode() + b"\n"
    # A lone surrogate (from a "\ud800" escape in the original) goes back out as that escape.
    lines = b"".join(b"data: " + line.encode("utf-8", "backslashreplace") + b"\n" for line in data.split("\n"))
    return head + lines + b"\n"
