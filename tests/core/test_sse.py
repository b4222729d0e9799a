"""The incremental SSE parser against the WHATWG rules and a whole-buffer reference parser."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_mw.observe.sse import SSEEvent, SSEParser

BOM = b"\xef\xbb\xbf"


def reference_parse(stream: bytes, max_line: int = 1 << 20) -> list[tuple[str, str, str | None]]:
    """The spec, read literally over the whole stream at once (no chunking to get wrong), with the
    parser's two limits: lines over `max_line` bytes are dropped, and events whose data lines come
    to more than `max_line` bytes (a line's value and its joining line break each) too."""
    if stream.startswith(BOM):
        stream = stream[len(BOM) :]
    lines = re.split(rb"\r\n|\r|\n", stream)[:-1]  # the last piece is the unterminated tail
    events, data, event, last_id, size = [], [], "", None, 0
    for raw in lines:
        if len(raw) > max_line:
            continue
        line = raw.decode("utf-8", "replace")
        if line == "":
            if data and size <= max_line:
                events.append((event or "message", "\n".join(data), last_id))
            data, event, size = [], "", 0
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
            value_raw = raw.partition(b":")[2]
            size += len(value_raw[1:] if value_raw.startswith(b" ") else value_raw) + 1
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            last_id = value
    return events


def parse_in_pieces(stream: bytes, cuts, max_line: int = 1 << 20) -> tuple[list[SSEEvent], SSEParser]:
    parser = SSEParser(max_line)
    events, start = [], 0
    for cut in sorted(set(cuts)) + [len(stream)]:
        events += parser.feed(stream[start:cut])
        start = cut
    events += parser.close()
    return events, parser


def as_tuples(events: list[SSEEvent]) -> list[tuple[str, str, str | None]]:
    return [(e.event, e.data, e.id) for e in events]


def one_byte_at_a_time(stream: bytes, max_line: int = 1 << 20) -> list[SSEEvent]:
    return parse_in_pieces(stream, range(len(stream)), max_line)[0]


FRAGMENTS = [
    b"data",
    b"data:",
    b"data: ",
    b"event: usage",
    b"event:",
    b"id: 7",
    b"id",
    b"id: a\x00b",
    b"retry: 10",
    b": ping",
    b":",
    b"\r",
    b"\n",
    b"\r\n",
    b"\n\n",
    b"\r\n\r\n",
    b" ",
    b"[DONE]",
    b'{"choices":[],"usage":{"completion_tokens":3}}',
    "é€😀\u2028\u2029x".encode(),
    b"\xff\xfe",
    b"\xe2\x82",
    BOM,
    b"x" * 40,
    b"unknown: field",
]
streams = st.lists(st.sampled_from(FRAGMENTS) | st.binary(max_size=12), max_size=40).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(stream=streams, data=st.data())
def test_any_split_yields_the_reference_events(stream, data):
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    assert as_tuples(parse_in_pieces(stream, cuts, max_line=32)[0]) == reference_parse(stream, max_line=32)


@settings(max_examples=200, deadline=None)
@given(stream=streams)
def test_one_byte_at_a_time_yields_the_reference_events(stream):
    assert as_tuples(one_byte_at_a_time(stream, max_line=32)) == reference_parse(stream, max_line=32)


@settings(max_examples=200, deadline=None)
@given(stream=streams, data=st.data())
def test_event_offsets_do_not_depend_on_the_split(stream, data):
    """Except one documented case: an event whose closing CR ends a chunk is dispatched at once,
    so its `end` stops after the CR; the LF that may follow in the next chunk belongs to no event."""
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    whole = [(e.start, e.end) for e in parse_in_pieces(stream, [])[0]]
    split = [(e.start, e.end) for e in parse_in_pieces(stream, cuts)[0]]
    assert len(split) == len(whole)
    for (start, end), (whole_start, whole_end) in zip(split, whole, strict=True):
        assert start == whole_start
        assert end == whole_end or (end + 1 == whole_end and stream[end - 1 : end + 1] == b"\r\n")


@pytest.mark.parametrize("ending", [b"\n", b"\r", b"\r\n"])
def test_every_line_ending_dispatches(ending):
    stream = b"data: a" + ending + b"data: b" + ending + ending
    assert as_tuples(one_byte_at_a_time(stream)) == [("message", "a\nb", None)]


def test_crlf_split_between_chunks_is_one_line_end():
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == [SSEEvent("message", "a")]
    assert parser.feed(b"\ndata: b\r\n\r\n") == [SSEEvent("message", "b")]


def test_cr_only_stream_is_parsed():
    assert as_tuples(SSEParser().feed(b"event: x\rdata: 1\r\rdata: 2\r\r")) == [
        ("x", "1", None),
        ("message", "2", None),
    ]


def test_multibyte_character_split_across_chunks_is_decoded_whole():
    raw = "data: é😀\n\n".encode()
    cut = raw.index(b"\xf0") + 2  # inside the 4-byte emoji
    parser = SSEParser()
    events = parser.feed(raw[:cut]) + parser.feed(raw[cut:])
    assert [e.data for e in events] == ["é😀"] and parser.garbage == 0


def test_u2028_inside_json_is_not_a_line_end():
    raw = 'data: {"text": "a\u2028b\u2029c\x85d"}\n\n'.encode()
    assert [e.data for e in SSEParser().feed(raw)] == ['{"text": "a\u2028b\u2029c\x85d"}']


def test_leading_bom_is_stripped_once():
    events = one_byte_at_a_time(BOM + b"data: a\n\n" + BOM + b"data: b\n\n")
    assert as_tuples(events) == [("message", "a", None)]  # the second BOM makes an unknown field name


def test_comments_are_ignored():
    assert as_tuples(SSEParser().feed(b": ping\n\n:\ndata: x\n: mid-event\n\n")) == [("message", "x", None)]


def test_field_without_colon_has_an_empty_value():
    assert [e.data for e in SSEParser().feed(b"data\ndata\n\n")] == ["\n"]


def test_only_one_space_after_the_colon_is_stripped():
    assert [e.data for e in SSEParser().feed(b"data:  two\ndata:none\n\n")] == [" two\nnone"]


def test_event_without_data_is_not_dispatched():
    assert SSEParser().feed(b"event: x\nid: 1\n\n") == []


def test_event_type_resets_after_each_event():
    events = SSEParser().feed(b"event: usage\ndata: 1\n\ndata: 2\n\n")
    assert [e.event for e in events] == ["usage", "message"]


def test_last_event_id_persists_across_events():
    events = SSEParser().feed(b"id: 5\ndata: a\n\ndata: b\n\nid\ndata: c\n\n")
    assert [e.id for e in events] == ["5", "5", ""]


def test_id_with_nul_is_ignored():
    assert SSEParser().feed(b"id: 1\ndata: a\n\nid: 2\x00\ndata: b\n\n")[1].id == "1"


def test_done_sentinel_passes_as_a_normal_event():
    assert SSEParser().feed(b"data: [DONE]\n\n") == [SSEEvent("message", "[DONE]")]


def test_unterminated_event_is_discarded_on_close():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\n") == [SSEEvent("message", "a")]
    assert parser.close() == [] and parser.discarded_tail


def test_clean_end_reports_no_discarded_tail():
    parser = SSEParser()
    parser.feed(b"data: a\n\n")
    parser.close()
    assert not parser.discarded_tail


def test_invalid_utf8_is_counted_and_replaced():
    parser = SSEParser()
    events = parser.feed(b"data: \xff ok\n\ndata: fine\n\n")
    assert [e.data for e in events] == ["\ufffd ok", "fine"] and parser.garbage == 1


def test_overlong_line_is_dropped_and_parsing_resumes():
    parser = SSEParser(max_line=16)
    events = parser.feed(b"data: " + b"x" * 64 + b"\ndata: short\n\n")
    assert [e.data for e in events] == ["short"] and parser.overlong_lines == 1


def test_overlong_line_arriving_in_pieces_is_not_buffered():
    parser = SSEParser(max_line=16)
    for _ in range(1000):
        parser.feed(b"y" * 1024)
    assert len(parser._tail) == 0 and parser.overlong_lines == 1
    assert [e.data for e in parser.feed(b"\ndata: after\n\n")] == ["after"]


def test_event_offsets_cover_the_event_block():
    stream = b": hi\n\nevent: u\r\ndata: 1\r\n\r\ndata: 2\n\n"
    events = SSEParser().feed(stream)
    assert [stream[e.start : e.end] for e in events] == [b"event: u\r\ndata: 1\r\n\r\n", b"data: 2\n\n"]


def test_non_positive_line_cap_is_rejected():
    with pytest.raises(ValueError, match="max_line"):
        SSEParser(max_line=0)


def test_a_stream_that_begins_without_a_bom_can_skip_its_first_chunk():
    """Skipping the first chunk ends the BOM check (a later BOM is not a leading one); a first
    chunk that may begin a BOM is left to `feed`, which drops it."""
    parser = SSEParser()
    assert parser.skip_events("data: a\n\n")
    assert as_tuples(parser.feed(BOM + b"data: b\n\n")) == []  # the BOM makes an unknown field name
    bommed = SSEParser()
    assert not bommed.skip_events((BOM + b"data: a\n\n").decode("latin-1"))
    assert as_tuples(bommed.feed(BOM + b"data: a\n\n")) == [("message", "a", None)]


def test_an_event_with_more_data_than_the_cap_is_dropped_without_holding_it():
    """Memory per event is bounded like memory per line: its data lines are not kept past the cap."""
    parser = SSEParser(max_line=64)
    events = parser.feed(b"data: xxxxxxxx\n" * 1000 + b"\ndata: after\n\n")
    assert [e.data for e in events] == ["after"] and parser.overlong_events == 1
    parser.feed(b"data: yyyyyyyy\n" * 1000)
    assert parser._data == []  # nothing of it held


def test_a_large_chunk_of_whole_events_without_markers_is_skipped():
    parser = SSEParser(max_line=64)
    assert parser.skip_events("data: x\n\n" * 100_000, ('"usage"',))
