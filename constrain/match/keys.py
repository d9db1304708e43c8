"""No duplicate keys: a JSON scanner over the output that masks out any token completing a key its
object already has.

A grammar can say which keys an object may hold, not that each appears once: wherever another key
may be any string (``additionalProperties``, ``patternProperties``, an object the schema leaves
open, properties in any order), xgrammar and llguidance both admit ``{"a": 1, "a": 2}``, which JSON
parsers read as ``{"a": 2}``, silently. :class:`KeyState` follows the output byte by byte (the grammar
keeps it well-formed JSON) and knows, per open object, the keys written so far;
:meth:`KeyState.forbid_duplicates` clears from a bitmask row the tokens that would complete one of
them again:

- inside a key written so far as ``P``, the tokens whose text starts with ``rest + '"'`` for each
  earlier key ``P + rest``: a prefix search in the sorted vocabulary;
- anywhere, the few tokens with two or more ``"`` (``","``, ``":"``...) that could open and close a
  key by themselves, by scanning them.

Keys compare as written: a key spelled again with other escapes (``"\\u0061"`` for ``"a"``) is not
caught. The :class:`~constrain.match.matcher.Matcher` applies this to every mask it fills and refuses such a
token in ``accept_token``, so sampling, jump-forward, speculation and the closing path all see it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.schema import SCHEMA_LISTS, SCHEMA_MAPS, SINGLE_SCHEMAS
from constrain.match.bitmask import allowed_among, clear_bits
from constrain.match.vocab import KeyVocab, key_vocab

__all__ = ["KeyState", "may_repeat_keys"]

# scanner modes
_VALUE, _KEY, _IN_KEY, _KEY_ESCAPE, _COLON, _IN_STRING, _STRING_ESCAPE, _SCALAR, _AFTER = range(9)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WHITESPACE = frozenset(b" \t\n\r")

Frame = frozenset[bytes] | None
"""An open container: an object's keys so far (as written, without quotes), or None for an array."""


def _scan(mode: int, stack: tuple[Frame, ...], key: bytes, data: bytes) -> tuple[int, tuple[Frame, ...], bytes, bool]:
    """Advance the scanner over ``data``; the last item says whether a key was completed a second time
    in its object (scanning stops there)."""
    for byte in data:
        if mode == _IN_KEY:
            if byte == _QUOTE:
                keys = stack[-1]
                if keys is None:  # not reached on well-formed JSON
                    keys = frozenset()
                if key in keys:
                    return mode, stack, key, True
                stack, mode = (*stack[:-1], keys | {key}), _COLON
            else:
                key += bytes((byte,))
                mode = _KEY_ESCAPE if byte == _BACKSLASH else _IN_KEY
        elif mode == _KEY_ESCAPE:
            key, mode = key + bytes((byte,)), _IN_KEY
        elif mode == _IN_STRING:
            mode = _STRING_ESCAPE if byte == _BACKSLASH else _AFTER if byte == _QUOTE else _IN_STRING
        elif mode == _STRING_ESCAPE:
            mode = _IN_STRING
        elif byte in _WHITESPACE:
            if mode == _SCALAR:
                mode = _AFTER
        elif mode == _SCALAR and byte not in b",}]":
            continue
        elif byte == ord("{") and mode == _VALUE:
            stack, mode = (*stack, frozenset()), _KEY
        elif byte == ord("[") and mode == _VALUE:
            stack, mode = (*stack, None), _VALUE
        elif byte == _QUOTE:
            mode, key = (_IN_KEY, b"") if mode == _KEY else (_IN_STRING, key)
        elif byte in b"}]":
            stack, mode = stack[:-1], _AFTER
        elif byte == ord(","):
            mode = _KEY if stack and stack[-1] is not None else _VALUE
        elif byte == ord(":"):
            mode = _VALUE
        elif mode == _VALUE:
            mode = _SCALAR
    return mode, stack, key, False


@dataclass(frozen=True, slots=True)
class KeyState:
    """Where the output stands in its JSON value, and the keys of every open object. Immutable."""

    vocab: KeyVocab
    mode: int = _VALUE
    stack: tuple[Frame, ...] = ()
    key: bytes = b""  # the key being written (mode _IN_KEY / _KEY_ESCAPE), as written

    @classmethod
    def initial(cls, info: TokenizerInfo) -> KeyState:
        return cls(key_vocab(info))

    def advance(self, token_id: int) -> KeyState | None:
        """The state after ``token_id``; None when it would complete a key its object already has."""
        return self.advance_bytes(self.vocab.texts[token_id])

    def advance_bytes(self, data: bytes) -> KeyState | None:
        """The state after ``data``; None when it would complete a key its object already has."""
        mode, stack, key, duplicate = _scan(self.mode, self.stack, self.key, data)
        return None if duplicate else KeyState(self.vocab, mode, stack, key)

    def forbid_duplicates(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
    ) -> None:
        """Clear from ``row`` every token that would complete a key its object already has."""
        if not any(frame for frame in self.stack):
            return  # no object holds a key yet (a token completing two equal keys at once is not a word)
        vocab = self.vocab
        banned: list[int] = []
        if self.mode in (_IN_KEY, _KEY_ESCAPE):
            for written in self.stack[-1] or ():
                if written.startswith(self.key):
                    prefix = written[len(self.key) :] + b'"'
                    lo = bisect.bisect_left(vocab.sorted_texts, prefix)
                    hi = bisect.bisect_left(vocab.sorted_texts, prefix + b"\xff", lo)
                    banned += vocab.sorted_ids[lo:hi]
        # from inside a string value, a token must close it, then open and close a key: three quotes
        ids = vocab.multi_quote[self.mode == _IN_STRING]  # [m] int64
        allowed = allowed_among(row, ids)  # [k] int64
        banned += [token for token in allowed.tolist() if self.advance(token) is None]
        clear_bits(row, banned)


def may_repeat_keys(schema: Any, any_order: bool) -> bool:
    """Whether a grammar for the prepared ``schema`` may admit an object with a key twice: some object
    is open (undeclared keys allowed), or its keys may come in any order (an any-order grammar of one
    declared key admits it twice: ``{"price": 6, "price": 3.75}``)."""
    if not isinstance(schema, dict):
        return schema is True
    types = schema.get("type")
    untyped = types is None and not any(k in schema for k in ("$ref", "anyOf", "allOf", "oneOf", "enum", "const"))
    if types == "object" or (isinstance(types, list) and "object" in types) or untyped:
        if schema.get("additionalProperties") is not False or (any_order and schema.get("properties")):
            return True
    subschemas = [
        *(sub for key in SCHEMA_MAPS if isinstance(schema.get(key), dict) for sub in schema[key].values()),
        *(sub for key in SCHEMA_LISTS if isinstance(schema.get(key), list) for sub in schema[key]),
        *(schema[key] for key in SINGLE_SCHEMAS if key in schema),
    ]
    return any(may_repeat_keys(sub, any_order) for sub in subschemas if sub is not False)
