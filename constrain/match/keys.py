"""No duplicate keys: a JSON scanner over the output that masks out any token completing a key its
object already has.

A grammar can say which keys an object may hold, not that each appears once: wherever another key
may be any string (``additionalProperties``, ``patternProperties``, an object the schema leaves
open, properties in any order), xgrammar and llguidance both admit ``{"a": 1, "a": 2}``, which JSON
parsers read as ``{"a": 2}``, silently. :class:`KeyState` follows the output with :mod:`constrain.jsonscan` (the grammar
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

Where the schema's values are checked too, the value checks' scanner
(:class:`~constrain.match.values.ValueState`) keeps each open object's keys as written and refuses a
repeated one itself: one scan a token for both. A :class:`KeyState` is then made from it only to mask
(:meth:`~constrain.match.values.ValueState.key_state`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.schema import subschemas
from constrain.jsonscan import IN_KEY, IN_STRING, KEY_ESCAPE, START, JsonScan, JsonSyntaxError
from constrain.match.bitmask import allowed_among, clear_bits, count_allowed
from constrain.match.vocab import KeyVocab, key_vocab

__all__ = ["KeyState", "may_repeat_keys"]

Frame = frozenset[bytes] | None
"""An open container: an object's keys so far (as written, without quotes), or None for an array."""


class _Duplicate(Exception):
    """A key completed a second time in its object."""


class _Keys:
    """The scan's events, kept as each open container's keys (mutable: one per advance)."""

    __slots__ = ("stack",)

    def __init__(self, stack: tuple[Frame, ...]) -> None:
        self.stack = stack

    def open(self, is_object: bool) -> None:
        self.stack = (*self.stack, frozenset() if is_object else None)

    def close(self) -> None:
        self.stack = self.stack[:-1]

    def key(self, text: bytes) -> None:
        keys, key = self.stack[-1] or frozenset(), text[1:-1]
        if key in keys:
            raise _Duplicate
        self.stack = (*self.stack[:-1], keys | {key})

    def value(self, text: bytes) -> None:
        pass


_UNKNOWN = object()

AFTER_KEPT = 8
"""Tokens whose next state a :class:`KeyState` keeps (the drawn token's check and its acceptance scan once)."""


@dataclass(frozen=True, slots=True)
class KeyState:
    """Where the output stands in its JSON value, and the keys of every open object. Immutable."""

    vocab: KeyVocab
    scan: JsonScan = START
    stack: tuple[Frame, ...] = ()  # per open container, as ``scan.open``
    # the states after the last few tokens asked about: a drawn token is asked about, then accepted
    _after: dict[int, KeyState | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def initial(cls, info: TokenizerInfo) -> KeyState:
        return cls(key_vocab(info))

    def advance(self, token_id: int) -> KeyState | None:
        """The state after ``token_id``; None when it would complete a key its object already has.
        Memoized per state (:data:`AFTER_KEPT` tokens)."""
        after = self._after
        found = after.get(token_id, _UNKNOWN)
        if found is not _UNKNOWN:
            return found  # type: ignore[return-value]
        found = self.advance_bytes(self.vocab.texts[token_id])
        if len(after) >= AFTER_KEPT:
            after.clear()
        after[token_id] = found
        return found

    def advance_bytes(self, data: bytes) -> KeyState | None:
        """The state after ``data``; None when it would complete a key its object already has (or is not
        JSON: the grammar refuses it too)."""
        scan = self.scan
        if scan.extends(data):  # a string value's text is not kept; a key's grows
            return self if scan.mode == IN_STRING else KeyState(self.vocab, scan.extended(data), self.stack)
        keys = _Keys(self.stack)
        try:
            scan = self.scan.feed(data, keys, texts=False)  # keys only: a string value costs nothing per token
        except (_Duplicate, JsonSyntaxError):
            return None
        if scan is self.scan and keys.stack is self.stack:
            return self
        return KeyState(self.vocab, scan, keys.stack)

    def most_forbidden(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
    ) -> int:
        """An upper bound on how many tokens :meth:`forbid_duplicates` would clear from ``row``, found
        without scanning a token outside keys."""
        if not any(frame for frame in self.stack):
            return 0
        if self.scan.mode in (IN_KEY, KEY_ESCAPE):
            return count_allowed(row)
        return len(allowed_among(row, self.vocab.multi_quote[self.scan.mode == IN_STRING]))

    def forbid_duplicates(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
    ) -> None:
        """Clear from ``row`` every token that would complete a key its object already has."""
        if not any(frame for frame in self.stack):
            return  # no object holds a key yet (a token completing two equal keys at once is not a word)
        vocab, mode = self.vocab, self.scan.mode
        banned: list[int] = []
        if mode in (IN_KEY, KEY_ESCAPE):
            written_so_far = self.scan.text[1:]
            for written in self.stack[-1] or ():
                if written.startswith(written_so_far):
                    prefix = written[len(written_so_far) :] + b'"'
                    lo = bisect.bisect_left(vocab.sorted_texts, prefix)
                    hi = bisect.bisect_left(vocab.sorted_texts, prefix + b"\xff", lo)
                    banned += vocab.sorted_ids[lo:hi]
        # from inside a string value, a token must close it, then open and close a key: three quotes
        ids = vocab.multi_quote[mode == IN_STRING]  # [m] int64
        allowed = allowed_among(row, ids)  # [k] int64
        banned += [token for token in allowed.tolist() if self.advance(token) is None]
        clear_bits(row, banned)


def may_repeat_keys(schema: Any, any_order: bool) -> bool:
    """Whether a grammar for the prepared ``schema`` may admit an object with a key twice: some object
    is open (undeclared keys allowed), has ``patternProperties`` (a key matching one may come again), or
    its keys may come in any order (an any-order grammar of one declared key admits it twice:
    ``{"price": 6, "price": 3.75}``)."""
    if not isinstance(schema, dict):
        return schema is True
    types = schema.get("type")
    untyped = types is None and not any(k in schema for k in ("$ref", "anyOf", "allOf", "oneOf", "enum", "const"))
    if types == "object" or (isinstance(types, list) and "object" in types) or untyped:
        repeatable = schema.get("patternProperties") or (any_order and schema.get("properties"))
        if schema.get("additionalProperties") is not False or repeatable:
            return True
    return any(may_repeat_keys(sub, any_order) for sub in subschemas(schema) if sub is not False)
