"""Keywords beyond a grammar, enforced while generating: each value is checked as it completes.

:mod:`constrain.constraints.schema` leaves the keywords a grammar cannot say out of the grammar (a
superset) and marks them; here the :class:`~constrain.match.matcher.Matcher` enforces them at *value
boundaries*: the token that would complete a value (a string's closing quote, a number's end, an
item's ``,`` or ``]``, an object's ``}``, EOS after a root scalar) is masked out when the completed
value cannot be valid, and the model writes another value instead. :class:`ValueState` follows the
output with :mod:`constrain.jsonscan` as JSON values being built, and asks the schema's checks (:class:`Checks`:
:class:`constrain.match.checks.ValueChecks`, which says how a value is judged) about each value it
sees complete.

A grammar's text may also embed JSON values (tool calls' arguments): :mod:`constrain.match.embedded`
runs a :class:`ValueState` on each.

When every token the grammar allows would complete an invalid value (no valid continuation), the
mask is left as the grammar filled it and the matcher records a *dead end*: the result's violations
then come from post-validation, and the dead end says why they could not be avoided.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded
from constrain.jsonscan import (
    AFTER,
    COLON,
    IN_KEY,
    IN_STRING,
    KEY_ESCAPE,
    OUTSIDE,
    SCALAR,
    START,
    STRING_ESCAPE,
    VALUE,
    VALUE_MODES,
    JsonScan,
    JsonSyntaxError,
)
from constrain.match.bitmask import allowed_among, allowed_ids, clear_bits, count_allowed, is_allowed
from constrain.match.keys import AFTER_KEPT, KeyState, Names, key_stalls
from constrain.match.lengths import written_length
from constrain.match.vocab import KeyVocab, ValueVocab, key_vocab, value_vocab

__all__ = [
    "DEAD_END",
    "HEADED_FOR_DEAD_END",
    "LOOKAHEAD_TOKENS",
    "VIABLE",
    "Checks",
    "Dnf",
    "ValueState",
]

Dnf = frozenset[frozenset[int]]
"""A location: alternatives (any may hold), each a set of subschemas (all must hold), by index."""

VIABLE, HEADED_FOR_DEAD_END, DEAD_END = 2, 1, 0
"""What :meth:`ValueState.forbid_violations` found."""

LOOKAHEAD_TOKENS = 32
"""Where at most this many tokens are allowed inside a checked value, the matcher looks ahead past each
(see ``forbid_violations``)."""


class Checks(Protocol):
    """What the scanner asks of a schema's checks (:class:`constrain.match.checks.ValueChecks`, which
    makes the scanner's initial state: it sits above this module)."""

    @property
    def root_location(self) -> Dnf: ...

    def child(self, location: Dnf, key: str | int) -> Dnf: ...

    def must_check(self, location: Dnf) -> bool: ...

    def has_own(self, location: Dnf) -> bool: ...

    def grows_checked(self, location: Dnf) -> bool: ...

    def reads_members(self, location: Dnf) -> bool: ...

    def accepts(self, location: Dnf, value: Any, *, prefix: bool = False) -> bool: ...

    def needs(self, location: Dnf) -> bool: ...

    def number_viable(self, location: Dnf, text: bytes) -> bool: ...

    def admits(self, location: Dnf, kind: str) -> bool: ...

    def number_checked(self, location: Dnf) -> bool: ...

    def string_bound(self, location: Dnf) -> int | None: ...

    def key_names(self, location: Dnf) -> Names: ...


# -- the scanner ------------------------------------------------------------------------------
_NUMBER_START = frozenset(bytes((c,)) for c in b"-0123456789")
_SCALAR_KINDS = {b"t": "boolean", b"f": "boolean", b"n": "null"}
"""The JSON type of a scalar by its first byte (else a number)."""
_FIRST_KINDS = {
    b'"': "string", b"t": "boolean", b"f": "boolean", b"n": "null", b"[": "array", b"{": "object",
    **{bytes((c,)): "number" for c in b"-0123456789"},
}  # fmt: skip
"""The JSON type of a value by its first byte."""
_BEGUN = frozenset({IN_STRING, STRING_ESCAPE, SCALAR})
"""The scanner's modes inside a string or scalar value: its type is known from its start."""


