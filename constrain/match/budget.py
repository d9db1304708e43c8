"""Guaranteed termination: the budget that keeps every constrained request finishable in ``max_tokens``.

:class:`Budget` keeps a request finishable by holding, at every step, a *closing path*: a token
sequence that the matcher accepts from its current state, that ends in a complete match, and that is
no longer than the tokens left. It is found at admission (the greedy closing, else the search of
:func:`~constrain.match.closing.completion`; none that fits: :class:`~constrain.errors.BudgetError`).
Then, for each sampled token (:meth:`Budget.vet`):

1. the path's next token: taken, and the path is the rest of it;
2. another token: taken only if a closing path of at most the tokens left after it is found from the
   state after it; the first that completes, in order: the rest of the path's text respelled (the
   token spells the path's start differently), the path held (inside free text the token changes
   nothing ahead), the rest of the path's text after as many characters as the token holds (it wrote
   other characters where the path wrote some: hex digits of a UUID), the greedy closing, and where
   that finds none at all (:data:`REACH`), a search of :data:`SEARCH_NODES` states;
3. otherwise the path's next token is taken instead (counted ``forced`` near the end, ``steered``
   elsewhere: see :data:`NEAR`); where the match is complete and nothing else fits, the request ends.

By induction the path held always fits in the tokens left, so the output ends complete and valid
within ``max_tokens`` whatever the searches find: they decide only how many of the model's own tokens
are kept, never whether the output can be finished. The length of the path held is an upper bound on
what closing costs, never an estimate. Every search is bounded in steps (expanded states, tried
moves, tokens), never in seconds, so a seeded request writes the same tokens on a loaded machine as on
an idle one. The result ends complete and valid, with ``finish_reason="length"`` when the closing
path was forced.

Decided against: taking tokens unchecked far from the end (the budget before did, re-estimating
every 8 tokens). That is safe only with a bound on how much one token can lengthen the closing, and
there is none for every grammar (a ``{`` can open an object of any number of required keys; one
token of a recursive grammar, any depth); and an unchecked token leaves no path to force. So every
token is checked; most cost one verification of a path (about 3 to 8 microseconds a token of it). Per
vetted token, on the tiny random model of the tests (SmolLM2's tokenizer, 128 and 384 tokens, greedy
and seeded; AMD EPYC, AVX2, one thread): a mean of 0.3 to 0.5 ms on the 20-field items of
``tests/constrain/match/test_budget.py`` (0.3 before, which broke the budget there at 64), 0.9 to 1.2 ms
on a MaskBench schema with value checks (1.1 to 2.0), 0.1 ms on a recursive tree (0.07 to 0.15). Where
the greedy closing wanders (value-checked open objects whose keys it cannot close), one refused token
can cost 1.5 s (before, 0.5 s and the token taken unchecked): bounded, and left to the per-token cost work.

Every request of a constraint starts in its initial state, and the search from there can take
thousands of masks: the path found is kept in :data:`initial_closings` (bounded, thread-safe,
reported as ``"match.budget.initial_closings"`` in :func:`constrain.caches.stats`), not on the
compiled constraint, which stays immutable.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from constrain import caches
from constrain.constraints.constraint import Constraint
from constrain.errors import BudgetError
from constrain.match.closing import completion
from constrain.match.greedy import Encode
from constrain.match.hints import hints
from constrain.match.matcher import Compiled, Matcher
from constrain.match.vocab import closing_vocab

__all__ = [
    "ADMISSION_NODES", "ENCODINGS", "INITIAL_CLOSINGS", "NEAR", "REACH", "SEARCH_NODES", "Budget", "ClosingKey",
    "Encodings", "InitialClosings", "encodings", "initial_closings",
]  # fmt: skip

NEAR = 24
""":class:`Budget` counts a token it replaces as ``forced`` (closing early) where the tokens left are at most
twice the closing path's length plus this, else as ``steered`` (the model's token led where no closing
path could be found)."""

ADMISSION_NODES = 1_000
"""At admission, where the greedy closing does not fit, the search expands at most this many states:
about what the 1 s limit before reached (263 to 5,155 states, a median of about 800, on every 40th
MaskBench dev schema with SmolLM2's tokenizer; AMD EPYC, AVX2, 2 shared cores). There it refuses what
the time limit refused (10 of 141 at ``max_tokens=64``, 4 at 384), each in 0.1 to 6.7 s (1 to 3.6 s
before; value checks make a state cost most; cached per constraint and ``max_tokens``), and the median
admission stays about 1 ms. A refusal that ran out of states is a proof that nothing fits, one that
used them all is not. Of the sample's searches that found a path, two needed 47 and 122 states; one
needed 4,391 (refused at ``max_tokens=64``, as it was with the time limit)."""

SEARCH_NODES = 64
"""After a sampled token where the greedy closing finds no path at all, the search expands at most this
many states."""

REACH = 64
"""After a sampled token, the greedy closing looks for paths up to this many tokens longer than the
path held (or as long as the tokens left, if more): finding one too long to fit shows that closing after
that token takes about that long (the greedy closing is close to the shortest on JSON), and the search
is skipped (on the 20-field schema of ``tests/constrain/match/test_budget.py`` it found nothing there, at
about 15 ms a search)."""

INITIAL_CLOSINGS = 256
"""Closing paths from initial states kept by :data:`initial_closings` (least recently used dropped)."""

ENCODINGS = 4096
"""Texts' token ids kept by :data:`encodings` (least recently used dropped; a few hundred bytes each)."""

ClosingKey = tuple[Constraint, str, str, int]
"""What a closing path from an initial state is kept by: the constraint (compared as a value), the
tokenizer's fingerprint, the engine, and ``max_tokens``."""


class _BoundedMap:
    """A bounded LRU map, thread-safe, with its figures (what :func:`constrain.caches.stats` reports)."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be positive, got {maxsize}")
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def _lookup(self, key: Hashable) -> tuple[bool, Any]:
        """``(found, value)``, counted a hit or a miss; a hit is made the most recently used."""
        with self._lock:
            if key not in self._items:
                self._misses += 1
                return False, None
            self._hits += 1
            self._items.move_to_end(key)
            return True, self._items[key]

    def _keep(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (the figures stay)."""
        with self._lock:
            self._items.clear()

    def stats(self) -> dict[str, int]:
        """``entries``, ``hits``, ``misses`` and ``maxsize``."""
        with self._lock:
            return {"entries": len(self._items), "hits": self._hits, "misses": self._misses, "maxsize": self.maxsize}


class InitialClosings(_BoundedMap):
    """Closing paths from constraints' initial states, per ``max_tokens``: a bounded LRU map, thread-safe.

    A path (or None: no completion that short was found) holds for every compiled constraint of one
    key (:data:`ClosingKey`): the constraint's value, the tokenizer and the engine decide the grammar.
    """

    @staticmethod
    def key(compiled: Compiled, max_tokens: int) -> ClosingKey:
        """The key of ``compiled``'s initial state and ``max_tokens`` (hashable: constraints are frozen values)."""
        return compiled.constraint, compiled.tokenizer.fingerprint, compiled.grammar.engine, max_tokens

    def get(self, compiled: Compiled, max_tokens: int) -> tuple[bool, list[int] | None]:
        """``(found, path)``: whether a path from ``compiled``'s initial state is kept for ``max_tokens``,
        and that path (a fresh list; None where none was found)."""
        found, path = self._lookup(self.key(compiled, max_tokens))
        return found, None if path is None else list(path)

    def put(self, compiled: Compiled, max_tokens: int, path: list[int] | None) -> None:
        """Keep ``path`` (a closing path from ``compiled``'s initial state, or None) for ``max_tokens``."""
        self._keep(self.key(compiled, max_tokens), None if path is None else tuple(path))


initial_closings = InitialClosings(INITIAL_CLOSINGS)
"""The closing paths :class:`Budget` keeps (``initial=True``)."""
caches.register("match.budget.initial_closings", initial_closings.stats)


class Encodings(_BoundedMap):
    """Texts' token ids per tokenizer: a bounded LRU map, thread-safe. A closing path's rest is re-encoded
    after many a sampled token, and the rests of one schema's paths recur across steps and requests."""

    def encoder(self, fingerprint: str, encode: Encode) -> Encode:
        """``encode`` (a text to the ids of the tokenizer of ``fingerprint``, no special tokens), kept here."""

        def encoded(text: str) -> list[int]:
            key = (fingerprint, text)
            found, ids = self._lookup(key)
            if not found:
                ids = tuple(encode(text))
                self._keep(key, ids)
            return list(ids)

        return encoded


encodings = Encodings(ENCODINGS)
"""The encodings every :class:`Budget` reads through (its ``encode``, for the path's rest and the closing searches)."""
caches.register("match.budget.encodings", encodings.stats)


class Budget:
    """Keeps one constrained request finishable within its ``max_tokens`` (see the module docstring).
    Mutable, one per request; it leaves its matcher as it found it (a sampled token is probed in place and
    undone), and expects the matcher to take exactly the tokens :meth:`vet` returns, one per call.

    Raises :class:`~constrain.errors.BudgetError` at construction when no completion of the
    matcher's (initial) state that fits in ``max_tokens`` is found: the greedy closing does not fit,
    and the search of :func:`~constrain.match.closing.completion` finds none in
    :data:`ADMISSION_NODES` states (it searches every state below the budget unless that bound comes
    first, on grammars whose signatures merge states that differ). Deterministic: the same constraint,
    tokenizer and ``max_tokens`` are refused on any machine, under any load.
    """

    def __init__(self, matcher: Matcher, encode: Encode, max_tokens: int, *, initial: bool = False) -> None:
        """``encode``: a piece of text to the ids of the constraint's tokenizer (no special tokens; what it
        gives is kept in :data:`encodings` by the tokenizer's fingerprint); ``initial``: ``matcher`` is in its
        constraint's initial state, so the closing path found is kept in :data:`initial_closings` for the
        next request."""
        self.matcher = matcher
        self.encode = encodings.encoder(matcher.compiled.tokenizer.fingerprint, encode)
        self.forced = 0  # tokens taken from the closing path instead of the sampled one, near the end
        self.steered = 0  # likewise far from the end: no closing path that fits was found after the sampled one
        self.hints = hints(matcher)  # for every completion() of this request
        self._pieces = closing_vocab(matcher.compiled.tokenizer).pieces  # per token id, its bytes
        known, plan = initial_closings.get(matcher.compiled, max_tokens) if initial else (False, None)
        if not known:
            plan = completion(matcher, self.encode, max_tokens=max_tokens, max_nodes=0, hints=self.hints)
            if plan is None:
                plan = completion(
                    matcher,
                    self.encode,
                    max_tokens=max_tokens,
                    max_nodes=ADMISSION_NODES,
                    hints=self.hints,
                    fallback=False,
                )
            if initial:
                initial_closings.put(matcher.compiled, max_tokens, plan)
        if plan is None:
            raise BudgetError(
                f"no valid output fits in max_tokens={max_tokens}, of those the closing search found (greedily, "
                f"then in {ADMISSION_NODES} states): raise max_tokens, or pass close_in_budget=False to generate "
                "without the guarantee of a complete output"
            )
        self.plan: list[int] = plan  # the closing path from the matcher's state; at most the tokens left long

    def vet(self, token: int, remaining: int) -> int | None:
        """The token to take this step: ``token`` if a closing path of at most ``remaining - 1`` tokens is
        found after it, else the next token of the closing path held; None when the match is complete and
        nothing but ending fits. ``remaining`` counts this step (at least ``len(self.plan)``, as it is when
        the matcher took every token returned before). Updates :attr:`plan` (see the module docstring);
        does not change the matcher."""
        plan = self.plan
        if plan and token == plan[0]:
            self.plan = plan[1:]
            return token
        matcher = self.matcher
        if matcher.accept_token(token):  # probed in place, then undone: no fork of the engine's state
            try:
                after = self._after(matcher, token, plan, remaining - 1)
            finally:
                matcher.rollback(1)
            if after is not None:
                self.plan = after
                return token
        if not plan:
            return None
        if remaining <= 2 * len(plan) + NEAR:
            self.forced += 1
        else:
            self.steered += 1
        self.plan = plan[1:]
        return plan[0]

    def rebase(self, remaining: int) -> bool:
        """After the matcher took text :meth:`vet` did not return (the answer's start, written in the token
        that ends a thinking), hold a closing path from its state again: the path held if it still
        completes, else one searched as at admission. Returns False (the path held unchanged) where none
        of at most ``remaining`` tokens is found."""
        if len(self.plan) <= remaining and self.matcher.completes(self.plan):
            return True
        found = completion(self.matcher, self.encode, max_tokens=remaining, max_nodes=ADMISSION_NODES, hints=self.hints)
        if found is not None:
            self.plan = found
        return found is not None

    def _after(self, probe: Matcher, token: int, plan: list[int], room: int) -> list[int] | None:
        """A closing path of at most ``room`` tokens from ``probe``'s state (the matcher's after ``token``,
        ``plan`` the path held before it): the first that completes of ``plan`` respelled after ``token``,
        ``plan`` itself, ``plan`` shifted by ``token``'s length, the greedy closing; where the greedy
        closing finds none at all (up to :data:`REACH` tokens longer than ``plan``), a search of
        :data:`SEARCH_NODES` states. None if none fits. Every path is checked strictly, on a search's
        fork (no value taken as it comes at a dead end: see :class:`~constrain.match.matcher.Matcher`).
        Leaves ``probe`` as it was."""
        piece = self._pieces[token]
        text = b"".join(self._pieces[t] for t in plan)
        respelled = bool(piece) and text.startswith(piece)
        if not respelled and len(plan) <= room and probe.completes(plan):  # the common case: no encoding
            return plan
        rest = self._rest(piece, text, respelled)
        if rest is not None and len(rest) <= room and probe.completes(rest):
            return rest
        if respelled and len(plan) <= room and probe.completes(plan):
            return plan
        reach = max(room, len(plan) + REACH)
        found = completion(probe, self.encode, max_tokens=reach, max_nodes=0, hints=self.hints)
        if found is None:
            found = completion(
                probe, self.encode, max_tokens=room, max_nodes=SEARCH_NODES, hints=self.hints, fallback=False
            )
        return found if found is not None and len(found) <= room else None

    def _rest(self, piece: bytes, text: bytes, respelled: bool) -> list[int] | None:
        """The rest of a closing path's ``text`` after as many characters as a token's ``piece`` holds, in the
        tokenizer's own tokens: ``text`` respelled where ``piece`` starts it (``respelled``), else shifted (a
        token that wrote other characters where the path wrote some: ``3f`` of a UUID for the path's ``aa``).
        None where the cut falls inside a character, or a token that does not start the path writes past it."""
        if not piece or (not respelled and len(piece) >= len(text)):
            return None
        try:
            return self.encode(text[len(piece) :].decode())
        except UnicodeDecodeError:
            return None
