"""Removing members from a JSON text without writing the rest anew.

An adapter's `strip` returns the payload without what `inject` forced (a usage object, SGLang's
meta_info). Serialising that dict again would change how the engine wrote everything else: vLLM
writes `-0.000014781842764932662` where Python writes `-1.4781842764932662e-05`, and key spacing,
escapes and duplicate keys differ too. So the members that `strip` left out are cut out of the
original text instead, each with one of the commas beside it; every other byte stays the engine's.
"""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


class NotARemoval(ValueError):
    """The kept payload differs from the original by more than removed object members."""


def without_removed(text: str, original: Any, kept: Any) -> str:
    """`text` (the JSON of `original`) minus the object members that `kept` lacks. `kept` must be
    `original` with some members removed, at any depth (lists keep their length); else
    NotARemoval, and the caller serialises `kept` itself."""
    start = _skip(text, 0)
    edited, end = _edit(text, start, original, kept)
    return text[:start] + edited + text[end:]


def _edit(text: str, at: int, original: Any, kept: Any) -> tuple[str, int]:
    """(the edited text of the value at `at`, where that value ends in `text`)."""
    if kept is original:
        end = _DECODER.raw_decode(text, at)[1]
        return text[at:end], end
    if isinstance(original, dict) and isinstance(kept, dict):
        return _edit_object(text, at, original, kept)
    if isinstance(original, list) and isinstance(kept, list) and len(original) == len(kept):
        return _edit_array(text, at, original, kept)
    if kept == original and type(kept) is type(original):
        end = _DECODER.raw_decode(text, at)[1]
        return text[at:end], end
    raise NotARemoval(f"a {type(original).__name__} changed")


def _edit_object(text: str, at: int, original: dict[str, Any], kept: dict[str, Any]) -> tuple[str, int]:
    if text[at] != "{" or any(name not in original for name in kept):
        raise NotARemoval("not an object, or a member was added")
    members: list[tuple[int, int, str | None]] = []  # (start, end, edited text or None if removed)
    seen: set[str] = set()
    cursor = _skip(text, at + 1)
    while text[cursor] != "}":
        start = cursor
        name, cursor = json.decoder.scanstring(text, cursor + 1)  # type: ignore[attr-defined]
        if name in seen:
            raise NotARemoval(f"duplicate member {name!r}")  # which one json.loads kept is not ours to guess
        seen.add(name)
        cursor = _skip(text, cursor)
        if text[cursor] != ":":
            raise NotARemoval("malformed member")
        cursor = _skip(text, cursor + 1)
        edited: str | None
        if name in kept:
            value, end = _edit(text, cursor, original[name], kept[name])
            edited, cursor = text[start:cursor] + value, end  # the name and colon as written
        else:
            edited, cursor = None, _DECODER.raw_decode(text, cursor)[1]
        members.append((start, cursor, edited))
        cursor = _skip(text, cursor)
        if text[cursor] == ",":
            cursor = _skip(text, cursor + 1)
    return _join(text, at, cursor, members), cursor + 1


def _edit_array(text: str, at: int, original: list[Any], kept: list[Any]) -> tuple[str, int]:
    if text[at] != "[":
        raise NotARemoval("not an array")
    items: list[tuple[int, int, str | None]] = []
    cursor = _skip(text, at + 1)
    for before, after in zip(original, kept, strict=True):
        start = cursor
        edited, cursor = _edit(text, cursor, before, after)
        items.append((start, cursor, edited))
        cursor = _skip(text, cursor)
        if text[cursor] == ",":
            cursor = _skip(text, cursor + 1)
    if text[cursor] != "]":
        raise NotARemoval("array length")
    return _join(text, at, cursor, items), cursor + 1


def _join(text: str, opening: int, closing: int, parts: list[tuple[int, int, str | None]]) -> str:
    """The container from `opening` to `closing` (its brackets) with its parts edited: a kept part
    after another keeps the separator just before it, so a removed part goes with the separator
    before it (the one after it when it is the first part)."""
    pieces = [text[opening : parts[0][0]] if parts else text[opening:closing]]
    emitted, previous_end = False, opening
    for start, end, edited in parts:
        if edited is not None:
            if emitted:  # the separator just before this part, as the engine wrote it
                pieces.append(text[previous_end:start])
            pieces.append(edited)
            emitted = True
        previous_end = end
    pieces.append(text[parts[-1][1] : closing + 1] if parts else text[closing : closing + 1])
    return "".join(pieces)


def _skip(text: str, at: int) -> int:
    while text[at] in _WHITESPACE:
        at += 1
    return at
