"""Incremental `text/event-stream` parser over raw byte chunks (WHATWG HTML, "server-sent events").

The middleware sees a response as the chunks the app happens to send, so a line end, a field
name or a UTF-8 character can be cut anywhere. The parser therefore splits on raw bytes (CR and LF
never occur inside a multi-byte UTF-8 sequence), holds only the unterminated tail of the current
line, and decodes complete values only. It never changes a byte: callers forward the original
chunks; the byte offsets on each event let a caller cut one event out of the stream if it must.

Deliberate limits, so memory stays bounded: a line longer than `max_line` bytes is dropped (counted
in `overlong_lines`), and so is an event whose data lines add up to more than `max_line` bytes
(counted in `overlong_events`; its bytes still pass, it is only not dispatched); invalid UTF-8 is
decoded with U+FFFD and counted in `garbage`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(rb"\r\n?|\n")
_CR = 13
_LF = 10
_COLON = 58
DEFAULT_MAX_LINE = 1 << 20


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event. `start`/`end` are stream byte offsets of its block (not compared).
    Read-only by contract (not frozen: a frozen dataclass costs several times as much to build).

    An event whose closing CR is the last byte of a chunk is dispatched at once, without waiting to
    see whether an LF follows: its `end` is then just after the CR, and that LF, when it comes,
    belongs to no event."""

    event: str
    data: str
    id: str | None = None
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


