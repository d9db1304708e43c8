"""A JSON string's length as it is written: what ``maxLength`` reads, exact at every token.

JSON Schema counts a string's characters (code points) once the string is decoded: ``\\n`` is one, so is
``\\u00e9``, ``é`` written as two UTF-8 bytes, and a surrogate pair escaped as ``\\ud83d\\ude00``.
:func:`written_length` counts the characters the raw text of a string being written (after its opening
quote) holds already: an escape or a character begun counts as the one it will be, and a high surrogate
escaped last counts alone, since a low one may yet join it. That is the fewest characters any
continuation of the text has, and what it has once the string is closed, so a token is refused as soon
as every continuation of the string would be too long, and never sooner: the check is exact as the
string is written, not only when it completes (no dead end: see :mod:`constrain.match.values`).

:func:`token_lengths` gives, per token, the characters it adds to a string up to its first closing
quote, after a text whose last piece may be unsettled (an escape, a character or a surrogate pair
begun: :func:`written_length`'s second value says where it starts): the string's characters and a
token's add up, so a mask row is cleared of the tokens too long at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import regex

__all__ = ["token_lengths", "written_length"]

_PIECES = regex.compile(
    rb"""
      (?P<pair>\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})
    | (?P<high>\\u[dD][89abAB][0-9a-fA-F]{2}(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]?)?)?)?)?\Z)
    | (?P<escape>\\(?:u[0-9a-fA-F]{0,4}|[^u])?)
    | (?P<byte>[\x00-\x7f\xf8-\xff])
    | (?P<wide>[\xc0-\xdf][\x80-\xbf]?|[\xe0-\xef][\x80-\xbf]{0,2}|[\xf0-\xf7][\x80-\xbf]{0,3})
    | (?P<tail>[\x80-\xbf])
    """,
    regex.VERBOSE | regex.DOTALL,
)
"""One character per match but ``tail`` (a byte that continues a character begun before): an escaped
surrogate pair, a high surrogate escaped last (a low one maybe begun after it), any other escape
(whole or begun), one byte, a character of several bytes (whole or begun)."""


def _width(lead: int) -> int:
    """The bytes of the UTF-8 character that ``lead`` starts."""
    return 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 1


def _utf8_settled(content: bytes) -> int:
    """The bytes of ``content`` before a UTF-8 character begun at its end (``len(content)``: none)."""
    for back in range(1, min(4, len(content)) + 1):
        if content[-back] & 0xC0 != 0x80:  # the last character's first byte
            return len(content) if back >= _width(content[-back]) else len(content) - back
    return len(content)


def written_length(content: bytes) -> tuple[int, int]:
    """``(characters, settled)`` of a JSON string's raw ``content`` so far (after its opening quote, before
    any closing one): the characters it holds, and how many of its bytes come before its last piece
    where that piece is unsettled (an escape or a character begun, or a high surrogate escaped last: it
    counts one character, and what follows may complete it), else ``len(content)``."""
    if b"\\" not in content:
        if content.isascii():
            return len(content), len(content)
        count = len(content) - sum(1 for byte in content if byte & 0xC0 == 0x80)
        return count, _utf8_settled(content)
    count, settled = 0, len(content)
    for piece in _PIECES.finditer(content):
        kind = piece.lastgroup
        if kind != "tail":
            count += 1
        text = piece.group()
        unsettled = (
            kind == "high"
            or (kind == "escape" and (len(text) < 2 or (text[1:2] == b"u" and len(text) < 6)))
            or (kind == "wide" and len(text) < _width(text[0]))
        )
        settled = piece.start() if unsettled else len(content)
    return count, settled


def token_lengths(texts: Sequence[bytes], tail: bytes = b"") -> np.ndarray:
    """``[V]`` int32: per token's bytes, the characters they add to a string up to their first closing quote
    (an escaped one, ``\\"``, is a character), after a settled text and its unsettled last piece ``tail``
    (:func:`written_length`; counted as a character already)."""
    scanned: Sequence[int]  # the tokens counted piece by piece
    if tail:
        found, scanned = np.zeros(len(texts), dtype=np.int32), range(len(texts))
    else:  # without a quote or an escape: the bytes that start a character, counted for all tokens at once
        data = np.frombuffer(b"".join(texts), dtype=np.uint8)  # [sum of the texts' bytes]
        bounds = np.concatenate(([0], np.cumsum([len(text) for text in texts])))  # [V + 1]: where each text starts

        def per_token(flags: np.ndarray) -> np.ndarray:  # [V]: the flags set in each token's bytes
            return np.diff(np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))[bounds])

        found = per_token((data & 0xC0) != 0x80).astype(np.int32)  # [V]
        scanned = np.flatnonzero(per_token((data == ord('"')) | (data == ord("\\")))).tolist()
    for token in scanned:
        text = texts[token]
        count = -1 if tail else 0
        for piece in _PIECES.finditer(tail + text):
            if piece.group() == b'"':
                break
            count += piece.lastgroup != "tail"
        found[token] = max(count, 0)
    return found
