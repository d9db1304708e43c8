"""Where JSON text stands, read with :mod:`constrain.jsonscan`: its structural characters, and the context of an offset.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from constrain.jsonscan import (
    AFTER,
    COLON,
    IN_KEY,
    IN_STRING,
    KEY_ESCAPE,
    KEY_MODES,
    OUTSIDE,
    SCALAR,
    START,
    STRING_ESCAPE,
)

__all__ = ["json_context", "structural_characters"]


def structural_characters(text: str) -> Iterator[tuple[int, str, int]]:
    """The structural characters of JSON ``text`` outside strings: (index, character, containers open
    before it; for a closing bracket, after it). Raises ValueError where ``text`` is not JSON."""
    scan = START
    for index, ch in enumerate(text):
        before, scan = scan, scan.feed(ch.encode(), texts=False)
        if ch in "{[,:]}" and (before.mode in OUTSIDE or before.mode == SCALAR):
            yield index, ch, min(before.depth, scan.depth)


class _Path:
    """The scan's events, as the key or index of the member being written in each open container."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []  # per open container: [is_object, key or index]

    def open(self, is_object: bool) -> None:
        self.frames.append([is_object, None if is_object else 0])

    def close(self) -> None:
        self.frames.pop()
        self.value(b"")

    def key(self, text: bytes) -> None:
        self.frames[-1][1] = json.loads(text)

    def value(self, text: bytes) -> None:
        if self.frames and not self.frames[-1][0]:
            self.frames[-1][1] += 1


def json_context(text: str, offset: int) -> tuple[tuple[str | int, ...], str]:
    """Where ``text[offset]`` stands: the path of the value (or, between members, of the container) and
    one of ``"key"``, ``"string"``, ``"scalar"`` (a number or literal), ``"value"`` (a value starts
    there), ``"after value"`` (a member ended: ``,``, ``}``, ``]`` or whitespace follow) or ``"end"``.
    Keys in the path are decoded. Raises ValueError where ``text[:offset]`` is not the start of JSON."""
    path = _Path()
    mode = START.feed(text[:offset].encode(), path, texts=False).mode
    keys = tuple(key for _, key in path.frames)
    if mode in KEY_MODES or mode in (IN_KEY, KEY_ESCAPE, COLON):  # the object's member is not written yet
        return keys[:-1], "key"
    if mode in (IN_STRING, STRING_ESCAPE):
        return keys, "string"
    if mode == SCALAR:
        return keys, "scalar"
    if mode == AFTER:
        return (keys[:-1], "after value") if path.frames else ((), "end")
    return keys, "value"
