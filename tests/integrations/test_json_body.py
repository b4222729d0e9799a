"""integrations/json_body.py, the request body's JSON: parsed as json.loads parses it, and written
back with the injected fields appended to the client's own bytes, exactly as json.dumps writes them,
or encoded afresh where they must be (AceSpecDec end to end: test_asgi_requests.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_mw.integrations.json_body import _encode, _parse_json, _to_json


@pytest.mark.parametrize(
    "added",
    [
        {"x": True},
        {"x": 1},
        {"x": 0.0},
        {"x": -0.0},
        {"x": None},
        {"x": "\u00e9"},
        {"x": [1, True]},
        {"x": 1, "y": "a"},
    ],
)
def test_appended_fields_are_encoded_exactly_even_when_equal_to_cached_ones(added):
    """The appended members are cached per (name, type, value): True and 1, or 0.0 and -0.0, are
    equal keys and must not share an encoding."""
    for first in ({"x": 1}, {"x": True}, {"x": 0.0}, {"x": -0.0}):  # warm the cache with look-alikes
        _encode(b'{"m": 1}', {"m": 1}, {"m": 1, **first})
    sent = _encode(b'{"m": 1} ', {"m": 1}, {"m": 1, **added})
    assert sent.startswith(b'{"m": 1, ') and json.loads(sent) == {"m": 1, **added}
    assert sent.endswith(json.dumps(added, ensure_ascii=False)[1:].encode())


def test_the_encoder_built_once_writes_what_json_dumps_writes():
    """`_to_json` holds one C encoder for every call: the same text as json.dumps(ensure_ascii=False),
    floats, escapes, nesting and non-finite numbers included, and the same TypeError for a value
    JSON has no form for."""
    values = [
        {"a": 1.5, "b": -0.0, "c": 1e300, "d": float("inf"), "e": 10**30, "f": [None, True, 0.1]},
        {"caf\u00e9": '\U0001f600 "quoted" \\ \n\t\u0001', "nested": {"x": [{"y": []}, {}]}},
        {"messages": [{"role": "user", "content": "x" * 5000}], "temperature": 0.7, "stream": True},
        {},
    ]
    for value in values:
        assert _to_json(value) == json.dumps(value, ensure_ascii=False)
    with pytest.raises(TypeError):
        _to_json({"x": object()})


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
JSON_SPACE = st.text(alphabet=" \t\n\r\u00a0\ufeff\x0b", max_size=3)


def json_texts():
    """JSON documents with odd whitespace around them (JSON's own, and some it does not allow),
    sometimes cut short or followed by more; and arbitrary text."""
    document = st.builds(
        lambda before, value, after, tail: before + json.dumps(value) + after + tail,
        JSON_SPACE,
        JSON_VALUES,
        JSON_SPACE,
        st.sampled_from(["", "", "", "}", "x", "{}", " 1"]),
    )
    cut = st.builds(lambda text, n: text[: len(text) - n], document, st.integers(0, 3))
    return document | cut | st.text(max_size=12)


def parsed(parse, text):
    try:
        return "value", repr(parse(text))  # repr: NaN equals itself, -0.0 differs from 0.0
    except ValueError:
        return ("error",)


@settings(max_examples=400, deadline=None)
@given(json_texts())
def test_the_body_parser_agrees_with_json_loads(text):
    """`_parse_json` (json's C scanner called directly) returns what json.loads returns and
    raises where it raises."""
    assert parsed(_parse_json, text) == parsed(json.loads, text)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"])
def test_a_body_not_in_plain_utf8_is_encoded_afresh(encoding):
    raw = json.dumps({"m": 1}).encode(encoding)
    assert _encode(raw, {"m": 1}, {"m": 1, "x": True}) == b'{"m": 1, "x": true}'
