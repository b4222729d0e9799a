"""Cutting members out of a JSON text (what the observer does to strip what an adapter forced):
the result is the text the engine would have written without them, byte for byte."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ace_mw.observe.json_edit import NotARemoval, without_removed

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
)
separators = st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")])


@given(st.dictionaries(st.text(max_size=4), values, max_size=5), st.sets(st.text(max_size=4)), separators)
def test_removed_members_leave_the_text_the_rest_would_have(payload, removed, seps):
    """Whatever the members, their order, the spacing: cutting a set of top-level members gives
    the serialisation of the object without them."""
    text = json.dumps(payload, separators=seps)
    kept = {name: value for name, value in payload.items() if name not in removed}
    assert without_removed(text, payload, kept) == json.dumps(kept, separators=seps)


@given(st.lists(st.dictionaries(st.text(max_size=4), scalars, max_size=4), min_size=1, max_size=4), separators)
def test_members_removed_inside_a_list_of_objects(choices, seps):
    """SGLang's meta_info sits in each choice: removed at depth, the rest stays as written."""
    payload = {"id": "x", "choices": [{**c, "meta_info": {"n": 1}} for c in choices]}
    text = json.dumps(payload, separators=seps, ensure_ascii=False)
    kept = {"id": "x", "choices": [dict(c) for c in choices]}
    assert without_removed(text, payload, kept) == json.dumps(kept, separators=seps, ensure_ascii=False)


@pytest.mark.parametrize(
    "kept",
    [{"a": 2}, {"a": 1, "c": 3}, {"b": [1]}, []],
    ids=["changed value", "added member", "shortened list", "another type"],
)
def test_anything_but_a_removal_is_refused(kept):
    payload = {"a": 1, "b": [1, 2]}
    with pytest.raises(NotARemoval):
        without_removed(json.dumps(payload), payload, kept)


def test_a_duplicate_name_is_refused_rather_than_guessed():
    text = '{"a": 1, "a": 2, "usage": {}}'
    with pytest.raises(NotARemoval):
        without_removed(text, json.loads(text), {"a": 2})
