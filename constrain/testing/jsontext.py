"""Scanning JSON text without parsing it: its structural characters, and where an offset stands.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["json_context", "structural_characters"]


def structural_characters(text: str) -> Iterator[tuple[int, str, int]]:
    """The structural characters of JSON ``text`` outside strings: (index, character, containers open before it)."""
    depth = 0
    in_string = escaped = False
    for index, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[,:]}":
            if ch in "]}":
                depth -= 1
            yield index, ch, depth
            if ch in "{[":
                depth += 1


def json_context(text: str, offset: int) -> tuple[tuple[str | int, ...], str]:
    """Where ``text[offset]`` stands: the path of the value (or, between members, of the container) and
    one of ``"key"``, ``"string"``, ``"scalar"`` (a number or literal), ``"value"`` (a value starts
    there), ``"after value"`` (a member ended: ``,``, ``}``, ``]`` or whitespace follow) or ``"end"``."""
    frames: list[list[Any]] = []  # per open container: [kind, key or index, expecting a key]
    in_string = escaped = is_key = scalar = after = False
    key: list[str] = []
    for ch in text[:offset]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if is_key:
                    frames[-1][1] = "".join(key)
                else:
                    after = True
                continue
            if is_key:
                key.append(ch)
            continue
        if scalar and (ch.isspace() or ch in ",]}"):
            scalar, after = False, True
        if ch == '"':
            is_key = bool(frames) and frames[-1][0] == "object" and frames[-1][2]
            in_string, key, after = True, [], False
        elif ch in "{[":
            frames.append(["object", None, True] if ch == "{" else ["array", 0, False])
            after = False
        elif ch in "]}":
            if frames:
                frames.pop()
            after = True
        elif ch == ",":
            if frames and frames[-1][0] == "object":
                frames[-1][1:] = [None, True]
            elif frames:
                frames[-1][1] += 1
            after = False
        elif ch == ":":
            if frames:
                frames[-1][2] = False
            after = False
        elif not ch.isspace():
            scalar = True
    path = tuple(f[1] for f in frames if not (f[0] == "object" and f[2]))
    if in_string:
        return (path, "key") if is_key else (path, "string")
    if scalar:
        return path, "scalar"
    if frames and frames[-1][0] == "object" and frames[-1][2]:
        return path, "key"
    if after:
        return (path[:-1], "after value") if frames else ((), "end")
    return path, "value"
