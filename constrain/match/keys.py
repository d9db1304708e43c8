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

Where an object's keys are known to be a finite set (``additionalProperties: false``, or closed
mode: :meth:`~constrain.match.checks.ValueChecks.key_names`), the guard also refuses a key that can no
longer become one its object lacks: its text so far is a prefix of none of them, or a ``,`` leaves no
key to write. Without that, keys in any order dead-end: after ``{"a": 1, "`` where only ``"a"`` is
declared, the grammar allows ``a`` and then only the ``"`` that repeats it. Those names come from the
schema's locations, which only the value checks' scanner follows; its :meth:`ValueState.key_state
<constrain.match.values.ValueState.key_state>` hands them to the :class:`KeyState` that masks.

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
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.schema import subschemas
from constrain.jsonscan import (
    FIRST_KEY,
    IN_KEY,
    IN_STRING,
    KEY,
    KEY_ESCAPE,
    START,
    STRING_ESCAPE,
    JsonScan,
    JsonSyntaxError,
)
from constrain.match.bitmask import allowed_among, clear_bits, count_allowed, set_bits
from constrain.match.vocab import KEPT_KEYS, KeyVocab, key_vocab

__all__ = ["KeyState", "Names", "key_stalls", "may_repeat_keys", "written_forms"]

Frame = frozenset[bytes] | None
"""An open container: an object's keys so far (as written, without quotes), or None for an array."""

Names = frozenset[bytes] | None
"""The keys an object may hold, as written (without quotes; :func:`written_forms`), or None: not a
finite set known here."""

_KEY_WRITING = frozenset({KEY, IN_KEY, KEY_ESCAPE})
"""Where a key is being written, or must be next (after an object's ``,``: no ``}`` may follow)."""


def written_forms(names: Iterable[str]) -> frozenset[bytes]:
    """``names`` as a JSON text may write them, without quotes: with non-ASCII characters escaped
    (``\\u00e9``) and as UTF-8."""
    forms = set()
    for name in names:
        forms.add(json.dumps(name)[1:-1].encode())
        forms.add(json.dumps(name, ensure_ascii=False)[1:-1].encode())
    return frozenset(forms)


def key_stalls(scan: JsonScan, written: frozenset[bytes], names: Names) -> bool:
    """Whether the key ``scan`` is writing (its text after the opening quote so far) can no longer become
    one of ``names`` its object lacks (``written``); False where ``names`` is None or no key is being
    written. After a ``,`` (mode ``KEY``) that is: no name is left."""
    if names is None or scan.mode not in _KEY_WRITING:
        return False
    text = b"" if scan.mode == KEY else scan.text[1:]
    return not any(name.startswith(text) and name not in written for name in names)


class _Duplicate(Exception):
    """A key completed a second time in its object."""


class _Keys:
    """The scan's events, kept as each open container's keys (mutable: one per advance). ``names``: per
    open container, the keys it may hold (empty: none known; a container opened here gets None)."""

    __slots__ = ("names", "stack")

    def __init__(self, stack: tuple[Frame, ...], names: tuple[Names, ...]) -> None:
        self.stack, self.names = stack, names

    def open(self, is_object: bool) -> None:
        self.stack = (*self.stack, frozenset() if is_object else None)
        if self.names:
            self.names = (*self.names, None)

    def close(self) -> None:
        self.stack = self.stack[:-1]
        self.names = self.names[:-1]

    def key(self, text: bytes) -> None:
        keys, key = self.stack[-1] or frozenset(), text[1:-1]
        names = self.names[-1] if self.names else None
        if key in keys or (names is not None and key not in names):
            raise _Duplicate
        self.stack = (*self.stack[:-1], keys | {key})

    def value(self, text: bytes) -> None:
        pass


_UNKNOWN = object()

AFTER_KEPT = 8
"""Tokens whose next state a :class:`KeyState` keeps (the drawn token's check and its acceptance scan once)."""


@dataclass(slots=True)
class KeyState:
    """Where the output stands in its JSON value, and the keys of every open object. Never changed once
    made (not frozen: see :class:`~constrain.match.values.ValueState`)."""

    vocab: KeyVocab
    scan: JsonScan = START
    stack: tuple[Frame, ...] = ()  # per open container, as ``scan.open``
    # per open container, the keys it may hold (``key_stalls``); () where none are known (the state of a
    # ValueState's that knows them: ``ValueState.key_state``)
    names: tuple[Names, ...] = ()
    # the states after the last few tokens asked about: a drawn token is asked about, then accepted
    _after: dict[int, KeyState | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def initial(cls, info: TokenizerInfo) -> KeyState:
        return cls(key_vocab(info))

    def advance(self, token_id: int) -> KeyState | None:
        """The state after ``token_id``; None when it would complete a key its object already has, or
        one it may not hold, or leave a key that can no longer become one (:func:`key_stalls`). Memoized
        per state (:data:`AFTER_KEPT` tokens)."""
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
        """The state after ``data``; None as :meth:`advance` says (or where ``data`` is not JSON: the
        grammar refuses it too)."""
        scan = self.scan
        if scan.extends(data):  # a string value's text is not kept; a key's grows
            if scan.mode == IN_STRING:
                return self
            after = KeyState(self.vocab, scan.extended(data), self.stack, self.names)
            return None if after.stalls() else after
        keys = _Keys(self.stack, self.names)
        try:
            scan = self.scan.feed(data, keys, texts=False)  # keys only: a string value costs nothing per token
        except (_Duplicate, JsonSyntaxError):
            return None
        if scan is self.scan and keys.stack is self.stack:
            return self
        after = KeyState(self.vocab, scan, keys.stack, keys.names)
        return None if after.stalls() else after

    def stalls(self) -> bool:
        """Whether the key being written can no longer become one its object lacks (:func:`key_stalls`)."""
        return bool(self.names) and key_stalls(self.scan, self.stack[-1] or frozenset(), self.names[-1])

    def most_forbidden(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
    ) -> int:
        """An upper bound on how many tokens :meth:`forbid_duplicates` would clear from ``row``, found
        without scanning a token outside keys."""
        known = any(names is not None for names in self.names)
        if not known and not any(frame for frame in self.stack):
            return 0
        mode, top = self.scan.mode, self.names[-1] if self.names else None
        if mode in (IN_KEY, KEY_ESCAPE) or (top is not None and mode in (KEY, FIRST_KEY)):
            return count_allowed(row)
        return sum(len(allowed_among(row, ids)) for ids in self._scanned(known))

    def forbid_duplicates(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
    ) -> None:
        """Clear from ``row`` every token that :meth:`advance` refuses: those that would complete a key its
        object already has, and (where the object's keys are known) one it may not hold, or leave a key
        that can no longer become one."""
        known = any(names is not None for names in self.names)
        if not known and not any(frame for frame in self.stack):
            return  # no object holds a key yet (a token completing two equal keys at once is not a word)
        mode, top = self.scan.mode, self.names[-1] if self.names else None
        banned: list[int] = []
        if top is not None and mode in (IN_KEY, KEY_ESCAPE, KEY, FIRST_KEY):
            self._keep_known_keys(row.numpy(), top)
        elif mode in (IN_KEY, KEY_ESCAPE):
            banned += self._completing_written(self.scan.text[1:])
        allowed = [allowed_among(row, ids) for ids in self._scanned(known)]
        candidates = dict.fromkeys(np.concatenate(allowed).tolist())  # each once (np.unique imports numpy.ma: 14 ms)
        banned += [token for token in candidates if self.advance(token) is None]
        clear_bits(row, banned)

    def _scanned(self, known: bool) -> list[np.ndarray]:
        """The tables of tokens :meth:`forbid_duplicates` scans one by one: from inside a string value a
        token must close it, then open and close a key (three quotes); elsewhere two. Where an open
        object's keys are known, also those that may start a next key after a ``,`` (with a ``"`` first from
        inside a string): those that begin a key after it where every such object has a key left, and only
        those holding a ``}`` or ``]`` where the innermost container's keys are not known. ``known``: whether
        any open object's keys are."""
        mode, vocab = self.scan.mode, self.vocab
        in_string = mode in (IN_STRING, STRING_ESCAPE)
        tables = [vocab.multi_quote[mode == IN_STRING]]
        if not known or mode in (IN_KEY, KEY_ESCAPE):
            return tables
        left = all(
            names is None or any(name not in (written or ()) for name in names)
            for names, written in zip(self.names, self.stack, strict=True)
        )  # a bare "," stalls nowhere
        # only a key begun after it may stall, where a key is left; where the innermost object's keys are not
        # known (or it is an array), only where the token leaves it first
        return [*tables, vocab.after_comma[in_string, left, self.names[-1] is None]]

    def _completing_written(self, so_far: bytes) -> list[int]:
        """Inside a key written so far as ``so_far``: the tokens that complete one its object has (a prefix
        search in the sorted vocabulary per such key)."""
        texts, ids, banned = self.vocab.sorted_texts, self.vocab.sorted_ids, list[int]()
        for key in self.stack[-1] or ():
            if key.startswith(so_far):
                banned += _starting_with(texts, ids, key[len(so_far) :] + b'"')
        return banned

    def _keep_known_keys(
        self,
        # [ceil(V / 32)] int32: a filled mask row's words; updated in place
        words: np.ndarray,
        names: frozenset[bytes],
    ) -> None:
        """Where a key is being written, or may start, in an object whose keys are known: clear every token
        that writes a key but neither continues one of ``names`` it lacks nor completes it (prefix searches
        in the sorted vocabulary: inside a key, every token writes it; where one may start, the tokens with
        a ``"`` first, after any whitespace). After a ``,`` with no key left, nothing may follow."""
        vocab, mode = self.vocab, self.scan.mode
        inside = mode in (IN_KEY, KEY_ESCAPE)
        so_far = self.scan.text[1:] if inside else b""
        left = [name for name in names - (self.stack[-1] or frozenset()) if name.startswith(so_far)]
        if mode == KEY and not left:
            words[:] = 0
            return
        key = (inside, so_far, frozenset(left))
        kept = vocab.kept.get(key)  # [k] int64
        if kept is None:
            kept = np.array(self._writing(inside, so_far, left), dtype=np.int64)
            if len(vocab.kept) >= KEPT_KEYS:
                vocab.kept.clear()
            vocab.kept[key] = kept
        keep = np.zeros_like(words) if inside else ~vocab.key_start[: len(words)]  # [ceil(V / 32)] int32
        set_bits(keep, kept)
        words &= keep

    def _writing(self, inside: bool, so_far: bytes, left: list[bytes]) -> list[int]:
        """The tokens that go on writing one of the keys ``left`` (each starting with ``so_far``) or complete
        it: inside the key, those whose text does; where a key may start, those whose text from its first
        ``"`` on does (prefix searches in the sorted vocabulary)."""
        vocab = self.vocab
        if inside:
            texts, ids, opening = vocab.sorted_texts, vocab.sorted_ids, b""
        else:
            texts, ids, opening = vocab.key_sorted_texts, vocab.key_sorted_ids, b'"'
        kept: list[int] = []
        for name in left:
            rest = opening + name[len(so_far) :]
            for end in range(1, len(rest) + 1):  # the tokens that write a part of what is left
                lo = bisect.bisect_left(texts, rest[:end])
                kept += ids[lo : bisect.bisect_right(texts, rest[:end], lo)]
            kept += _starting_with(texts, ids, rest + b'"')  # and those that complete it, and go on
        return kept


def _starting_with(texts: Sequence[bytes], ids: Sequence[int], prefix: bytes) -> Sequence[int]:
    """The ids of the sorted ``texts`` that start with ``prefix`` (a binary search each way)."""
    lo = bisect.bisect_left(texts, prefix)
    return ids[lo : bisect.bisect_left(texts, prefix + b"\xff", lo)]


def may_repeat_keys(schema: Any, any_order: bool, tracked: frozenset[frozenset[str]] = frozenset()) -> bool:
    """Whether a grammar for the prepared ``schema`` may admit an object with a key twice: some object
    is open (undeclared keys allowed), has ``patternProperties`` (a key matching one may come again), or
    its keys may come in any order (an any-order grammar of one declared key admits it twice:
    ``{"price": 6, "price": 3.75}``), but where the grammar writes each key once (its declared keys
    ``tracked``: :func:`~constrain.backends.xgrammar.keys_in_any_order`)."""
    if not isinstance(schema, dict):
        return schema is True
    types = schema.get("type")
    untyped = types is None and not any(k in schema for k in ("$ref", "anyOf", "allOf", "oneOf", "enum", "const"))
    if types == "object" or (isinstance(types, list) and "object" in types) or untyped:
        declared = schema.get("properties")
        ordered = not any_order or (isinstance(declared, dict) and frozenset(declared) in tracked)
        repeatable = schema.get("patternProperties") or (not ordered and declared)
        if schema.get("additionalProperties") is not False or repeatable:
            return True
    return any(may_repeat_keys(sub, any_order, tracked) for sub in subschemas(schema) if sub is not False)