@dataclass(slots=True)
class _Frame:
    """An open container: where it stands, and what it holds so far. Never changed once made (not frozen:
    one is made per value completed, see :class:`ValueState`)."""

    location: Dnf
    is_object: bool
    items: tuple[Any, ...] = ()  # arrays: the completed items; objects: (key, value) pairs
    key: str | None = None  # objects: the key whose value is being written
    watched: bool = False  # whether a check reads its items, or those of a container around it
    # whether a check reads its items' values (else, at most an object's keys: each member is kept as None)
    reads: bool = False
    written: frozenset[bytes] = frozenset()  # objects under the key guard: its keys so far, as written
    names: Names = None  # objects under the key guard: the keys it may hold, as written (None: not known)

    def value(self) -> Any:
        """The container as a JSON value: its completed items or members."""
        return dict(self.items) if self.is_object else list(self.items)


class _Violation(Exception):
    """A completed value that cannot be valid where it stands."""


class _Values:
    """The scan's events, as values built and checked in their containers (mutable: one per advance).
    ``strict=False``: nothing is checked, every value is taken as it is. ``unique``: a key completed a
    second time in its object (as written) is refused, strict or not (the key guard, see
    :mod:`constrain.match.keys`), and so is one its object may not hold where the keys it may hold are
    known: but in an object opened by the text this scans (``fresh``: the depth of the first opened),
    as the :class:`~constrain.match.keys.KeyState` that masks for the guard does."""

    __slots__ = ("checks", "fresh", "stack", "strict", "unique")

    def __init__(self, checks: Checks, stack: tuple[_Frame, ...], strict: bool, unique: bool = False) -> None:
        self.checks, self.stack, self.strict, self.unique = checks, stack, strict, unique
        self.fresh = len(stack)

    def open(self, is_object: bool) -> None:
        checks, stack = self.checks, self.stack
        location = _location(checks, stack)
        if self.strict and checks.needs(location) and not checks.admits(location, "object" if is_object else "array"):
            raise _Violation  # no container of this kind can be valid here
        parent = stack[-1] if stack else None
        checked = checks.must_check(location) or checks.grows_checked(location)
        watched = checked or (parent is not None and parent.watched)
        reads = (checked and (not is_object or checks.reads_members(location))) or (parent is not None and parent.reads)
        names = checks.key_names(location) if self.unique and is_object else None
        self.fresh = min(self.fresh, len(stack))
        self.stack = (*stack, _Frame(location, is_object, watched=watched, reads=reads, names=names))

    def known_names(self) -> Names:
        """The keys the innermost open object may hold, as the guard reads them (None: not known, or
        opened by the text scanned)."""
        return self.stack[-1].names if self.stack and len(self.stack) <= self.fresh else None

    def close(self) -> None:
        top = self.stack[-1]
        self.stack = self.stack[:-1]
        self._complete(top.value())

    def key(self, text: bytes) -> None:
        """A completed key: checked (``propertyNames``, ``maxProperties``) where its object is checked as
        it grows."""
        stack, checks, key = self.stack, self.checks, _parse(text)
        top, written = stack[-1], stack[-1].written
        if self.unique:
            names = self.known_names()
            if text[1:-1] in written or (names is not None and text[1:-1] not in names):
                raise _Violation
            written = written | {text[1:-1]}
        if self.strict and isinstance(key, str) and checks.grows_checked(top.location):
            if not checks.accepts(top.location, {**top.value(), key: None}, prefix=True):
                raise _Violation
        self.stack = (
            *stack[:-1],
            _Frame(top.location, top.is_object, top.items, key, top.watched, top.reads, written, top.names),
        )

    def value(self, text: bytes) -> None:
        self._complete(_parse(text))

    def _complete(self, value: Any) -> None:
        """Record a completed value: check it, add it to its container, check the container."""
        checks, stack = self.checks, self.stack
        if self.strict:
            location = _location(checks, stack)
            if checks.must_check(location) and not checks.accepts(location, value):
                raise _Violation
        if not stack:
            return
        top = stack[-1]
        kept = value if top.reads else None
        item = (top.key, kept) if top.is_object else kept
        grown = _Frame(
            top.location, top.is_object, (*top.items, item), None, top.watched, top.reads, top.written, top.names
        )
        if (
            self.strict
            and checks.grows_checked(top.location)
            and not checks.accepts(top.location, grown.value(), prefix=True)
        ):
            raise _Violation
        self.stack = (*stack[:-1], grown)


