"""The JSON scanner: its events against a reference walk of the value, cut anywhere; where it stops; its errors."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from constrain.jsonscan import AFTER, IN_KEY, IN_STRING, SCALAR, START, JsonScan, JsonSyntaxError

_TEXT = st.text(alphabet='ab"\\/é\n~ \U0001f600', max_size=4)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=12,
)


class Recorder:
    """The events: ("open", is_object), ("close",), ("key", key), ("value", value); keys and values
    decoded, or as reported (``decode=False``)."""

    def __init__(self, decode: bool = True) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.read = json.loads if decode else bytes

    def open(self, is_object: bool) -> None:
        self.events.append(("open", is_object))

    def close(self) -> None:
        self.events.append(("close",))

    def key(self, text: bytes) -> None:
        self.events.append(("key", self.read(text)))

    def value(self, text: bytes) -> None:
        self.events.append(("value", self.read(text)))


def reference(value: Any) -> list[tuple[Any, ...]]:
    """The events of ``value``, from the value itself."""
    if isinstance(value, dict):
        inner = [e for k, v in value.items() for e in [("key", k), *reference(v)]]
        return [("open", True), *inner, ("close",)]
    if isinstance(value, list):
        return [("open", False), *[e for v in value for e in reference(v)], ("close",)]
    return [("value", value)]


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@seed(11)
@given(value=json_values, cuts=st.lists(st.integers(0, 400), max_size=6), spaced=st.booleans(), ascii_=st.booleans())
def test_events_match_the_value_wherever_the_text_is_cut(value, cuts, spaced, ascii_):
    separators = (", ", ": ") if spaced else (",", ":")
    data = (" " if spaced else "") + json.dumps(
        value, separators=separators, ensure_ascii=ascii_, indent=2 if spaced else None
    )
    data_bytes = data.encode()
    bounds = sorted({min(c, len(data_bytes)) for c in cuts} | {0, len(data_bytes)})
    recorder, scan = Recorder(), START
    for lo, hi in itertools.pairwise(bounds):  # cuts may fall inside a UTF-8 sequence or an escape
        scan = scan.feed(data_bytes[lo:hi], recorder)
    scan = scan.end(recorder)
    assert scan.finished
    assert recorder.events == reference(value)


def test_the_scan_is_a_value_fed_without_change():
    scan = START.feed(b'{"a": [1, "x')
    assert (scan.mode, scan.open, scan.text, scan.depth) == (IN_STRING, b"{[", b'"x', 2)
    left, right = scan.feed(b'"]}'), scan.feed(b'y", 2')
    assert left.finished and not right.finished
    assert scan == JsonScan(IN_STRING, b"{[", b'"x')  # forks leave it as it was
    assert START.feed(b'{"k\\"').mode == IN_KEY and START.feed(b'{"k\\"').text == b'"k\\"'
    assert START.feed(b"[12").mode == SCALAR and START.feed(b"[12").text == b"12"


def test_numbers_and_literals_complete_at_the_byte_after_them_or_at_the_end():
    recorder = Recorder()
    scan = START.feed(b"-1.5e3", recorder)
    assert recorder.events == [] and scan.mode == SCALAR
    assert scan.end(recorder).finished and recorder.events == [("value", -1500.0)]
    inside = START.feed(b"[true", recorder)
    assert inside.end(recorder) == inside  # inside a container, the end completes nothing
    assert START.feed(b"null\n").mode == AFTER


@pytest.mark.parametrize(
    "data, read",
    [
        (b'{"a": [1, "}"]}</call>', 15),
        (b'"x\\"y" rest', 6),
        (b"12, 13", 2),  # a top-level number ends before its delimiter
        (b"[[]] []", 4),
        (b'{"a": 1', 7),  # not complete: all of it read
    ],
)
def test_feed_value_stops_where_the_value_ends(data, read):
    scan, got = START.feed_value(data)
    assert got == read
    assert scan.finished == (read < len(data))


@pytest.mark.parametrize(
    "data, position, expected",
    [
        (b'{"a" 1}', 5, "expected ':', got '1'"),
        (b"[1,]", 3, "expected a value, got ']'"),
        (b"{,}", 1, "expected a key or '}', got ','"),
        (b"1 2", 2, "expected the end of the text, got '2'"),
        (b"]", 0, "expected a value, got ']'"),
        (b"[}", 1, "expected a value or ']', got '}'"),
        (b'{"a":1]', 6, "expected ',' or '}', got ']'"),
        (b'{"a":1,}', 7, "expected a key, got '}'"),
        (b"[x]", 1, "expected a value or ']', got 'x'"),
        (b"\xc3\xa9", 0, "expected a value, got byte 0xc3"),
    ],
)
def test_text_that_is_not_json_names_the_byte_and_what_was_expected(data, position, expected):
    with pytest.raises(JsonSyntaxError, match=re.escape(expected)) as caught:
        START.feed(data)
    assert caught.value.position == position
    assert isinstance(caught.value, ValueError)


def test_an_event_may_stop_the_scan():
    class Refuse(Recorder):
        def key(self, text: bytes) -> None:
            raise KeyError(text)

    with pytest.raises(KeyError):
        START.feed(b'{"a": 1}', Refuse())


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@seed(12)
@given(value=json_values, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_without_texts_the_structure_and_keys_are_the_same(value, cuts):
    data = json.dumps(value, ensure_ascii=False).encode()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    kept, bare = Recorder(decode=False), Recorder(decode=False)
    scans = [START, START]
    for lo, hi in itertools.pairwise(bounds):
        scans = [scans[0].feed(data[lo:hi], kept), scans[1].feed(data[lo:hi], bare, texts=False)]
    scans[0].end(kept), scans[1].end(bare)
    assert bare.events == [(kind, b"") if kind == "value" else (kind, *rest) for kind, *rest in kept.events]
    inside = START.feed(b'["', texts=False)
    assert inside.feed(b"a long run of text", texts=False) is inside  # nothing kept, nothing new


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@seed(13)
@given(value=json_values, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_a_piece_that_extends_a_string_or_key_is_what_feeding_it_makes(value, cuts):
    """Where ``extends`` says a piece only extends the string or key being written, feeding it reports
    nothing and appends it to the text (the callers build that scan without feeding)."""
    data = json.dumps(value, ensure_ascii=False).encode()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    scan = START
    for lo, hi in itertools.pairwise(bounds):
        piece, recorder = data[lo:hi], Recorder(decode=False)
        after = scan.feed(piece, recorder)
        if scan.extends(piece):
            assert after == JsonScan(scan.mode, scan.open, scan.text + piece) and not recorder.events
            assert scan.extended(piece) == after
        scan = after


def test_extends_holds_inside_strings_and_keys_only():
    assert JsonScan(IN_STRING, b"[", b'"ab').extends("cd é".encode()) and JsonScan(IN_KEY, b"{", b'"a').extends(b"b")
    assert not JsonScan(IN_STRING, b"[", b'"ab').extends(b'c"') and not JsonScan(IN_KEY, b"{", b'"a').extends(b"\\n")
    assert not JsonScan(SCALAR, b"[", b"12").extends(b"3") and not START.extends(b"abc")
