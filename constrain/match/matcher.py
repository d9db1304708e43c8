"""Per-request grammar state, and the token bitmasks it fills.

The loop a matcher serves, per decode step:

1. ``fill_next_token_bitmask(bitmask, row)``: the allowed tokens (xgrammar's
   int32 layout, ``[batch, ceil(V / 32)]``); ``sampler`` applies it to the logits;
2. sample a token;
3. ``accept_token(token)``: advance (``False`` if the grammar rejects it: the
   state is unchanged, nothing raises);
4. ``forced_text()``: text the grammar allows as the only continuation (jump-forward).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

import torch

from constrain.backends.base import CompiledGrammar, GrammarState
from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.constraint import Constraint
from constrain.match.bitmask import allocate_token_bitmask, clear_bits, count_allowed, set_bits
from constrain.match.checks import CallChecks, ValueChecks
from constrain.match.embedded import CallValues
from constrain.match.keys import KeyState
from constrain.match.values import DEAD_END, LOOKAHEAD_TOKENS, VIABLE, ValueState
from constrain.match.vocab import token_texts

__all__ = ["Compiled", "Matcher", "fill_next_token_bitmasks"]

_State = TypeVar("_State")


@dataclass(slots=True)
class _Trail(Generic[_State]):
    """A scanner's state after each accepted token, newest first, as a linked list: a fork shares it
    (O(1)), an accepted token links one node, a rollback of n tokens walks n links back. Never changed
    once made (not frozen: one is made per accepted token, see :class:`~constrain.match.values.ValueState`)."""

    state: _State
    before: _Trail[_State] | None = None

    def back(self, steps: int) -> _Trail[_State]:
        trail = self
        for _ in range(steps):
            assert trail.before is not None, "rolled back past the initial state"
            trail = trail.before
        return trail

    def root(self) -> _Trail[_State]:
        trail = self
        while trail.before is not None:
            trail = trail.before
        return trail


class Compiled(Protocol):
    """What a matcher needs of a compiled constraint (:class:`constrain.compiler.compiler.CompiledConstraint`,
    which makes matchers: this layer sits below it)."""

    @property
    def constraint(self) -> Constraint: ...

    @property
    def tokenizer(self) -> TokenizerInfo: ...

    @property
    def grammar(self) -> CompiledGrammar: ...

    @property
    def unique_keys(self) -> bool: ...

    @property
    def value_checks(self) -> ValueChecks | CallChecks | None: ...

    @property
    def vocab_size(self) -> int: ...


class Matcher:
    """The grammar state of one request. Cheap to create and to fork (O(1)); not thread-safe (one
    request, one thread).

    EOS ids are allowed exactly when the grammar can end, and accepting one
    terminates the matcher. Where the grammar may admit a key twice (``compiled.unique_keys``),
    a :class:`~constrain.match.keys.KeyState` per accepted token masks out and refuses any token that
    would complete a key its object already has, or (where the object's keys are known) leave a key
    that can no longer become one it lacks (the value checks' scan is that guard where there are
    both: one scan a token). Where the schema has keywords beyond the grammar
    (``compiled.value_checks``), a :class:`~constrain.match.values.ValueState` per accepted token *refuses*
    any token that would complete a value that cannot be valid, or (where at most
    :data:`~constrain.match.values.LOOKAHEAD_TOKENS` tokens are allowed inside a checked value) after which
    nothing valid can follow. A refused token is masked out, unless every allowed token is refused:
    that step is a *dead end*, the mask stays the grammar's and the token is taken as it comes
    (:meth:`accept_token` records the step in ``dead_ends``). A fork made for a search
    (``fork(search=True)``) does not look ahead, and allows nothing at a dead end: the search backs out
    of it instead.

    The checks can run two ways, with the same verdicts:

    - *eagerly*: :meth:`fill_next_token_bitmask` (or :meth:`check_row` after a fill with ``checks=False``)
      clears every refused token from the row: the exact mask, for a host that samples from it with no
      way back (vLLM, a transformers logits processor, beam search);
    - *for the sampled token only*: fill with ``checks=False`` (the grammar's row), sample, and ask
      :meth:`allows` about the token drawn; on a refusal clear its bit and draw
      again (:mod:`constrain.decode.checked`). Where sampling has no top-k, top-p or min-p filter, this draws
      from exactly the distribution of the eager mask, at the cost of the drawn token's check alone.

    Filling a mask never changes the matcher (its look-ahead takes each probed token and rolls it back
    before it returns): whether a step is a dead end is a function of its state,
    worked out again by :meth:`accept_token` when the strict checks refuse a token. So a mask filled on
    a fork (a draft's slot) and one filled on the matcher itself agree, and so do the tokens they take.
    A terminated matcher (EOS accepted) allows EOS only; the grammar engines are not asked for its mask.
    """

    def __init__(self, compiled: Compiled, *, max_rollback_tokens: int = -1) -> None:
        self.compiled = compiled
        self._max_rollback = max_rollback_tokens
        self._grammar_state: GrammarState = compiled.grammar.new_state(max_rollback_tokens=max_rollback_tokens)
        self.num_accepted = 0
        self._vocab_size = compiled.vocab_size  # (asked per token: a property of a property)
        self._ended = False  # the engine's is_terminated(), kept (asked twice per token, a call each)
        # the value scanner after each accepted token (None: the grammar is exact); the key guard too
        # where the schema's values are checked (``_guarded``)
        checks = compiled.value_checks
        self._guarded = compiled.unique_keys and isinstance(checks, ValueChecks)
        values: ValueState | CallValues | None = None
        if isinstance(checks, ValueChecks):
            values = checks.initial_state(compiled.tokenizer, unique_keys=self._guarded)
        elif checks is not None:
            values = checks.initial_state(compiled.tokenizer)
        self._values: _Trail[ValueState | CallValues] | None = None if values is None else _Trail(values)
        # the key scanner likewise, where the value scanner is not it (None: no key guard)
        keys = KeyState.initial(compiled.tokenizer) if compiled.unique_keys and not self._guarded else None
        self._keys: _Trail[KeyState] | None = None if keys is None else _Trail(keys)
        self.dead_ends: list[int] = []  # the steps (accepted-token counts) whose token was taken at a dead end
        self._eos = compiled.tokenizer.eos_token_ids
        self._special = token_texts(compiled.tokenizer).special.difference(self._eos)  # never output text
        self.searching = False  # a search's fork: no look-ahead, and nothing allowed at a dead end (see the class)
        self._filled: torch.Tensor | None = None  # the last bitmask filled (checked to be on the CPU, int32)

    def fill_next_token_bitmask(
        self,
        # [B, ceil(V / 32)] int32, on the CPU; row ``index`` is overwritten
        bitmask: torch.Tensor,
        index: int = 0,
        *,
        checks: bool = True,
    ) -> bool:
        """Write the allowed next tokens into ``bitmask[index]``.

        ``checks=False`` leaves the key guard and the value checks out (the grammar's row): then
        :meth:`check_row` completes the row, or :meth:`allows` judges the sampled token (see the class).
        Returns whether the row restricts anything (False: every token is allowed and the sampler may
        skip it). Does not change the matcher state.
        """
        if bitmask is not self._filled:  # a tensor's device and dtype cost microseconds to read: once per tensor
            if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32:
                raise ValueError("fill the bitmask on the CPU as int32 (allocate_token_bitmask), then move it")
            self._filled = bitmask
        if self.is_terminated():
            _eos_only(bitmask[index], self._eos)
            return True
        restricts = bool(self._grammar_state.fill_next_token_bitmask(bitmask, index))
        checked = self._keys is not None or self._values is not None
        if checks and checked:
            self.check_row(bitmask[index])
        return restricts or checked

    def check_row(
        self,
        # [ceil(V / 32)] int32 on the CPU: a row filled with checks=False; updated in place
        row: torch.Tensor,
    ) -> int:
        """Clear from ``row`` every token the key guard or the value checks refuse (see the class). Returns
        :data:`~constrain.match.values.VIABLE`; :data:`~constrain.match.values.HEADED_FOR_DEAD_END` when
        every token left heads for a dead end of the value checks (those stay allowed); or
        :data:`~constrain.match.values.DEAD_END`, the row left as the key guard made it (emptied on a
        search's fork)."""
        if self.is_terminated():
            return VIABLE
        guard = self._key_guard()
        if guard is not None:
            guard.forbid_duplicates(row)
        return self._check_values(row)

    def _key_guard(self) -> KeyState | None:
        """The key guard's state now, to mask with (None: no key guard)."""
        if self._keys is not None:
            return self._keys.state
        if not self._guarded:
            return None
        assert self._values is not None
        return cast(ValueState, self._values.state).key_state()

    def _check_values(
        self,
        # [ceil(V / 32)] int32 on the CPU: a row the key guard ran on; updated in place
        row: torch.Tensor,
    ) -> int:
        """The value checks' part of :meth:`check_row`."""
        if self._values is None:
            return VIABLE
        status = self._values.state.forbid_violations(row, self._eos, None if self.searching else self._viable_next)
        if status == DEAD_END and self.searching:
            row.zero_()
        return status

    def any_allowed(
        self,
        # [B, ceil(V / 32)] int32, on the CPU; row 0 is overwritten (not with the mask)
        bitmask: torch.Tensor,
    ) -> bool:
        """Whether any token is allowed next: what :meth:`fill_next_token_bitmask` then ``bitmask[0].any()``
        says, without the value checks where a token they cannot refuse is allowed (a search's step).
        Does not change the matcher state."""
        if self.is_terminated() or self._values is None:
            self.fill_next_token_bitmask(bitmask)
            return bool(bitmask[0].any())
        self.fill_next_token_bitmask(bitmask, checks=False)
        row = bitmask[0]  # [ceil(V / 32)] int32
        guard = self._key_guard()
        if guard is not None:
            guard.forbid_duplicates(row)
        if self._values.state.leaves_some(row, self._eos):
            return True
        self._check_values(row)
        return bool(row.any())

    def allows(
        self,
        token_id: int,
        # [ceil(V / 32)] int32 on the CPU: this step's row as filled with checks=False (read only)
        row: torch.Tensor,
    ) -> bool:
        """Whether the key guard and the value checks let ``token_id`` stand here: exactly whether
        :meth:`check_row` keeps its bit, where it returns ``VIABLE`` (else every token is refused here, and
        the row :meth:`check_row` makes decides). Does not change the matcher state."""
        token_id = int(token_id)
        if self._ended or token_id >= self._vocab_size:
            return True
        keys, values = self._keys, self._values
        if keys is not None and token_id not in self._eos and keys.state.advance(token_id) is None:
            return False
        if values is None:
            return True
        state = values.state
        if self._guarded and token_id not in self._eos and state.advance(token_id) is None:
            if state.advance(token_id, strict=False) is None:  # (the strict state is kept for accept_token)
                return False  # it completes a key its object has: the value checks' scan is the key guard

        allowed = functools.partial(self._allowed_count, row)
        return not state.refuses(token_id, allowed, self._eos, None if self.searching else self._viable_next)

    def _allowed_count(
        self,
        # [ceil(V / 32)] int32 on the CPU: this step's row as filled with checks=False (read only)
        row: torch.Tensor,
    ) -> int:
        """How many tokens ``row`` allows once the key guard has run, exact up to LOOKAHEAD_TOKENS (past it,
        a bound on the same side: what :meth:`allows` asks where the look-ahead may apply)."""
        count = count_allowed(row)
        guard = None if count <= LOOKAHEAD_TOKENS else self._key_guard()
        if guard is None or count - guard.most_forbidden(row) > LOOKAHEAD_TOKENS:
            return count
        guarded = row.clone()  # [ceil(V / 32)] int32
        guard.forbid_duplicates(guarded)
        return count_allowed(guarded)

    def _viable_next(self, token_id: int) -> bool:
        """The look-ahead of a step: :meth:`_viable` at depth 2."""
        return self._viable(token_id, 2)

    def at_dead_end(self) -> bool:
        """Whether no token the grammar allows now can lead to a valid value (see the class). Fills a
        mask of its own; does not change the matcher state."""
        if self._values is None or self.is_terminated():
            return False
        row = allocate_token_bitmask(1, self.compiled.vocab_size)  # [1, ceil(V / 32)] int32
        self.fill_next_token_bitmask(row, 0, checks=False)
        return self.check_row(row[0]) == DEAD_END

    def _viable(self, token_id: int, depth: int) -> bool:
        """Whether something valid can follow ``token_id``: the text the grammar forces after it completes
        no value the schema forbids, and (``depth`` > 1) the next step is no dead end. A function of the
        state and the token: at most 1 + :data:`~constrain.match.values.LOOKAHEAD_TOKENS` probes (a token,
        a rollback and a mask each) per call at depth 2. Each probe takes the token on this matcher, as a
        search would (strict: no token taken at a dead end, nor one worked out), and rolls it back: the
        state is as it was when this returns, and no engine state is copied."""
        if token_id in self._eos:
            return True
        searching, self.searching = self.searching, True
        try:
            if not self.accept_token(token_id):
                return False
            try:
                return self._viable_after(depth)
            finally:
                self.rollback(1)
        finally:
            self.searching = searching

    def _viable_after(self, depth: int) -> bool:
        """:meth:`_viable` once its token is taken."""
        forced = str(self._grammar_state.find_jump_forward_string()).encode()
        assert self._values is not None
        state = self._values.state
        if forced and state.advance_bytes(forced) is None:
            return False
        if depth <= 1 or self._ended:
            return True
        # the next step from where the probe stands, forced text not taken: its row and its state go together
        row = _probe_row(self._vocab_size)  # [1, ceil(V / 32)] int32
        self._grammar_state.fill_next_token_bitmask(row, 0)
        return state.leaves_viable(row[0], self._eos, lambda token: self._viable(token, depth - 1))

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) if the grammar rejects it, or it would
        complete a duplicate key, or a value the schema forbids (unless this step is a dead end)."""
        token_id = int(token_id)
        if token_id in self._special:  # the engine would refuse it too, with a warning on stderr
            return False
        keys = values = None
        stuck = False  # a dead end (see the class): the value is taken as it comes
        if token_id < self._vocab_size:  # an id past the tokenizer's (padding) holds no text
            if self._keys is not None and (keys := self._keys.state.advance(token_id)) is None:
                return False
            if self._values is not None:
                state = self._values.state
                if token_id in self._eos:  # ends the output: its text is no part of it
                    values = state if state.can_end() else None
                else:
                    values = state.advance(token_id, strict=True)
                stuck = values is None and not self.searching and self.at_dead_end()
                if stuck:
                    values = state.advance(token_id, strict=False)
                if values is None:
                    return False
        if not self._grammar_state.accept_token(token_id):
            return False
        if token_id in self._eos:
            self._ended = bool(self._grammar_state.is_terminated())
        if stuck:
            self.dead_ends.append(self.num_accepted)
        if self._keys is not None:
            self._keys = _Trail(keys or self._keys.state, self._keys)
        if self._values is not None:
            self._values = _Trail(values or self._values.state, self._values)
        self.num_accepted += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance token by token; return how many were accepted before the first rejection."""
        for count, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                return count
        return len(token_ids)

    def accept_string(self, text: str) -> bool:
        """Advance by raw text (validation); ``False`` (state unchanged) if rejected. Cannot be rolled back."""
        data = text.encode("utf-8")
        keys = None if self._keys is None else self._keys.state.advance_bytes(data)
        values = None if self._values is None else self._values.state.advance_bytes(data)
        if (self._keys is not None and keys is None) or (self._values is not None and values is None):
            return False
        if not self._grammar_state.accept_string(text):
            return False
        self._ended = bool(self._grammar_state.is_terminated())  # (a special token's text ends llguidance's)
        if self._keys is not None and keys is not None:
            self._keys = _Trail(keys, self._keys.before)
        if self._values is not None and values is not None:
            self._values = _Trail(values, self._values.before)
        return True

    def completes(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` take this matcher to a complete match, every check strict (no token taken
        at a dead end: as a search's fork would). Does not change the state: the grammar engine checks the
        path (:meth:`~constrain.backends.base.CompiledGrammar.completes`), and the key and value scanners
        read its text in one pass (the cost of a closing path's check, per vetted token)."""
        if any(token in self._eos or token >= self.compiled.vocab_size for token in token_ids):
            probe = self.fork(search=True)  # EOS and padding ids: token by token
            return probe.accept_tokens(token_ids) == len(token_ids) and probe.is_completed()
        if self.is_terminated():
            return False
        scanner = self._values.state if self._values is not None else self._keys.state if self._keys else None
        if scanner is not None:
            data = b"".join(scanner.vocab.texts[token] for token in token_ids)
            if self._keys is not None and self._keys.state.advance_bytes(data) is None:
                return False
            if self._values is not None:
                values = self._values.state.advance_bytes(data)
                if values is None or not values.can_end():
                    return False
        return self.compiled.grammar.completes(self._grammar_state, token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        self._grammar_state.rollback(num_tokens)
        self._ended = bool(self._grammar_state.is_terminated())
        self.num_accepted -= num_tokens
        if self._keys is not None:
            self._keys = self._keys.back(num_tokens)
        if self._values is not None:
            self._values = self._values.back(num_tokens)
        while self.dead_ends and self.dead_ends[-1] >= self.num_accepted:  # the tokens taken there are undone
            self.dead_ends.pop()

    def is_terminated(self) -> bool:
        """True once an EOS token was accepted."""
        return self._ended

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (EOS would be accepted now)."""
        return bool(self._grammar_state.is_completed()) and (self._values is None or self._values.state.can_end())

    def can_continue(self) -> bool:
        """Whether any token besides EOS is allowed now (a complete ``12`` may still become ``123``).

        Does not change the matcher state.
        """
        bitmask = allocate_token_bitmask(1, self.compiled.vocab_size)
        self._grammar_state.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].numpy()  # [ceil(V / 32)] int32, a view
        clear_bits(words, self.compiled.tokenizer.eos_token_ids)
        return bool(words.any())

    def forced_text(self) -> str:
        """The longest text every continuation starts with ("" if the next character is free, or if that
        text completes a value the schema forbids: sampling then meets the dead end, see the class).

        Does not change the matcher state.
        """
        text = str(self._grammar_state.find_jump_forward_string())
        if text and self._values is not None and self._values.state.advance_bytes(text.encode()) is None:
            return ""
        return text

    def reset(self) -> None:
        """Back to the initial state."""
        self._grammar_state.reset()
        self._ended = False
        self.num_accepted = 0
        if self._keys is not None:
            self._keys = self._keys.root()
        if self._values is not None:
            self._values = self._values.root()
        self.dead_ends.clear()

    @property
    def checks_values(self) -> bool:
        """Whether this matcher checks values beyond its grammar (``compiled.value_checks``)."""
        return self._values is not None

    @property
    def checks_tokens(self) -> bool:
        """Whether its grammar's row is a superset that :meth:`check_row` narrows (a key guard or value
        checks); without, a row filled with ``checks=False`` is exact."""
        return self._keys is not None or self._values is not None

    def value_digest(self) -> int:
        """A hash of what the value checks still depend on (0 without checks): states of one grammar
        state and one digest go on alike, but for the scalar being written (see ``ValueState.digest``)."""
        return 0 if self._values is None else self._values.state.digest()

    def fork(self, *, search: bool | None = None) -> Matcher:
        """An independent copy of this matcher, in the same state (``search``: a fork for a search that
        backs out of dead ends itself, see the class; None: as this one). O(1) but for the engine's own
        copy of its state."""
        twin = Matcher.__new__(Matcher)
        twin.compiled = self.compiled
        twin._max_rollback = self._max_rollback
        twin._grammar_state = self._grammar_state.fork()
        twin.num_accepted = self.num_accepted
        twin._ended = self._ended
        twin._vocab_size = self._vocab_size
        twin._keys = self._keys  # immutable trails: shared
        twin._guarded = self._guarded
        twin._values = self._values
        twin.dead_ends = list(self.dead_ends)
        twin._eos = self._eos
        twin._special = self._special
        twin.searching = self.searching if search is None else search
        twin._filled = self._filled
        return twin


_PROBES = threading.local()


def _probe_row(vocab_size: int) -> torch.Tensor:
    """``[1, ceil(vocab_size / 32)]`` int32: this thread's row for the look-ahead's masks (one probe at
    depth 2 fills a row at a time, and reads it before the next does), made once per thread and size."""
    rows: dict[int, torch.Tensor] = _PROBES.__dict__.setdefault("rows", {})
    if vocab_size not in rows:
        rows[vocab_size] = allocate_token_bitmask(1, vocab_size)
    return rows[vocab_size]


def fill_next_token_bitmasks(
    matchers: Sequence[Matcher],
    # [B, ceil(V / 32)] int32, on the CPU
    bitmask: torch.Tensor,
    indices: Sequence[int] | None = None,
    *,
    checks: bool = True,
) -> list[bool]:
    """Fill ``bitmask[indices[i]]`` for ``matchers[i]``: the grammar engines' batch calls (one per engine,
    across their threads, the GIL released), then (``checks``) the key guards and the value checks.

    ``indices`` defaults to ``range(len(matchers))``. ``checks=False`` leaves the key guards and value
    checks to :meth:`Matcher.check_row` or :meth:`Matcher.allows` (see :class:`Matcher`). Returns, per matcher,
    whether it is at a dead end of its value checks (its row is then the grammar's; always False without
    ``checks``). Does not change the matchers' state.
    """
    if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32:
        raise ValueError("fill the bitmask on the CPU as int32 (allocate_token_bitmask), then move it")
    if indices is not None and len(indices) != len(matchers):
        raise ValueError(f"{len(indices)} indices for {len(matchers)} matchers")
    rows = list(indices) if indices is not None else list(range(len(matchers)))
    groups: dict[int, tuple[CompiledGrammar, list[GrammarState], list[int]]] = {}  # by backend: one call each
    live: list[tuple[Matcher, int]] = []
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.is_terminated():  # its engine would refuse: EOS only
            _eos_only(bitmask[row], matcher._eos)
            continue
        grammar = matcher.compiled.grammar
        _, states, at = groups.setdefault(id(grammar.backend), (grammar, [], []))
        states.append(matcher._grammar_state)
        at.append(row)
        live.append((matcher, row))
    for grammar, states, at in groups.values():
        grammar.backend.fill_next_token_bitmasks(states, bitmask, at)
    dead = {row for matcher, row in live if checks and matcher.check_row(bitmask[row]) == DEAD_END}
    return [row in dead for row in rows]


def _eos_only(
    # [ceil(V / 32)] int32 on the CPU; overwritten
    row: torch.Tensor,
    eos_token_ids: Iterable[int],
) -> None:
    """Allow exactly the EOS ids in ``row`` (a terminated matcher's mask)."""
    row.zero_()
    set_bits(row.numpy(), list(eos_token_ids))