def _location(checks: Checks, stack: tuple[_Frame, ...]) -> Dnf:
    """The location of the value being written under ``stack`` (not while a key is)."""
    if not stack:
        return checks.root_location
    top = stack[-1]
    return checks.child(top.location, top.key if top.key is not None else len(top.items))


@dataclass(slots=True)
class ValueState:
    """The output as JSON values being built, and where each stands in the schema. Never changed once
    made (not a frozen dataclass: one is made per token and probe, and a frozen one costs three times
    as much to make)."""

    checks: Checks
    vocab: ValueVocab
    scan: JsonScan = START  # its text: as written, but inside a string nothing checks (see ``advance_value``)
    stack: tuple[_Frame, ...] = ()  # per open container, as ``scan.open``
    # one entry, "candidates" (a function of the stack and the scan's mode): shared by the states after this
    # one while they keep both, so it needs no bound
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the strict states after the last few tokens asked about: a drawn token is checked, then accepted
    _after: dict[int, ValueState | None] = field(default_factory=dict, compare=False, repr=False)
    # the key guard's vocabulary, where this scan is the key guard too (one scan a token for both): keys
    # completed twice in an object are refused, and :meth:`key_state` masks them out
    key_vocab: KeyVocab | None = None

    @classmethod
    def initial(cls, checks: Checks, info: TokenizerInfo, *, unique_keys: bool = False) -> ValueState:
        """The state before any output, for ``checks`` and a tokenizer (``unique_keys``: the key guard's
        too)."""
        return cls(checks, value_vocab(info), key_vocab=key_vocab(info) if unique_keys else None)

    def key_state(self) -> KeyState:
        """The key guard's state where this scan is the key guard too (``key_vocab``): the keys as written
        of every open object, to mask (:meth:`KeyState.forbid_duplicates`)."""
        assert self.key_vocab is not None, "a ValueState made without unique_keys is no key guard"
        stack = tuple(frame.written if frame.is_object else None for frame in self.stack)
        return KeyState(self.key_vocab, self.scan, stack, tuple(frame.names for frame in self.stack))

    # -- advancing --------------------------------------------------------------------------
    def advance(self, token_id: int, *, strict: bool = True) -> ValueState | None:
        """The state after ``token_id``; None when it would complete a value that cannot be valid
        (``strict=False``: values are taken as they are, None only for text that is not JSON).
        Strict states are memoized per state (:data:`~constrain.match.keys.AFTER_KEPT` tokens)."""
        if not strict:
            return self.advance_bytes(self.vocab.texts[token_id], strict=False)
        after = self._after
        if token_id in after:
            return after[token_id]
        found = self.advance_bytes(self.vocab.texts[token_id])
        if len(after) >= AFTER_KEPT:
            after.clear()
        after[token_id] = found
        return found

    def advance_bytes(self, data: bytes, *, strict: bool = True) -> ValueState | None:
        """The state after ``data``; None when it would complete a value that cannot be valid, or when
        ``data`` cannot continue the JSON text (the grammar refuses it too)."""
        return self.advance_value(data, strict=strict, stop=False)[0]

    def advance_value(self, data: bytes, *, strict: bool = True, stop: bool = True) -> tuple[ValueState | None, int]:
        """As :meth:`advance_bytes`, stopping where the top-level value completes (``stop``); also returns
        how many bytes of ``data`` were read (see :meth:`~constrain.jsonscan.JsonScan.feed_value`).

        A run inside a string whose text nothing reads (no check of the string, and no container open
        around it that checks its values: ``_candidates`` finds none, or :meth:`_unread`) returns this very
        state: the text is not kept (``scan.text`` then lacks the run), and a long string costs nothing
        per token. Any other run inside a string or key (no quote, no backslash) is appended to the scan's
        text without the scanner: nothing completes in it."""
        scan = self.scan
        mode = scan.mode
        if scan.extends(data):
            if mode == IN_STRING and (self._candidates()[0] is None or self._unread()):
                return self, len(data)
            after = self._after_scan(scan.extended(data), self.stack, self._memo)
            if mode == IN_STRING:
                return (None, 0) if strict and after._too_long() else (after, len(data))
            guarded = self.key_vocab is not None and bool(self.stack)  # (a key is written inside an object)
            return (None, 0) if guarded and after._stalls(self.stack[-1].names) else (after, len(data))
        values = _Values(self.checks, self.stack, strict, self.key_vocab is not None)
        try:
            scan, read = self.scan.feed_value(data, values) if stop else (self.scan.feed(data, values), len(data))
        except (_Violation, JsonSyntaxError):
            return None, 0
        if strict and scan.mode in _BEGUN and not self._may_begin(scan, values.stack):
            return None, 0  # a string or scalar begun where no value of its type can be valid
        if (
            strict
            and scan.mode == SCALAR
            and scan.text[:1] in _NUMBER_START
            and not self.checks.number_viable(_location(self.checks, values.stack), scan.text)
        ):
            return None, 0  # a number no digit can make valid (multipleOf): refused as it is written
        shared = values.stack is self.stack and scan.mode == self.scan.mode  # the same candidates: share them
        after = self._after_scan(scan, values.stack, self._memo if shared else {})
        if (strict and after._too_long()) or (self.key_vocab is not None and after._stalls(values.known_names())):
            return None, 0
        return after, read

    def _refused_kinds(self) -> frozenset[bytes]:
        """At a value's start: the first bytes of the values (a ``"``, a digit, ``t``...) whose JSON type the
        location admits in no alternative (:meth:`Checks.admits`); empty where the grammar is exact there."""
        memo = self._memo  # (a function of the stack and the mode, as the candidates are)
        if "refused" not in memo:
            checks = self.checks
            location = _location(checks, self.stack)
            memo["refused"] = (
                frozenset(first for first, kind in _FIRST_KINDS.items() if not checks.admits(location, kind))
                if checks.needs(location)
                else frozenset()
            )
        return memo["refused"]  # type: ignore[no-any-return]

    def _may_begin(self, scan: JsonScan, stack: tuple[_Frame, ...]) -> bool:
        """Whether the string or scalar ``scan`` is writing (under ``stack``) has a type its location admits
        (:meth:`Checks.admits`; asked where the grammar is not exact there)."""
        checks = self.checks
        location = _location(checks, stack)
        if not checks.needs(location):
            return True
        first = scan.text[:1]
        kind = "string" if scan.mode != SCALAR else _SCALAR_KINDS.get(first, "number")
        return checks.admits(location, kind)

    def _unread(self) -> bool:
        """Whether the text of the string value being written is read by no check: its location is not
        checked, and its container keeps no member's value (an object whose checks read keys alone, as
        ``required``: :meth:`Checks.reads_members`)."""
        memo = self._memo  # (a function of the stack and the mode, as the candidates are)
        if "unread" not in memo:
            top = self.stack[-1] if self.stack else None
            memo["unread"] = (
                top is not None and not top.reads and not self.checks.must_check(_location(self.checks, self.stack))
            )
        return memo["unread"]  # type: ignore[no-any-return]

    def _after_scan(self, scan: JsonScan, stack: tuple[_Frame, ...], memo: dict[str, Any]) -> ValueState:
        """A state of this one's checks and vocabularies, at ``scan`` with ``stack``, sharing ``memo``."""
        return ValueState(self.checks, self.vocab, scan, stack, memo, key_vocab=self.key_vocab)

    def _stalls(self, names: Names) -> bool:
        """Whether the key being written can no longer become one of ``names`` (those its object may hold,
        or None) that the object lacks (:func:`~constrain.match.keys.key_stalls`)."""
        return names is not None and key_stalls(self.scan, self.stack[-1].written, names)

    def _string_bound(self) -> int | None:
        """The checked ``maxLength`` of the string value being written (:meth:`Checks.string_bound`), or
        None: none, or no string value is being written."""
        if self.scan.mode != IN_STRING and self.scan.mode != STRING_ESCAPE:
            return None
        memo = self._memo  # (a function of the stack and the mode, as the candidates are)
        if "bound" not in memo:
            memo["bound"] = self.checks.string_bound(_location(self.checks, self.stack))
        return memo["bound"]  # type: ignore[no-any-return]

    def _too_long(self) -> bool:
        """Whether the string value being written holds more characters than its checked ``maxLength``
        already (:func:`~constrain.match.lengths.written_length`): no way of going on makes it valid."""
        bound = self._string_bound()
        return bound is not None and written_length(self.scan.text[1:])[0] > bound

    def _overflowing(
        self,
        # [ceil(V' / 32)] int32: a mask row's words (read only)
        words: np.ndarray,
    ) -> np.ndarray | None:
        """``[ceil(V' / 32)]`` int32: the tokens ``words`` allows that would take the string value being
        written past its checked ``maxLength``; None where there are none: the vocabulary's lengths after the
        text's unsettled tail decide at once (:meth:`~constrain.match.vocab.ValueVocab.longer_than`)."""
        bound = self._string_bound()
        if bound is None:
            return None
        content = self.scan.text[1:]
        count, settled = written_length(content)
        tail = content[settled:]  # an escape or a character begun (counted already), or b""
        longer = self.vocab.longer_than(bound - count, tail)  # [ceil(V / 32)] int32, or None
        if longer is None:
            return None
        found = np.zeros_like(words)  # [ceil(V' / 32)] int32
        found[: len(longer)] = words[: len(longer)] & longer
        return found if found.any() else None

    def can_end(self) -> bool:
        """Whether the output may end here (a root scalar being written is completed first)."""
        try:
            self.scan.end(_Values(self.checks, self.stack, True))
        except _Violation:
            return False
        return True

    @property
    def finished(self) -> bool:
        """Whether a whole value was written (a root value complete; only whitespace may follow)."""
        return self.scan.finished

    def digest(self) -> int:
        """A hash of the open containers' contents where a check of the container itself depends on them
        (a keyword of its own beyond the grammar, or a check as it grows): the closing search tells states
        apart by it (two arrays at one grammar state, one holding ``"a"`` already). The scalar being
        written is left out: the search's masks show the values it can no longer complete."""
        checks = self.checks
        held = [
            (frame.items, frame.key) if checks.has_own(frame.location) or checks.grows_checked(frame.location) else None
            for frame in self.stack
        ]
        return hash(json.dumps(held, sort_keys=True, default=repr)) if any(held) else 0

    # -- masking ----------------------------------------------------------------------------
    def _candidates(self) -> tuple[np.ndarray | None, bool]:
        """``[k]`` int64: the token ids whose completion of a value may fail a check (a superset), or
        None when no value that can complete from here is checked; and whether the value being written
        is checked itself (its own location, or its container as it grows)."""
        if "candidates" not in self._memo:
            checks, stack, vocab, mode = self.checks, self.stack, self.vocab, self.scan.mode
            outer = bool(stack) and stack[-1].watched
            here = (mode in VALUE_MODES or mode in (IN_STRING, STRING_ESCAPE, SCALAR)) and (
                checks.must_check(_location(checks, stack)) or bool(stack and checks.grows_checked(stack[-1].location))
            )
            found: np.ndarray | None
            if not (outer or here):
                found = None
            elif mode in (IN_STRING, STRING_ESCAPE):  # completes the string; then only a closer goes on
                found = vocab.quote if here else vocab.quote_closer
            elif mode == SCALAR:  # completes the scalar at whitespace or a closer, or (a number)
                found = vocab.spaced if here else vocab.closer  # makes it one no digit can make valid
                if here and checks.number_checked(_location(checks, stack)):
                    found = vocab.spaced_numeric
            elif mode in (IN_KEY, KEY_ESCAPE):  # completes the key (checked as its object grows), then a value
                found = vocab.quote if stack and checks.grows_checked(stack[-1].location) else vocab.key_end
            else:
                found = vocab.value_end
                if mode in VALUE_MODES and self._refused_kinds():  # a value of some type refused where it begins
                    found = vocab.value_begin
                elif here and mode in VALUE_MODES and checks.number_checked(_location(checks, stack)):
                    found = vocab.value_end_numeric
            self._memo["candidates"] = found, here
        return self._memo["candidates"]  # type: ignore[no-any-return]

    def forbid_violations(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool] | None = None,
    ) -> int:
        """Clear from ``row`` every token that would complete a value that cannot be valid (EOS too,
        when the output cannot end here).

        ``viable(token)``: whether anything valid can follow ``token`` (the matcher looks ahead through
        the grammar). Where at most :data:`LOOKAHEAD_TOKENS` tokens are allowed, a token that is not
        viable is cleared too (``"g`` where only ``"green"`` can follow, and the array has it already),
        within a checked value only.
        Returns :data:`VIABLE`; or :data:`HEADED_FOR_DEAD_END` when only the look-ahead's tokens were
        left (those stay allowed); or :data:`DEAD_END`, leaving ``row`` as it was, when every allowed
        token completes a value that cannot be valid.
        """
        ids, here = self._candidates()
        if ids is None and self.scan.mode != SCALAR:
            return VIABLE
        words = row.numpy()  # [ceil(V / 32)] int32, a view: writes go to ``row``
        original = None
        overflowing = self._overflowing(words)  # [ceil(V / 32)] int32, or None
        if overflowing is not None:  # refused like the values below, before the look-ahead reads the row
            original = words.copy()
            words &= ~overflowing
        banned: list[int] = []
        if ids is not None:
            allowed = allowed_among(words, ids)  # [k] int64: candidates the grammar allows
            banned += self._violations(allowed.tolist())
        eos = [t for t in eos_token_ids if is_allowed(words, t)]
        if eos and not self.can_end():
            banned += eos
        ahead = self._dead_ends(words, set(banned), viable) if viable is not None and here else []
        if not banned and not ahead and (original is None or words.any()):
            return VIABLE
        saved = words.copy()
        clear_bits(words, banned + ahead)
        if words.any():
            return VIABLE
        words[:] = saved  # every token leads into a dead end: refuse only those that complete a bad value
        clear_bits(words, banned)
        if words.any():
            return HEADED_FOR_DEAD_END
        words[:] = saved if original is None else original
        return DEAD_END

    def leaves_viable(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool],
    ) -> bool:
        """Exactly whether :meth:`forbid_violations` returns :data:`VIABLE` on ``row``: some allowed token
        completes no bad value and (where the look-ahead applies) is viable. The look-ahead's own question
        one step on, answered without clearing anything and stopping at the first token that shows it
        (tokens no check can refuse first: they need no scan), where :meth:`forbid_violations` scans and
        probes every allowed token to know which to clear. Reads ``row`` only."""
        ids, here = self._candidates()
        if ids is None and self.scan.mode != SCALAR:
            return True
        overflowing = self._overflowing(row.numpy())  # [ceil(V / 32)] int32, or None
        if overflowing is not None:  # refused whatever else holds: the row without them decides
            row = torch.from_numpy(row.numpy() & ~overflowing)
            if not row.numpy().any():
                return False
        if (not here or count_allowed(row) > LOOKAHEAD_TOKENS) and self.leaves_some(row, eos_token_ids):
            return True  # no look-ahead here, and a token no check can refuse: counted, the row's ids not listed
        allowed = allowed_ids(row.numpy())  # [k] int64, padding ids too
        if not len(allowed):
            return True  # nothing to clear: forbid_violations calls it viable too
        refusable = np.zeros(len(allowed), dtype=bool)  # [k]: candidates, and EOS where the output cannot end
        if ids is not None and len(ids):
            at = ids.searchsorted(allowed).clip(max=len(ids) - 1)  # [k]
            refusable = ids[at] == allowed
        eos = [] if self.can_end() else list(eos_token_ids)  # EOS is refusable where the output cannot end
        if eos:
            refusable |= np.isin(allowed, eos)
        free, checked = allowed[~refusable].tolist(), allowed[refusable].tolist()
        looks = here and len(allowed) <= LOOKAHEAD_TOKENS
        texts = self.vocab.texts

        def ok(token: int) -> bool:  # what the look-ahead keeps (tokens without text: never probed)
            return not looks or token >= len(texts) or not texts[token] or viable(token)

        if any(ok(t) for t in free):
            return True
        eos_set = set(eos)
        banned = set(self._violations([t for t in checked if t not in eos_set])) | (eos_set & set(checked))
        if not looks:
            return len(banned) < len(checked) or not banned
        return any(ok(t) for t in checked if t not in banned)

    def leaves_some(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
    ) -> bool:
        """Whether :meth:`forbid_violations` surely leaves ``row`` some token: one allowed there that no
        check here can refuse (neither a candidate nor EOS). False says nothing. Reads ``row`` only."""
        ids, _ = self._candidates()
        words = row.numpy()  # [ceil(V / 32)] int32, a view
        if ids is None and self.scan.mode != SCALAR:
            return bool(words.any())
        refusable = (0 if ids is None else self.vocab.count_among(words, ids)) + sum(
            is_allowed(words, token) for token in eos_token_ids
        )
        overflowing = self._overflowing(words)  # [ceil(V / 32)] int32, or None (counted twice at worst)
        if overflowing is not None:
            refusable += count_allowed(overflowing)
        return count_allowed(words) > refusable

    def refuses(
        self,
        token: int,
        allowed: Callable[[], int],
        eos_token_ids: Collection[int],
        viable: Callable[[int], bool] | None = None,
    ) -> bool:
        """Whether :meth:`forbid_violations` clears ``token`` from this step's row, at a step where some
        token is left (not headed for a dead end): the check of one token, what a sampled token costs.
        ``allowed()``: how many tokens the row allows (asked only where look-ahead may apply), or any count
        on the same side of :data:`LOOKAHEAD_TOKENS`."""
        ids, here = self._candidates()
        if ids is None and self.scan.mode != SCALAR:
            return False
        bounded = self._string_bound() is not None  # any token may make the string too long
        if ids is not None and (bounded or self.vocab.holds(ids, token)) and self.advance(token) is None:
            return True  # (the state after it is kept: an accepted token is not scanned again)
        if token in eos_token_ids and not self.can_end():
            return True
        if viable is None or not here or token >= len(self.vocab.texts) or not self.vocab.texts[token]:
            return False
        return allowed() <= LOOKAHEAD_TOKENS and not viable(token)

    def _violations(self, tokens: list[int]) -> list[int]:
        """The ``tokens`` that would complete a value that cannot be valid.

        A token whose text completes nothing from here (:func:`_inert`: it opens a string, say) is
        never scanned. Inside a string or key, a token is taken in two parts: its text up to the
        closing quote (the value it completes: scanned once per distinct text, and not at all where
        nothing checks that value), then the rest, scanned only where it completes something.
        Outside strings only the structure counts: texts differing in whitespace runs alone are
        scanned once."""
        found, mode = [], self.scan.mode
        verdicts: dict[bytes, bool] = {}
        heads: dict[bytes, ValueState | None] = {}
        splits = mode in (IN_STRING, IN_KEY)
        inert_from = None  # the mode a token's rest is read in where it may be inert (see ``_inert``)
        if self.stack and splits and self._completes_unchecked():
            inert_from = COLON if mode == IN_KEY else AFTER
        elif self.stack and mode in OUTSIDE:
            inert_from = mode
        in_object = bool(self.stack) and self.stack[-1].is_object
        parts, texts = self.vocab.parts, self.vocab.texts
        refused = self._refused_kinds() if mode in VALUE_MODES else frozenset()
        for token in tokens:
            if refused and texts[token].lstrip(b" \t\n\r")[:1] in refused:
                found.append(token)  # a value of a type refused here begins: no scan needed
                continue
            escaped, head, rest = parts(token, splits)  # (an escape in a string's text: all of it is the head)
            if inert_from is not None and not escaped and _inert(rest, inert_from, in_object):
                continue
            bad = verdicts.get(head + rest)
            if bad is None:
                if head not in heads:
                    heads[head] = self.advance_bytes(head) if head else self
                after_head = heads[head]
                bad = after_head is None or (bool(rest) and after_head.advance_bytes(rest) is None)
                verdicts[head + rest] = bad
            if bad:
                found.append(token)
        return found

    def _completes_unchecked(self) -> bool:
        """Whether completing the string or key being written checks nothing (its location is not
        checked, nor its container as it grows): then its text cannot make a token bad."""
        top, checks = self.stack[-1], self.checks
        if checks.grows_checked(top.location):
            return False
        return self.scan.mode == IN_KEY or not checks.must_check(_location(checks, self.stack))

    def _dead_ends(
        self,
        # [ceil(V / 32)] int32: the row's words
        words: np.ndarray,
        banned: set[int],
        viable: Callable[[int], bool],
    ) -> list[int]:
        """The allowed tokens after which nothing valid can follow (none looked at when more than
        :data:`LOOKAHEAD_TOKENS` are allowed)."""
        if count_allowed(words) > LOOKAHEAD_TOKENS:
            return []
        allowed = allowed_ids(words)  # [k] int64, padding ids too
        texts = self.vocab.texts
        return [
            token
            for token in allowed.tolist()
            if token < len(texts) and token not in banned and texts[token] and not viable(token)
        ]