class SSEParser:
    """Feed byte chunks, get the events they complete; one parser per response stream."""

    def __init__(self, max_line: int = DEFAULT_MAX_LINE) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be positive, got {max_line}")
        self.max_line = max_line
        self.garbage = 0  # values that were not valid UTF-8
        self.overlong_lines = 0  # lines longer than max_line, dropped
        self.overlong_events = 0  # events with more than max_line bytes of data, not dispatched
        self.discarded_tail = False  # close() found an event that never ended
        self._tail = b""  # bytes of the current, unterminated line
        self._tail_at = 0  # stream offset of _tail[0]
        self._skipping = False  # inside an overlong line: drop bytes up to its line end
        self._after_cr = False  # the last byte seen was CR: a following LF belongs to it
        self._bom_pending = True
        self._pos = 0  # stream offset of the next byte fed
        self._block_start = 0  # stream offset where the current event's lines began
        self._data: list[bytes] = []
        self._data_size = 0  # bytes in _data; past max_line the event is dropped (_data_size = -1)
        self._event = b""
        self._id: str | None = None
        self._saw_line = False  # current block has at least one line (for discarded_tail)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse `chunk` (any size, cut anywhere) and return the events it completes."""
        at = self._pos
        self._pos += len(chunk)
        if not chunk:
            return []
        if self._after_cr:
            self._after_cr = False
            if chunk[0] == _LF:  # second half of a CRLF cut between chunks
                if self._block_start == at:
                    self._block_start += 1
                chunk = chunk[1:]
                at += 1
        if self._bom_pending:
            chunk, at = self._strip_bom(chunk, at)
            if not chunk:
                return []
        if self._tail:
            chunk = self._tail + chunk
            at = self._tail_at
            self._tail = b""
        events: list[SSEEvent] = []
        if b"\r" in chunk:
            begin = 0
            for match in _LINE_END.finditer(chunk):
                self._line(chunk, begin, match.start(), at + match.end(), events)
                begin = match.end()
            self._after_cr = chunk[-1] == _CR
        else:
            begin = 0
            find = chunk.find
            stop = find(b"\n")
            while stop >= 0:
                self._line(chunk, begin, stop, at + stop + 1, events)
                begin = stop + 1
                stop = find(b"\n", begin)
        if begin < len(chunk):
            self._keep_tail(chunk, begin, at)
        return events

    def skip_events(self, text: str, markers: tuple[str, ...] = ()) -> bool:
        """Advance past a chunk without parsing it, when it is provably whole events that hold
        none of the caller's `markers`: the parser sits between events and the chunk ends with a
        blank line, has no CR and no `id` field; its size does not matter (a few C-level searches,
        however many lines). `text` is the chunk decoded as latin-1 (a character per byte, so the
        searches match the bytes; searching a str is cheaper than searching bytes). Returns False,
        doing nothing, otherwise; then call `feed`. (Skipped events are not decoded, so their
        invalid UTF-8 is not counted in `garbage`, nor their overlong lines in `overlong_lines`.)"""
        if (
            self._tail
            or self._data
            or self._saw_line
            or self._after_cr
            or (self._bom_pending and text[:1] == "\xef")  # maybe a BOM: `feed` drops it
            or self._skipping
            or text[-2:] != "\n\n"
            or "\r" in text
            or "id:" in text
        ):
            return False
        for marker in markers:
            if marker in text:
                return False
        self._bom_pending = False  # the stream began without one
        self._pos += len(text)
        self._block_start = self._pos
        return True

    def pass_events(self, size: int) -> None:
        """Advance past `size` bytes the caller has proven to be whole events of no interest, right
        after a chunk `skip_events` accepted (the parser is still between events): for a chunk
        that is that one with other text inside a value."""
        self._pos += size
        self._block_start = self._pos

    @property
    def block_start(self) -> int:
        """Stream offset where the event now being read began: every byte before it belongs to a
        finished event, to a comment line between events, or to lines that can no longer become
        part of one."""
        return self._block_start

    def close(self) -> list[SSEEvent]:
        """End of stream. Per the spec an unterminated event is discarded, so nothing is returned;
        `discarded_tail` records whether one was."""
        self.discarded_tail = self.discarded_tail or bool(self._tail or self._skipping or self._saw_line)
        self._tail = b""
        self._skipping = False
        self._reset_event()
        return []

    def _strip_bom(self, chunk: bytes, at: int) -> tuple[bytes, int]:
        """Drop one leading BOM, even when it arrives split over chunks."""
        head = self._tail + chunk
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._tail, self._tail_at = head, at - len(self._tail)
            return b"", at
        self._bom_pending = False
        if not head.startswith(_BOM):
            return chunk, at
        skip = len(_BOM) - len(self._tail)
        self._tail = b""
        self._block_start = at + skip
        return chunk[skip:], at + skip

    def _keep_tail(self, chunk: bytes, begin: int, at: int) -> None:
        """Hold the unterminated line, or start skipping it once it is overlong."""
        if self._skipping:
            return
        if len(chunk) - begin > self.max_line:
            self.overlong_lines += 1
            self._skipping = True
            self._saw_line = True
            return
        self._tail = chunk[begin:]
        self._tail_at = at + begin

    def _line(self, buf: bytes, begin: int, stop: int, end: int, events: list[SSEEvent]) -> None:
        """Process one complete line buf[begin:stop]; `end` is the stream offset after its line end."""
        if self._skipping:  # the end of an overlong line: already counted, drop it
            self._skipping = False
            return
        if begin == stop:
            if self._data:
                events.append(self._dispatch(end))
            self._reset_event()
            self._block_start = end
            return
        if stop - begin > self.max_line:
            self._saw_line = True
            self.overlong_lines += 1
            return
        if buf[begin] == _COLON:  # a comment; between events (a keep-alive ping) it belongs to none
            if not self._saw_line:
                self._block_start = end
            return
        self._saw_line = True
        colon = buf.find(b":", begin, stop)
        if colon < 0:
            name, value = buf[begin:stop], b""
        else:
            name = buf[begin:colon]
            value_at = colon + 2 if colon + 1 < stop and buf[colon + 1] == 32 else colon + 1
            value = buf[value_at:stop]
        if name == b"data":
            if self._data_size >= 0:
                self._data_size += len(value) + 1
                if self._data_size > self.max_line:
                    self.overlong_events += 1
                    self._data, self._data_size = [], -1  # dropped: its later data lines too
                else:
                    self._data.append(value)
        elif name == b"event":
            self._event = value
        elif name == b"id" and b"\0" not in value:
            self._id = self._decode(value)
        # "retry" and unknown fields do not matter to an observer.

    def _dispatch(self, end: int) -> SSEEvent:
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        event = self._decode(self._event) if self._event else "message"
        return SSEEvent(event, self._decode(data), self._id, self._block_start, end)

    def _reset_event(self) -> None:
        self._data = []
        self._data_size = 0
        self._event = b""
        self._saw_line = False

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.garbage += 1
            return raw.decode("utf-8", "replace")
