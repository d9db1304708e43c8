"""Guaranteed termination: the budget that keeps every constrained request finishable in ``max_tokens``.

:class:`Budget` keeps a request finishable: once the tokens left come down to twice the closing
length (:func:`~constrain.match.closing.completion`) plus :data:`NEAR`, each sampled token is taken
only if a completion still fits after it; otherwise the next token of the closing path is taken
instead (counted as forced). The result then ends complete and valid, with ``finish_reason="length"``
when the closing path was used.

Every request of a constraint starts in its initial state, and the search from there can take
thousands of masks: the path found is kept in :data:`initial_closings` (bounded, thread-safe,
reported as ``"match.budget.initial_closings"`` in :func:`constrain.caches.stats`), not on the
compiled constraint, which stays immutable.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from constrain import caches
from constrain.constraints.constraint import Constraint
from constrain.errors import BudgetError
from constrain.match.closing import completion
from constrain.match.greedy import Encode
from constrain.match.hints import hints
from constrain.match.matcher import Compiled, Matcher

__all__ = ["INITIAL_CLOSINGS", "NEAR", "Budget", "ClosingKey", "InitialClosings", "initial_closings"]

NEAR = 24
""":class:`Budget` checks every token once the tokens left are at most twice the closing length plus this."""

INITIAL_CLOSINGS = 256
"""Closing paths from initial states kept by :data:`initial_closings` (least recently used dropped)."""

ClosingKey = tuple[Constraint, str, str, int]
"""What a closing path from an initial state is kept by: the constraint (compared as a value), the
tokenizer's fingerprint, the engine, and ``max_tokens``."""


class InitialClosings:
    """Closing paths from constraints' initial states, per ``max_tokens``: a bounded LRU map, thread-safe.

    A path (or None: no completion that short was found) holds for every compiled constraint of one
    key (:data:`ClosingKey`): the constraint's value, the tokenizer and the engine decide the grammar.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be positive, got {maxsize}")
        self.maxsize = maxsize
        self._paths: OrderedDict[ClosingKey, tuple[int, ...] | None] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @staticmethod
    def key(compiled: Compiled, max_tokens: int) -> ClosingKey:
        """The key of ``compiled``'s initial state and ``max_tokens`` (hashable: constraints are frozen values)."""
        return compiled.constraint, compiled.tokenizer.fingerprint, compiled.grammar.engine, max_tokens

    def get(self, compiled: Compiled, max_tokens: int) -> tuple[bool, list[int] | None]:
        """``(found, path)``: whether a path from ``compiled``'s initial state is kept for ``max_tokens``,
        and that path (a fresh list; None where none was found)."""
        key = self.key(compiled, max_tokens)
        with self._lock:
            if key not in self._paths:
                self._misses += 1
                return False, None
            self._hits += 1
            self._paths.move_to_end(key)
            path = self._paths[key]
        return True, None if path is None else list(path)

    def put(self, compiled: Compiled, max_tokens: int, path: list[int] | None) -> None:
        """Keep ``path`` (a closing path from ``compiled``'s initial state, or None) for ``max_tokens``."""
        key = self.key(compiled, max_tokens)
        with self._lock:
            self._paths[key] = None if path is None else tuple(path)
            self._paths.move_to_end(key)
            while len(self._paths) > self.maxsize:
                self._paths.popitem(last=False)

    def clear(self) -> None:
        """Drop every path (the figures stay)."""
        with self._lock:
            self._paths.clear()

    def stats(self) -> dict[str, int]:
        """``entries``, ``hits``, ``misses`` and ``maxsize``."""
        with self._lock:
            return {"entries": len(self._paths), "hits": self._hits, "misses": self._misses, "maxsize": self.maxsize}


initial_closings = InitialClosings(INITIAL_CLOSINGS)
"""The closing paths :class:`Budget` keeps (``initial=True``)."""
caches.register("match.budget.initial_closings", initial_closings.stats)