class _Completions:
    """Checks that refuse every value, key and number they are asked about: scanning a text with them
    from a state of a single open container fails exactly when the text completes something there."""

    root_location: Dnf = frozenset({frozenset()})

    def child(self, location: Dnf, key: str | int) -> Dnf:
        return location

    def must_check(self, location: Dnf) -> bool:
        return True

    def has_own(self, location: Dnf) -> bool:
        return False

    def grows_checked(self, location: Dnf) -> bool:
        return True

    def reads_members(self, location: Dnf) -> bool:
        return True

    def accepts(self, location: Dnf, value: Any, *, prefix: bool = False) -> bool:
        return False

    def needs(self, location: Dnf) -> bool:
        return False  # (a value begun completes nothing)

    def admits(self, location: Dnf, kind: str) -> bool:
        return True

    def number_viable(self, location: Dnf, text: bytes) -> bool:
        return False

    def number_checked(self, location: Dnf) -> bool:
        return True

    def string_bound(self, location: Dnf) -> int | None:
        return None

    def key_names(self, location: Dnf) -> Names:
        return None


@bounded("match.values.inert", maxsize=65536)
def _inert(text: bytes, mode: int, in_object: bool) -> bool:
    """Whether ``text``, read in scanner ``mode`` (one of :data:`~constrain.jsonscan.OUTSIDE`) inside an
    open object (``in_object``) or array, completes no value, no key, no container and writes no number:
    such a token cannot be refused by any check there. Text that is not JSON there is not inert."""
    assert mode in OUTSIDE, "only modes outside strings and scalars"
    key = "" if in_object and mode in (VALUE, COLON) else None  # a value's key is written already
    frame = _Frame(_Completions.root_location, in_object, (), key, watched=True, reads=True)
    scan = JsonScan(mode, b"{" if in_object else b"[")
    probe = ValueState(_Completions(), None, scan, (frame,))  # type: ignore[arg-type]  # no vocab: bytes only
    return probe.advance_bytes(text) is not None


@bounded("match.values.parse", maxsize=4096)
def _parse(text: bytes) -> Any:
    """The JSON value of a completed string, key or scalar (None if it is not one: not reached on text
    the grammar allowed). Memoized: a mask completes one value with each of its candidate tokens."""
    try:
        return json.loads(text.decode("utf-8", "replace"))
    except ValueError:
        return None
