"""The greedy closing: a quick way to finish from a matcher's state, where the search is not worth it.

:func:`greedy_closing` walks one path: take the forced text; else the first of the :data:`PRIORITY
<constrain.match.vocab.PRIORITY>` characters (close strings and containers first, then the shortest
values) and the constraint's hints (first those that make the string being written a whole value) that
does not lead into a dead end of the value checks; where it writes one character again and again (free
text, or a loop), look for a token that leads elsewhere
(``_escape``). It is the fallback of :func:`~constrain.match.closing.completion` when the search
finds nothing within its bound, and the cheap check the :class:`~constrain.match.budget.Budget`
makes during generation. Its work is bounded in steps, never in seconds (:data:`TRIES_PER_TOKEN`,
:data:`ESCAPES`), so what it finds does not depend on the machine's load. :func:`take_forced` and
:func:`state_signature` serve the search as well.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from constrain.jsonscan import START, JsonScan, JsonSyntaxError
from constrain.match.bitmask import allocate_token_bitmask, allowed_among
from constrain.match.matcher import Matcher
from constrain.match.vocab import PRIORITY, ClosingVocab

__all__ = [
    "ESCAPES", "STREAK", "TRIES_PER_TOKEN", "Encode", "Signature", "greedy_closing", "state_signature", "take_forced"
]  # fmt: skip

STREAK = 8
"""After this many copies of one character in a row, look for an allowed character that changes the
next mask (the ``@`` of an e-mail pattern), else go on."""

ESCAPES = 8
"""At most this many escapes from loops per closing (each tries every allowed character's mask)."""

TRIES_PER_TOKEN = 8
"""The greedy closing tries at most this many moves per token of its length limit (a move: a priority
character, a hint, any allowed character, each accepted on a probe and, under value checks, followed
by a mask), then gives up: a deterministic bound on its work where value checks refuse move after move.
From the initial states of every 40th MaskBench dev schema (SmolLM2's tokenizer, ``max_tokens=384``)
the closings that found a path tried at most 466 moves (about 3 a token of it), those that wandered
until their length limit up to 1,554."""

Encode = Callable[[str], list[int]]
"""A piece of text to token ids (the tokenizer's own, no special tokens)."""

Signature = tuple[str, int]
"""What a matcher state allows next: its forced text and a hash of its next-token mask (and value digest)."""


def take_forced(probe: Matcher, text: str, encode: Encode, chars: dict[str, int]) -> list[int] | None:
    """Accept forced ``text`` on ``probe`` as tokens (its own tokenization, else character by character)
    and return them; None (``probe`` unchanged) if the matcher refuses both."""
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


def state_signature(
    probe: Matcher,
    # [1, ceil(V / 32)] int32, on the CPU; overwritten
    bitmask: torch.Tensor,
) -> Signature:
    """What ``probe`` allows next: its forced text and a hash of its next-token mask and of what its value
    checks still depend on (fills ``bitmask``)."""
    probe.fill_next_token_bitmask(bitmask)
    return probe.forced_text(), hash((bitmask[0].numpy().tobytes(), probe.value_digest()))


def _escape(
    probe: Matcher,
    pick: int,
    # [1, ceil(V / 32)] int32, on the CPU; overwritten
    bitmask: torch.Tensor,
    vocab: ClosingVocab,
    hints: list[list[int]],
    stuck: set[Signature],
    taken: dict[Signature, int],
) -> list[int] | None:
    """Tokens after which ``probe`` allows something else than after ``pick`` (one more round of a
    loop), accepted on ``probe`` (else None, ``probe`` unchanged): one of ``hints``, else the allowed
    single-character token that leads where escapes led least often (``taken`` counts them: else a
    column list escapes by a comma forever). A loop without a way out is added to ``stuck`` and not
    looked at again."""
    probe.fill_next_token_bitmask(bitmask)
    allowed = allowed_among(bitmask[0], vocab.char_ids)  # [k] int64, in move order
    if not probe.accept_token(pick):
        return None
    looping = state_signature(probe, bitmask)
    probe.rollback(1)
    if looping in stuck:
        return None
    for ids in hints:  # the constraint's own examples first: a blind pattern has no other way out
        taken_ids = probe.accept_tokens(ids)
        if taken_ids == len(ids) and (probe.is_completed() or state_signature(probe, bitmask) != looping):
            return ids
        probe.rollback(taken_ids)
    best: tuple[int, int, Signature] | None = None  # (times taken, token, where it leads)
    for token in allowed.tolist():
        if token != pick and probe.accept_token(token):
            after = state_signature(probe, bitmask)
            probe.rollback(1)
            if after != looping and (best is None or taken.get(after, 0) < best[0]):
                best = (taken.get(after, 0), token, after)
                if best[0] == 0:
                    break
    if best is None:
        stuck.add(looping)
        return None
    taken[best[2]] = best[0] + 1
    probe.accept_token(best[1])
    return [int(best[1])]


def _advance(
    probe: Matcher,
    ids: list[int],
    # [1, ceil(V / 32)] int32, on the CPU; overwritten
    bitmask: torch.Tensor,
) -> bool:
    """Accept ``ids`` on ``probe`` (a search fork) if it can go on after them, else leave it as it was:
    under value checks a dead end allows nothing (``fork(search=True)``); without them every state can
    go on."""
    taken = probe.accept_tokens(ids)
    if taken == len(ids):
        if not probe.checks_values or probe.is_completed() or probe.any_allowed(bitmask):
            return True
    probe.rollback(taken)
    return False


def greedy_closing(
    matcher: Matcher,
    encode: Encode,
    vocab: ClosingVocab,
    max_tokens: int,
    hints: list[list[int]],
    deadline: float | None = None,
    names: frozenset[bytes] = frozenset(),
) -> list[int] | None:
    """A token sequence that completes ``matcher``'s match, at most ``max_tokens`` long (``[]`` if it is
    complete already), or None: a dead end, more than ``TRIES_PER_TOKEN * max_tokens`` moves tried, or
    ``deadline`` (a ``time.perf_counter()`` value, checked every 16 tokens; default None: no time
    limit) passed. ``hints``: token sequences worth trying inside free text; ``names``: keys an object
    may have to hold (:func:`~constrain.match.hints.required_keys`), each tried first where a key begins
    (after ``{"`` or ``,"``) until this path has written it in that object. Deterministic without a
    ``deadline``. Does not change ``matcher`` (it walks a fork)."""
    chars = vocab.char_tokens
    bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
    priority = [chars[c] for c in PRIORITY if c in chars]
    moves = [[t] for t in priority[:1]] + hints + [[t] for t in priority[1:]]  # a string's closing quote first
    probe, out = matcher.fork(), list[int]()
    streak, last = 0, list[int]()  # tokens of the last move repeated in a row, and that move
    stuck: set[Signature] = set()  # loops no character leads out of
    taken: dict[Signature, int] = {}  # where escapes from loops led, how often
    escapes = 0
    tries = TRIES_PER_TOKEN * max_tokens  # moves left to try
    objects = _Objects()  # the ``names`` this path wrote as keys, per object open
    while len(out) <= max_tokens and (deadline is None or len(out) % 16 or time.perf_counter() < deadline):
        if probe.is_completed():
            return out
        forced = probe.forced_text()
        ids = take_forced(probe, forced, encode, chars) if forced else None
        if ids:
            out += ids
            objects.feed(ids, vocab)
            streak = 0
            continue
        if streak >= STREAK and escapes < ESCAPES:  # one character again and again: free text, or a loop
            escaped = _escape(probe, out[-1], bitmask, vocab, hints, stuck, taken)
            streak, escapes = 0, escapes + 1
            if escaped is not None:
                out += escaped
                objects.feed(escaped, vocab)
                continue
        # try the priority characters in turn, not into a dead end of the value checks ("a where the
        # array holds "a" already); where a string cannot close yet, the constraint's own examples before
        # the other characters (a date: 2000-01-01, where 0000-... has no valid day)
        keys = _key_moves(out, names - objects.keys[-1], vocab)
        pick, tries = _first_move(probe, [ids for _, ids in keys] + moves[:1], bitmask, tries)
        if pick is None:  # the hints that make the string a whole value first (a duration's, not an e-mail's)
            whole = [ids for ids in hints if _closes(probe, ids, moves[0], bitmask)]
            rest = [ids for ids in hints if ids not in whole] + moves[1 + len(hints) :]  # (moves: quote, hints, rest)
            pick, tries = _first_move(probe, whole + rest, bitmask, tries)
        objects.keys[-1].update(name for name, ids in keys if ids == pick)
        if pick is None and tries > 0:
            probe.fill_next_token_bitmask(bitmask)
            by_char = sorted(allowed_among(bitmask[0], vocab.char_ids).tolist(), key=vocab.pieces.__getitem__)
            pick, tries = _first_move(probe, [[token] for token in by_char], bitmask, tries)
        if pick is None:
            return None
        # the same move again: count its tokens (a hint taken over and over inside a free string, the
        # ``aaaaaaaa-aaaa-...`` of a UUID in a pattern's group, is a loop as much as one character is)
        streak = streak + len(pick) if pick == last else len(pick)
        last = pick
        out += pick
        objects.feed(pick, vocab)
    return None


class _Objects:
    """The keys a closing path wrote in each container it has open (innermost last), the containers read by
    the JSON scanner from the path's bytes: a required key written in an inner object (an open object takes
    any key) is still to be written in the outer one. Where the path's text is not JSON from its start (a
    closing from inside a value, a tool call's wrapper), the scan is dropped and one set holds every key,
    as before the objects were told apart."""

    __slots__ = ("keys", "scan")

    def __init__(self) -> None:
        self.keys: list[set[bytes]] = [set()]
        self.scan: JsonScan | None = START

    def feed(self, ids: list[int], vocab: ClosingVocab) -> None:
        if self.scan is None:
            return
        try:
            self.scan = self.scan.feed(b"".join(vocab.pieces[t] for t in ids), self, texts=False)
        except JsonSyntaxError:
            self.scan, self.keys = None, [set().union(*self.keys)]

    def open(self, is_object: bool) -> None:  # (JsonEvents)
        self.keys.append(set())

    def close(self) -> None:
        self.keys.pop()

    def key(self, text: bytes) -> None:
        pass

    def value(self, text: bytes) -> None:
        pass


_KEY_START = re.compile(rb'[{,][ \t\n\r]*"$')
_KEY_START_TOKENS = 8
"""How many of the last tokens :func:`_key_moves` reads to tell whether a key begins."""


def _key_moves(out: list[int], names: frozenset[bytes], vocab: ClosingVocab) -> list[tuple[bytes, list[int]]]:
    """Where ``out`` ends where a key begins (after ``{"`` or ``,"``), per name of ``names`` (sorted), the
    move that writes it with its closing quote in the fewest tokens; else none. O(1) in ``out``'s length."""
    if not names or not _KEY_START.search(b"".join(vocab.pieces[t] for t in out[-_KEY_START_TOKENS:])):
        return []
    moves = ((name, vocab.cover(name + b'"', 0)[0]) for name in sorted(names))
    return [(name, ids) for name, ids in moves if ids]


def _closes(
    probe: Matcher,
    ids: list[int],
    quote: list[int],
    # [1, ceil(V / 32)] int32, on the CPU; overwritten
    bitmask: torch.Tensor,
) -> bool:
    """Whether ``probe`` can go on after ``ids`` then ``quote`` (a hint that is a whole value of the string
    being written: its value checks take it). Leaves ``probe`` as it was."""
    taken = probe.accept_tokens(ids)
    closed = taken == len(ids) and _advance(probe, quote, bitmask)
    probe.rollback(taken + (len(quote) if closed else 0))
    return closed


def _first_move(
    probe: Matcher,
    moves: list[list[int]],
    # [1, ceil(V / 32)] int32, on the CPU; overwritten
    bitmask: torch.Tensor,
    tries: int,
) -> tuple[list[int] | None, int]:
    """The first of ``moves`` that ``probe`` can go on after (accepted on it, see ``_advance``), trying
    at most ``tries`` of them; and the tries left."""
    for ids in moves:
        if tries <= 0:
            break
        tries -= 1
        if _advance(probe, ids, bitmask):
            return ids, tries
    return None, tries