class Budget:
    """Keeps one constrained request finishable within its ``max_tokens`` (see the module docstring).
    Mutable, one per request; it never changes its matcher (it probes forks).

    Raises :class:`~constrain.errors.BudgetError` at construction when no completion of the
    matcher's (initial) state fits in ``max_tokens``: the greedy closing does not fit, and the search
    of :func:`~constrain.match.closing.completion` finds none that does (it searches every state below
    the budget unless it runs out of time first: 1 s by default, on grammars whose masks are slow or
    whose signatures merge states that differ).
    """

    REFRESH_EVERY = 8
    """Far from the end, the closing length is re-estimated every this many tokens."""

    GREEDY_SECONDS = 0.05
    """Mid-generation, the greedy closing gives up after this long (it can wander where value checks
    refuse its short values)."""

    SEARCH_SECONDS = 0.02
    """When the greedy closing fails mid-generation, :func:`~constrain.match.closing.completion` searches
    this long (then not again for :data:`REFRESH_EVERY` tokens, if it found nothing)."""

    CHECKED_SEARCH_SECONDS = 0.1
    """Likewise under value checks, where the greedy closing fails more often (its short values can be
    refused), and a failed search refuses the model's token."""

    def __init__(self, matcher: Matcher, encode: Encode, max_tokens: int, *, initial: bool = False) -> None:
        """``encode``: a piece of text to the tokenizer's ids (no special tokens); ``initial``: ``matcher``
        is in its constraint's initial state, so the closing path found is kept in
        :data:`initial_closings` for the next request (``encode`` must be the constraint's tokenizer's)."""
        self.matcher = matcher
        self.encode = encode
        self.forced = 0  # tokens taken from the closing path instead of the sampled one, near the end
        self.steered = 0  # likewise far from the end: the sampled token left no completion that could be found
        self.hints = hints(matcher)  # for every completion() of this request
        known, plan = initial_closings.get(matcher.compiled, max_tokens) if initial else (False, None)
        if not known:
            plan = completion(matcher, encode, max_tokens=max_tokens, max_nodes=0, hints=self.hints)
            if plan is None or len(plan) > max_tokens:
                plan = completion(matcher, encode, max_tokens=max_tokens, hints=self.hints)
            if initial:
                initial_closings.put(matcher.compiled, max_tokens, plan)
        if plan is None or len(plan) > max_tokens:
            raise BudgetError(
                f"no valid output fits in max_tokens={max_tokens}: "
                + ("no completion that short was found" if plan is None else f"the shortest found needs {len(plan)}")
            )
        self.estimate = len(plan)  # tokens the closing path needs, as last computed
        self.every_token = matcher.checks_values  # vet every token, far from the end too (see ``vet``)
        self._steps = 0
        self._search_after = 0  # the step from which a failed greedy closing may be searched for again
        self._next: list[int] | None = plan  # the closing path from the matcher's current state

    def vet(self, token: int, remaining: int) -> int | None:
        """The token to take this step: ``token`` if a completion fits in ``remaining - 1`` tokens after
        it, else the next token of the closing path; None when the match is complete and nothing but
        ending fits. ``remaining`` counts this step. Does not change the matcher.

        Near the end (``remaining <= 2 * closing + NEAR``) every token is checked; before that the
        closing length is re-estimated every :data:`REFRESH_EVERY` tokens only, which misses just a
        token that by itself adds more than half the remaining budget of required content. Under value
        checks (``matcher.checks_values``) every token is checked from the start: there the grammar is
        a superset, and one token can lead where no valid value can be finished at all (``{`` where
        every object would need an infinite chain of required keys); where the greedy closing finds
        no completion after a token, a short search (:data:`SEARCH_SECONDS`) looks before it is refused.
        """
        self._steps += 1
        plan, self._next = self._next, None  # the closing path from here, if the last step found it
        far = not self.every_token and remaining > 2 * self.estimate + NEAR
        if far and self._steps % self.REFRESH_EVERY:
            return token
        room = 2 * remaining + 64  # past the budget too: if a token broke it, closing is the best effort
        if plan is None:
            plan = self._closing(self.matcher, room, search=self._steps >= self._search_after)
            if plan is None:  # the search failed too: not again for a while
                self._search_after = self._steps + self.REFRESH_EVERY
        if plan is None:  # no closing found from here: nothing to steer by
            return token
        self.estimate = len(plan)
        near = remaining <= 2 * len(plan) + NEAR
        if not near and not self.every_token:
            return token
        if plan and token == plan[0]:
            self._next = plan[1:]
            return token
        probe = self.matcher.fork()
        if probe.accept_token(token):
            after = self._reused(probe, plan) or self._closing(probe, remaining - 1, search=self.every_token)
            if after is not None and len(after) <= remaining - 1:
                self._next = after
                return token
        if not plan:
            return None
        if near:
            self.forced += 1
        else:
            self.steered += 1
        self._next = plan[1:]
        return plan[0]

    @staticmethod
    def _reused(probe: Matcher, plan: list[int]) -> list[int] | None:
        """``plan`` (the closing path before the token ``probe`` just took) if it completes ``probe``'s state
        as well, as it does inside free text; None otherwise. Leaves ``probe`` as it was."""
        taken = probe.accept_tokens(plan)
        done = taken == len(plan) and probe.is_completed()
        probe.rollback(taken)
        return plan if done else None

    def _closing(self, matcher: Matcher, max_tokens: int, *, search: bool) -> list[int] | None:
        """A completion of ``matcher``'s state: the greedy closing (at most :data:`GREEDY_SECONDS`), else
        with ``search`` a search of :data:`SEARCH_SECONDS` (:data:`CHECKED_SEARCH_SECONDS` under value
        checks); None if neither found one."""
        plan = completion(
            matcher, self.encode, max_tokens=max_tokens, max_nodes=0, max_seconds=self.GREEDY_SECONDS, hints=self.hints
        )
        if plan is None and search:
            seconds = self.CHECKED_SEARCH_SECONDS if self.every_token else self.SEARCH_SECONDS
            plan = completion(matcher, self.encode, max_tokens=max_tokens, max_seconds=seconds, hints=self.hints)
        return plan
