"""The one JSON scanner: reads JSON text piece by piece and reports the values it sees open and complete.

Every part of ``constrain`` that follows JSON as it is written reads it through :class:`JsonScan`: the
matcher's duplicate-key guard and value checks (one token at a time, forked at every probe), the typed
partial values of a stream, the tool-call parser (where the arguments end) and the test helpers (where
an offset stands). A scan is an immutable value of three fields: :attr:`~JsonScan.mode` (where the next
byte stands), :attr:`~JsonScan.open` (the open containers' brackets) and :attr:`~JsonScan.text` (the
string, key or number being written, as written), so a fork costs nothing and a step costs the bytes fed
plus a copy of the token being written (a long string's text grows with it).

:meth:`JsonScan.feed` reads bytes and calls a :class:`JsonEvents` sink as it goes, in text order:

- ``open(is_object)`` at ``{`` or ``[``; ``close()`` at the bracket that ends the innermost container;
- ``key(text)`` when a key is complete, ``value(text)`` when a string, number, ``true``, ``false`` or
  ``null`` is complete, with its text as written (quotes and escapes included: ``json.loads`` reads it).

A string completes at its closing quote; a number or literal at the first byte after it (whitespace,
``,``, ``]`` or ``}``, read next as usual), or, at the top level, at :meth:`JsonScan.end`. Numbers and
literals are checked when they complete, by whoever reads them (``tru`` is a scalar's text here).
Whitespace after the top-level value is read; anything else after it is an error, except where
:meth:`JsonScan.feed_value` stops at its end.

Text that cannot continue a JSON value raises :class:`JsonSyntaxError` (a ``ValueError``) naming the
offending byte and what was expected there. The scan fed is unchanged; the events before the culprit
were reported.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = [
    "AFTER",
    "COLON",
    "FIRST_ITEM",
    "FIRST_KEY",
    "IN_KEY",
    "IN_STRING",
    "KEY",
    "KEY_ESCAPE",
    "KEY_MODES",
    "OUTSIDE",
    "SCALAR",
    "START",
    "STRING_ESCAPE",
    "VALUE",
    "VALUE_MODES",
    "JsonEvents",
    "JsonScan",
    "JsonSyntaxError",
]

# -- modes: where the next byte stands ------------------------------------------------------------
VALUE = 0
"""A value may start (after ``:`` or an array's ``,``; at the top level)."""
FIRST_ITEM = 1
"""Right after ``[``: a value may start, or ``]`` end the array."""
KEY = 2
"""After an object's ``,``: a key starts."""
FIRST_KEY = 3
"""Right after ``{``: a key may start, or ``}`` end the object."""
COLON = 4
"""After a key: its ``:``."""
AFTER = 5
"""After a value: ``,`` or the container's closing bracket (at the top level: only whitespace)."""
IN_STRING, STRING_ESCAPE, IN_KEY, KEY_ESCAPE = 6, 7, 8, 9
"""Inside a string value or a key (``*_ESCAPE``: right after a backslash)."""
SCALAR = 10
"""Inside a number or a literal (``true``, ``false``, ``null``)."""

VALUE_MODES = frozenset({VALUE, FIRST_ITEM})
"""Where a value may start."""
KEY_MODES = frozenset({KEY, FIRST_KEY})
"""Where a key may start."""
OUTSIDE = frozenset({VALUE, FIRST_ITEM, KEY, FIRST_KEY, COLON, AFTER})
"""Between tokens: outside strings, keys and scalars."""

_QUOTE, _BACKSLASH, _LBRACE, _LBRACKET, _COMMA, _COLON = b'"\\{[,:'
_WHITESPACE = frozenset(b" \t\n\r")
_DELIMITERS = frozenset(b" \t\n\r,]}")  # what ends a number or literal
_SCALAR_START = frozenset(b"-0123456789tfn")
_CLOSER = {_LBRACE: ord("}"), _LBRACKET: ord("]")}
_EXPECTED = {
    VALUE: "a value",
    FIRST_ITEM: "a value or ']'",
    KEY: "a key",
    FIRST_KEY: "a key or '}'",
    COLON: "':'",
}


class JsonSyntaxError(ValueError):
    """The text cannot continue a JSON value. ``position``: the offset of the offending byte in the data
    that was fed; ``reason``: what was expected there, and what came."""

    def __init__(self, reason: str, position: int) -> None:
        self.reason, self.position = reason, position
        super().__init__(f"not JSON at byte {position} of the text fed: {reason}")


class JsonEvents(Protocol):
    """What a scan reports, in text order (see the module docstring). A method may raise to stop the
    scan: the exception goes to :meth:`JsonScan.feed`'s caller."""

    def open(self, is_object: bool) -> None: ...

    def close(self) -> None: ...

    def key(self, text: bytes) -> None: ...

    def value(self, text: bytes) -> None: ...


class _Ignore:
    """Events nobody listens to."""

    def open(self, is_object: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def key(self, text: bytes) -> None:
        pass

    def value(self, text: bytes) -> None:
        pass


_IGNORE = _Ignore()


class JsonScan(NamedTuple):
    """Where a JSON text stands after the bytes fed so far. Immutable: feeding returns a new scan (a
    named tuple: the cheapest immutable value to make, once per token and probe)."""

    mode: int = VALUE
    open: bytes = b""
    """The open containers' opening brackets (``{`` or ``[``), outermost first."""
    text: bytes = b""
    """The string (quote included), key (quote included) or scalar being written, as written; else empty."""

    @property
    def depth(self) -> int:
        """How many containers are open."""
        return len(self.open)

    @property
    def finished(self) -> bool:
        """Whether a whole value was read (the top-level value complete; only whitespace may follow)."""
        return self.mode == AFTER and not self.open

    def extends(self, data: bytes) -> bool:
        """Whether ``data`` only extends the string value or key being written: no quote, no backslash, so
        feeding it reports nothing and adds ``data`` to :attr:`text` (most tokens of a string or key, read
        by the callers without a scan). O(len(data)), in C."""
        return (self[0] == IN_STRING or self[0] == IN_KEY) and b'"' not in data and b"\\" not in data

    def extended(self, data: bytes) -> JsonScan:
        """The scan after ``data`` where :meth:`extends` holds: what :meth:`feed` makes, without the scan."""
        return JsonScan(self[0], self[1], self[2] + data)

    def feed(self, data: bytes, events: JsonEvents = _IGNORE, *, texts: bool = True) -> JsonScan:
        """The scan after ``data``, reporting to ``events`` what opens and completes in it. Does not
        change this scan; returns it unchanged where nothing changed. Raises :class:`JsonSyntaxError`
        where ``data`` cannot continue the text.

        ``texts=False``: the texts of string values, numbers and literals are not kept (their ``value``
        events get ``b""``; keys are kept), so a long string costs nothing per piece: for a reader of
        structure and keys only, on every feed of one text."""
        return _scan(self, data, events, False, texts)[0]

    def feed_value(self, data: bytes, events: JsonEvents = _IGNORE, *, texts: bool = True) -> tuple[JsonScan, int]:
        """As :meth:`feed`, but stops where the top-level value completes; returns the scan and how many
        bytes of ``data`` it read (``len(data)`` when the value did not complete in it). A number or
        literal at the top level completes at the byte after it, which is not read."""
        return _scan(self, data, events, True, texts)

    def end(self, events: JsonEvents = _IGNORE) -> JsonScan:
        """The scan once the text ends here: a top-level number or literal being written completes (and is
        reported); anything else is left as it is (check :attr:`finished`)."""
        if self.mode == SCALAR and not self.open:
            events.value(self.text)
            return JsonScan(AFTER)
        return self


START = JsonScan()
"""The scan before any text."""


def _scan(scan: JsonScan, data: bytes, events: JsonEvents, stop: bool, texts: bool) -> tuple[JsonScan, int]:
    mode, opened, text = scan
    at, end = 0, len(data)
    while at < end:
        if mode == IN_STRING or mode == IN_KEY:  # the plain run up to the next quote or backslash, at once
            quote, backslash = data.find(b'"', at), data.find(b"\\", at)
            special = quote if backslash < 0 or 0 <= quote < backslash else backslash
            if special < 0:
                if texts or mode == IN_KEY:
                    text += data[at:]
                break
            if texts or mode == IN_KEY:
                text += data[at : special + 1]
            at = special + 1
            if special == backslash:
                mode = STRING_ESCAPE if mode == IN_STRING else KEY_ESCAPE
                continue
            if mode == IN_KEY:
                events.key(text)
                mode, text = COLON, b""
                continue
            events.value(text)
            mode, text = AFTER, b""
            if stop and not opened:
                return JsonScan(mode), at
            continue
        byte = data[at]
        at += 1
        if mode == STRING_ESCAPE or mode == KEY_ESCAPE:
            if texts or mode == KEY_ESCAPE:
                text += data[at - 1 : at]
            mode = IN_STRING if mode == STRING_ESCAPE else IN_KEY
            continue
        if mode == SCALAR:
            if byte not in _DELIMITERS:
                if texts:
                    text += data[at - 1 : at]
                continue
            events.value(text)
            mode, text = AFTER, b""
            if stop and not opened:
                return JsonScan(mode), at - 1
        if byte in _WHITESPACE:
            continue
        if mode <= FIRST_ITEM:  # VALUE_MODES
            if byte == _QUOTE:
                mode, text = IN_STRING, b'"' if texts else b""
            elif byte == _LBRACE or byte == _LBRACKET:
                opened += data[at - 1 : at]
                events.open(byte == _LBRACE)
                mode = FIRST_KEY if byte == _LBRACE else FIRST_ITEM
            elif byte in _SCALAR_START:
                mode, text = SCALAR, data[at - 1 : at] if texts else b""
            elif mode == FIRST_ITEM and byte == ord("]"):
                opened, mode = _close(opened, events)
            else:
                raise _error(mode, opened, byte, at - 1)
        elif mode <= FIRST_KEY:  # KEY_MODES
            if byte == _QUOTE:
                mode, text = IN_KEY, b'"'
            elif mode == FIRST_KEY and byte == ord("}"):
                opened, mode = _close(opened, events)
            else:
                raise _error(mode, opened, byte, at - 1)
        elif mode == COLON and byte == _COLON:
            mode = VALUE
        elif mode == AFTER and opened and byte == _COMMA:
            mode = KEY if opened[-1] == _LBRACE else VALUE
        elif mode == AFTER and opened and byte == _CLOSER[opened[-1]]:
            opened, mode = _close(opened, events)
        else:
            raise _error(mode, opened, byte, at - 1)
        if stop and mode == AFTER and not opened:
            return JsonScan(mode), at
    if mode == scan[0] and opened is scan[1] and text is scan[2]:
        return scan, end  # nothing changed (a run inside a string whose text is not kept)
    return JsonScan(mode, opened, text), end


def _close(opened: bytes, events: JsonEvents) -> tuple[bytes, int]:
    events.close()
    return opened[:-1], AFTER


def _error(mode: int, opened: bytes, byte: int, position: int) -> JsonSyntaxError:
    expected = _EXPECTED.get(mode)
    if expected is None:  # AFTER
        expected = f"',' or '{chr(_CLOSER[opened[-1]])}'" if opened else "the end of the text"
    got = repr(chr(byte)) if byte < 128 else f"byte 0x{byte:02x}"
    return JsonSyntaxError(f"expected {expected}, got {got}", position)
