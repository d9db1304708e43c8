"""Guaranteed termination: the shortest way to finish from a matcher's state, and the budget that uses it.

:func:`completion` finds a token sequence that takes a matcher from its current state to a complete
match, short in tokens, by a best-first search over the grammar's continuations (the matcher's
fork / forced text / single-character tokens): grammar-agnostic, so it serves JSON Schema, regexes,
EBNF grammars and choices alike. Where the search runs out of nodes it falls back to a greedy
closing (close strings and containers first, then the shortest values), which is an upper bound.

:class:`Budget` keeps every constrained request finishable within ``max_tokens``: once the tokens
left come down to twice the closing length plus :data:`NEAR`, each sampled token is taken only if
a completion still fits after it; otherwise the next token of the closing path is taken instead
(counted as forced). The result then ends complete and valid, with ``finish_reason="length"``
when the closing path was used.

:class:`RepetitionGuard` spots a model looping inside a JSON array or object (the same item or
member repeated ``copies`` times) and forbids the separator that would start another repeat, so
the grammar's closing path is taken.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from constrain.errors import BudgetError
from constrain.matcher import Matcher, allocate_token_bitmask
from constrain.tokenizer import TokenizerInfo

__all__ = ["NEAR", "Budget", "RepetitionGuard", "completion"]

NEAR = 24
""":class:`Budget` checks every token once the tokens left are at most twice the closing length plus this."""

_PRIORITY = '"a}]),0123456789[{ntf:-.eE '
"""Greedy closing: the characters tried first: close a string, else fill it (``a`` is allowed only
inside strings in JSON); close containers and numbers; then the shortest values. The search tries
these first."""

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class _Vocab:
    char_tokens: dict[str, int]  # one-character texts (ASCII) -> their token id
    pieces: list[bytes]  # per token id, its bytes
    comma_pieces: list[tuple[int, str]]  # (id, text) of the tokens whose text holds a ","


_vocab_cache: dict[str, _Vocab] = {}
_vocab_lock = threading.Lock()


def _vocab(info: TokenizerInfo) -> _Vocab:
    with _vocab_lock:
        found = _vocab_cache.get(info.fingerprint)
    if found is not None:
        return found
    chars: dict[str, int] = {}
    commas: list[tuple[int, str]] = []
    special = set(info.xgr_info.special_token_ids)
    pieces = list(info.xgr_info.decoded_vocab)
    for token_id, raw in enumerate(pieces):
        if token_id in special or not raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        if len(text) == 1 and text.isascii() and text not in chars:
            chars[text] = token_id
        if "," in text:
            commas.append((token_id, text))
    result = _Vocab(chars, pieces, commas)
    with _vocab_lock:
        _vocab_cache[info.fingerprint] = result
    return result


def _allowed_chars(matcher: Matcher, bitmask: torch.Tensor, chars: dict[str, int]) -> list[str]:
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return [c for c, t in chars.items() if (words[t // 32] >> (t % 32)) & 1]


def _take_forced(probe: Matcher, text: str, encode: Encode, chars: dict[str, int]) -> list[int] | None:
    """Accept forced ``text`` on ``probe`` as tokens (its own tokenization, else character by character)."""
    ids = encode(text)
    taken = probe.accept_tokens(ids)
    if taken == len(ids):
        return ids
    probe.rollback(taken)
    ids = []
    for ch in text:
        piece = [chars[ch]] if ch in chars else encode(ch)
        if probe.accept_tokens(piece) != len(piece):
            probe.rollback(len(ids))
            return None
        ids += piece
    return ids


def _children(
    probe: Matcher, bitmask: torch.Tensor, encode: Encode, chars: dict[str, int]
) -> list[tuple[list[int], Matcher]]:
    """The continuations worth trying from ``probe``: its forced text, else each allowed character
    (:data:`_PRIORITY` first)."""
    forced = probe.forced_text()
    if forced:
        child = probe.fork()
        ids = _take_forced(child, forced, encode, chars)
        if ids:
            return [(ids, child)]
    allowed = _allowed_chars(probe, bitmask, chars)
    picked = [c for c in _PRIORITY if c in allowed] + [c for c in allowed if c not in _PRIORITY]
    out, seen = [], set()
    for ch in picked:
        child = probe.fork()
        if not child.accept_token(chars[ch]):
            continue
        # siblings alike in their next mask (a free string's characters) are searched once
        child.fill_next_token_bitmask(bitmask)
        signature = (child.is_completed(), hash(bitmask[0].numpy().tobytes()))
        if signature not in seen:
            seen.add(signature)
            out.append(([chars[ch]], child))
    return out


def _greedy(matcher: Matcher, encode: Encode, chars: dict[str, int], max_tokens: int) -> list[int] | None:
    bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
    priority = [chars[c] for c in _PRIORITY if c in chars]
    probe, out = matcher.fork(), list[int]()
    while len(out) <= max_tokens:
        if probe.is_completed():
            return out
        forced = probe.forced_text()
        ids = _take_forced(probe, forced, encode, chars) if forced else None
        if ids:
            out += ids
            continue
        # a rejected token leaves the state as it was: try the priority characters in turn
        pick = next((t for t in priority if probe.accept_token(t)), None)
        if pick is None:
            allowed = _allowed_chars(probe, bitmask, chars)
            if not allowed or not probe.accept_token(chars[min(allowed)]):
                return None
            pick = chars[min(allowed)]
        out.append(pick)
    return None


def completion(
    matcher: Matcher,
    encode: Encode,
    *,
    max_tokens: int = 512,
    max_nodes: int = 400,
) -> list[int] | None:
    """A short token sequence that completes ``matcher``'s match; ``[]`` if already complete; None if none found.

    Best-first (fewest tokens) over forced text and single-character tokens, ``max_nodes``
    expansions (of the characters that lead to different next masks: inside a free string, one);
    else the greedy closing. Both are bounded by ``max_tokens``, and the result is re-tokenized
    by ``encode`` (a piece of text to ids, no special tokens) where that is shorter. Does not change
    ``matcher``.
    """
    chars = _vocab(matcher.compiled.tokenizer).char_tokens
    best = _greedy(matcher, encode, chars, max_tokens)
    bound = len(best) if best is not None else max_tokens + 1
    bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
    order = itertools.count()
    heap: list[tuple[int, int, list[int], Matcher]] = [(0, next(order), [], matcher.fork())]
    for _ in range(max_nodes):
        if not heap:
            break
        cost, _, path, probe = heapq.heappop(heap)
        if cost >= bound:
            break
        if probe.is_completed():
            best = path
            break
        for ids, child in _children(probe, bitmask, encode, chars):
            if cost + len(ids) < bound:
                heapq.heappush(heap, (cost + len(ids), next(order), path + ids, child))
    return _retokenized(matcher, best, encode) if best else best


def _retokenized(matcher: Matcher, path: list[int], encode: Encode) -> list[int]:
    """``path``'s text in the tokenizer's own tokens when that is shorter and completes as well."""
    pieces = _vocab(matcher.compiled.tokenizer).pieces
    text = b"".join(pieces[t] for t in path).decode("utf-8", errors="replace")
    ids = encode(text)
    if len(ids) >= len(path):
        return path
    probe = matcher.fork()
    return ids if probe.accept_tokens(ids) == len(ids) and probe.is_completed() else path


class Budget:
    """Keeps one constrained request finishable within its ``max_tokens`` (see the module docstring).

    Raises :class:`~constrain.errors.BudgetError` at construction when no completion of the
    matcher's (initial) state fits in ``max_tokens``.
    """

    REFRESH_EVERY = 8
    """Far from the end, the closing length is re-estimated every this many tokens."""

    def __init__(self, matcher: Matcher, encode: Encode, max_tokens: int, *, initial: bool = False) -> None:
        """``initial``: ``matcher`` is in its constraint's initial state, so the closing path found
        is kept on the compiled constraint for the next request (``encode`` must be its tokenizer's)."""
        self.matcher = matcher
        self.encode = encode
        self.forced = 0  # tokens taken from the closing path instead of the sampled one
        closings = matcher.compiled.initial_closings
        if initial and max_tokens in closings:
            plan = closings[max_tokens]
        else:
            plan = completion(matcher, encode, max_tokens=max_tokens, max_nodes=0)
            if plan is None or len(plan) > max_tokens:
                plan = completion(matcher, encode, max_tokens=max_tokens)
            if initial:
                closings[max_tokens] = plan
        if plan is None or len(plan) > max_tokens:
            raise BudgetError(
                f"no valid output fits in max_tokens={max_tokens}: the shortest completion found "
                + ("needs more" if plan is None else f"needs {len(plan)} tokens")
            )
        self.estimate = len(plan)  # tokens the closing path needs, as last computed
        self._steps = 0
        self._next: list[int] | None = plan  # the closing path from the matcher's current state

    def vet(self, token: int, remaining: int) -> int | None:
        """The token to take this step: ``token`` if a completion fits in ``remaining - 1`` tokens after
        it, else the next token of the closing path; None when the match is complete and nothing but
        ending fits. ``remaining`` counts this step. Does not change the matcher.

        Near the end (``remaining <= 2 * closing + NEAR``) every token is checked; before that the
        closing length is re-estimated every :data:`REFRESH_EVERY` tokens only, which misses just a
        token that by itself adds more than half the remaining budget of required content.
        """
        self._steps += 1
        plan, self._next = self._next, None  # the closing path from here, if the last step found it
        far = remaining > 2 * self.estimate + NEAR
        if far and self._steps % self.REFRESH_EVERY:
            return token
        if plan is None:  # bounded past the budget too: if a token broke it, closing is the best effort
            plan = completion(self.matcher, self.encode, max_tokens=2 * remaining + 64, max_nodes=0)
        if plan is None:  # no closing found from here: nothing to steer by
            return token
        self.estimate = len(plan)
        if remaining > 2 * len(plan) + NEAR:
            return token
        if plan and token == plan[0]:
            self._next = plan[1:]
            return token
        probe = self.matcher.fork()
        if probe.accept_token(token):
            after = completion(probe, self.encode, max_tokens=remaining - 1, max_nodes=0)
            if after is not None and len(after) <= remaining - 1:
                self._next = after
                return token
        if not plan:
            return None
        self.forced += 1
        self._next = plan[1:]
        return plan[0]


class RepetitionGuard:
    """Forbids the separator after a JSON array item (or member) repeated ``copies`` times in a row.

    A token is forbidden when it would put a ``,`` right after ``copies`` identical items that span at
    least ``min_span`` characters (items up to ``max_period`` characters): whether the ``,`` comes
    alone or fused with the item's closing quote (``",``), as tokenizers often do.
    """

    def __init__(self, info: TokenizerInfo, *, copies: int = 3, min_span: int = 24, max_period: int = 256) -> None:
        if copies < 2:
            raise ValueError(f"copies must be at least 2, got {copies}")
        self.comma_pieces = _vocab(info).comma_pieces
        self.copies, self.min_span, self.max_period = copies, min_span, max_period
        self.steps = 0  # decode steps at which the guard forbade a separator

    def repeating(self, text: str) -> bool:
        """Whether ``text`` ends with ``copies`` identical items (``X, X, X``) spanning ``min_span``."""
        t = text.rstrip()
        for period in range(2, min(self.max_period, len(t) // (self.copies - 1)) + 1):
            unit = t[-period:]  # ", X"
            item = unit.lstrip()[1:].lstrip() if unit.lstrip().startswith(",") else ""
            if not item:
                continue
            units = 1
            while t[len(t) - (units + 1) * period : len(t) - units * period] == unit:
                units += 1
            items = units + t[: len(t) - units * period].endswith(item)
            if items >= self.copies and units * period + len(item) >= self.min_span:
                return True
        return False

    def _periodic(self, text: str) -> bool:
        """A cheap filter: some period repeats over the end of ``text`` (wherever the items start)."""
        t = text.rstrip()
        for period in range(2, min(self.max_period, len(t) // (self.copies - 1)) + 1):
            span = (self.copies - 2) * period + period // 2  # the last item may be half written
            if span + period <= len(t) and t[-span:] == t[-span - period : -period]:
                return True
        return False

    def apply(
        self,
        text: str,
        # [ceil(V / 32)] int32 on the CPU: this request's filled mask; updated in place
        row: torch.Tensor,
    ) -> bool:
        """Clear from ``row`` the tokens that would add a separator after ``copies`` identical items at
        the end of ``text``, unless nothing would be left. Returns whether it cleared any."""
        if not self._periodic(text):
            return False
        words = row.tolist()
        banned = [
            token
            for token, piece in self.comma_pieces
            if (words[token // 32] >> (token % 32)) & 1 and self.repeating(text + piece[: piece.index(",")])
        ]
        if not banned:
            return False
        for token in banned:
            words[token // 32] &= ~(1 << (token % 32))
        if not any(words):
            return False
        row.copy_(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32))
        self.steps += 1
        return True
