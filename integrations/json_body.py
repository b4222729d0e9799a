"""A request body's JSON, read fast and written back without disturbing what the client sent.

Parsing: a UTF-8 body (nearly every request) goes straight to json's C scanner, without the three
Python frames and the encoding detection of `json.loads`; anything else goes through `json.loads`.
Writing: when the adapter only added fields, they are appended to the client's own bytes, so every
number, escape and key order stays as sent; otherwise the body is encoded afresh (a lone surrogate
the client sent as an escape goes back as that escape).
"""

from __future__ import annotations

import json
import json.encoder
import json.scanner
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any


def parse_body(raw: bytes) -> Any:
    """`json.loads(raw)`: the same value, or the same ValueError (or RecursionError)."""
    return _parse_json(raw.decode("utf-8", "surrogatepass")) if _is_utf8(raw) else json.loads(raw)


class BodyWriter:
    """`AceController.begin`'s writer for one request's JSON body: `write(new)` encodes the
    injected body into `encoded` (None until then: the client's bytes go on). The controller
    writes only a body it injected into, so `old` is the parsed body."""

    __slots__ = ("raw", "old", "encoded")

    def __init__(self, raw: bytes, old: dict[str, Any] | None) -> None:
        self.raw, self.old = raw, old
        self.encoded: bytes | None = None

    def write(self, new: dict[str, Any]) -> None:
        assert self.old is not None
        self.encoded = _encode(self.raw, self.old, new)


# json.loads's own C scanner, called without its three Python frames (typeshed types the
# scanner's context as a scanner), and JSON's whitespace (RFC 8259: space, tab, LF, CR).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_whitespace(text: str, index: int) -> int:
    """The index of the first character at or after `index` that is not JSON whitespace."""
    return _JSON_WHITESPACE.match(text, index).end()  # type: ignore[union-attr]  # `*` always matches


def _parse_json(text: str) -> Any:
    """`json.loads(text)` for a str: the same value, or a ValueError where it raises one. A body
    that starts with its object's opening brace and ends with its closing one (nearly every
    request) is scanned in one C call."""
    head = text[:1]
    if head == "\ufeff":
        raise ValueError("Unexpected UTF-8 BOM")  # as json.loads says
    start = 0 if head == "{" else _skip_whitespace(text, 0)
    try:
        value, end = _scan_json(text, start)
    except StopIteration:
        raise ValueError("Expecting value") from None
    if end != len(text) and _skip_whitespace(text, end) != len(text):
        raise ValueError("Extra data")
    return value


def _json_encoder() -> Callable[[Any], str]:
    """`json.JSONEncoder(ensure_ascii=False).encode` of an object, its C encoder built once (`encode`
    builds one per call: half the cost of encoding an adapter's few fields). Without the circular
    check: what it encodes is a parsed body and the adapter's fields, never a cycle."""
    encoder = json.JSONEncoder(ensure_ascii=False, check_circular=False)
    # None where the interpreter has no C accelerator (typeshed does not name these private ones)
    make, quote = getattr(json.encoder, "c_make_encoder", None), getattr(json.encoder, "c_encode_basestring", None)
    if make is None or quote is None:
        return encoder.encode
    chunks = make(None, encoder.default, quote, None, ": ", ", ", False, False, True)
    return lambda value: "".join(chunks(value, 0))


_to_json = _json_encoder()


def _encode(raw: bytes, old: dict[str, Any], new: dict[str, Any]) -> bytes:
    """The rewritten body. When the adapter only added fields, they are appended to the client's
    own bytes, so everything the client sent stays exactly as sent (number formats, escapes, key
    order; a re-encoding would, e.g., turn 1e400 into the invalid token Infinity); otherwise the
    whole body is encoded afresh."""
    # `<=` on items views: every field of `old` is in `new`, equal (or the same object), in C.
    if len(new) > len(old) and _is_utf8(raw) and old.items() <= new.items():
        head = raw.rstrip()[:-1].rstrip()  # the object's closing brace removed
        return head + (b", " if old else b"") + _members_closed({k: v for k, v in new.items() if k not in old})
    try:
        return _to_json(new).encode()
    except UnicodeEncodeError:  # a lone surrogate (the client sent a "\ud800" escape): escaped again
        return json.dumps(new).encode()


def _is_utf8(raw: bytes) -> bool:
    """What `json.detect_encoding(raw) == "utf-8"` says of a body that parsed as a JSON object
    (no BOM, no NUL among its first two bytes), in a fraction of its time."""
    return raw[:1] not in (b"\x00", b"\xef", b"\xfe", b"\xff") and raw[1:2] != b"\x00"


_CACHED_TYPES = frozenset((str, int, bool, type(None)))


def _members_closed(fields: dict[str, Any]) -> bytes:
    """`fields` as JSON object members and the closing brace. An adapter adds the same few fields
    to many requests, so those of plain scalars are encoded once: keyed with their exact types
    (True and 1 are equal keys), floats left out (-0.0 == 0.0)."""
    values = tuple(fields.values())
    types = tuple(map(type, values))
    if _CACHED_TYPES.issuperset(types):
        return _cached_members_closed(tuple(fields), types, values)
    return _to_json(fields)[1:].encode()


@lru_cache(maxsize=1024)
def _cached_members_closed(names: tuple[str, ...], types: tuple[type, ...], values: tuple[Any, ...]) -> bytes:
    return _to_json(dict(zip(names, values, strict=True)))[1:].encode()
