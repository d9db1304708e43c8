"""The shortest way to finish: a token sequence from a matcher's state to a complete match.

:func:`completion` finds a token sequence that takes a matcher from its current state to a complete
match, short in tokens: a uniform-cost (Dijkstra) search over the grammar's continuations, where a
move spells the forced text (in the fewest tokens, or running past its end), or is any allowed token
where the grammar allows at most :data:`FANOUT`, else any allowed single-character token. It is
grammar-agnostic, so it serves JSON Schema, regexes, EBNF grammars and choices alike. States are
told apart by a *signature* (the forced text and the next-token mask), which keeps optional
whitespace and the choice of a value from multiplying the search; see :func:`completion` for how
counted repetitions stay apart. Where the search finds nothing within its bound (``max_nodes``
expansions), the greedy closing (:mod:`constrain.match.greedy`) is the fallback. Both are bounded in
steps, not seconds (a time limit is an extra the caller may ask for), so the path found is a function
of the matcher's state and the arguments, whatever the machine's load.

What uses it: the :class:`~constrain.match.budget.Budget` (every constrained request ends within
``max_tokens``); the moves are spelled with the tokenizer's tables of :mod:`constrain.match.vocab`,
and the constraint's own examples (:mod:`constrain.match.hints`) light the way through free text.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from constrain.match.bitmask import allocate_token_bitmask, unpack
from constrain.match.greedy import Encode, Signature, greedy_closing, state_signature, take_forced
from constrain.match.hints import hints as constraint_hints
from constrain.match.hints import required_keys
from constrain.match.matcher import Matcher
from constrain.match.vocab import ClosingVocab, closing_vocab

__all__ = ["FANOUT", "completion"]

FANOUT = 32
""":func:`completion` takes every allowed token as a move where the grammar allows at most this many
(structure, enum values, pattern characters), else only the single-character ones (free text)."""

_SLACK = 2
""":func:`completion` searches for paths up to this many times ``max_tokens`` long (in its own count:
free text character by character), as re-tokenized they are shorter."""

_TIES = 8
""":func:`completion` re-tokenizes up to this many paths of the cheapest cost found from one state, and keeps
the shortest."""


Tail = tuple[frozenset[bytes], bytes | None]
"""The required key names (:func:`~constrain.match.hints.required_keys`) a path wrote as quoted texts so far,
and the text since its last quote where it begins one (else None): what tells apart states whose masks are
alike but where only one has written a required key."""


@dataclass(slots=True, eq=False)
class _Node:
    """One state of the closing search: where ``ids`` lead from ``parent``."""

    parent: _Node | None
    ids: list[int]
    cost: int  # tokens from the start
    size: int  # bytes of text from the start
    signature: Signature
    key: tuple[Signature, int, int, Tail | None]  # what the search deduplicates by (see ``_Search._node``)
    solid: int = 0  # bytes of text but for whitespace (``_Search`` level 0)
    text: int = 0  # a hash of the text from the start (``_Search`` level 2)
    tail: Tail = (frozenset(), b"")  # the required keys written, one being written (``_Search._tail``; levels 0, 1)
    # once expanded: the matcher in this state, and the signatures on the way here (this one included)
    probe: Matcher | None = None
    seen: frozenset[Signature] = frozenset()

    def path(self) -> list[int]:
        node: _Node | None = self
        steps: list[list[int]] = []
        while node is not None:
            steps.append(node.ids)
            node = node.parent
        return [t for ids in reversed(steps) for t in ids]


_MODULUS = (1 << 61) - 1
_SPACES = (b" ", b"\t", b"\n", b"\r")


class _Search:
    """The uniform-cost search of :func:`completion` (see there); one use.

    ``level`` is how much it trusts signatures. 0: states of one signature whose texts are as long
    but for whitespace are one state, except where the signature was met before on the way (a counted
    repetition), where the whole length counts too; 1: states of one signature and text length are one
    state; 2: states of one text are one state (exact: a matcher's state is a function of its text),
    without the shortcuts of the lower levels (the moves that mattered, sibling merging). A level
    that runs out of states below its bound has merged states that differ (the same mask, different
    ways to go on: the values of two optional keys of equal length), and the next one is tried.

    A node's matcher is made (forked from its parent's) only when the node is expanded: a fork costs
    time linear in the tokens accepted, so the moves out of a node are tried on its own matcher and
    rolled back.
    """

    def __init__(
        self,
        matcher: Matcher,
        encode: Encode,
        vocab: ClosingVocab,
        fanout: int,
        level: int,
        hints: list[list[int]],
        names: frozenset[bytes] = frozenset(),
    ) -> None:
        self.encode, self.vocab, self.fanout, self.level = encode, vocab, fanout, level
        self.bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
        self.settled: set[tuple[Signature, int, int, Tail | None]] = set()
        self.queued: dict[tuple[Signature, int, int, Tail | None], int] = {}  # the cheapest cost queued per key
        self.moves: dict[Signature, list[list[int]]] = {}  # per signature, the moves that mattered
        self.root = matcher
        self.hints = hints  # tried wherever free text is allowed
        self.names = names  # keys an object may have to hold (see ``_tail``)
        self.exhausted = False  # the last run found no state left to expand below its bound
        self.expanded = 0  # states expanded by the last run
        self.covers: dict[str, tuple[list[int] | None, list[list[int]]]] = {}  # per forced text, its moves

    def _node(self, parent: _Node | None, ids: list[int], probe: Matcher) -> _Node:
        signature = state_signature(probe, self.bitmask)
        piece = b"".join(self.vocab.pieces[t] for t in ids)
        size = (parent.size if parent else 0) + len(piece)
        cost = (parent.cost if parent else 0) + len(ids)
        if self.level == 2:
            text = parent.text if parent else 0
            for byte in piece:
                text = (text * 257 + byte + 1) % _MODULUS
            return _Node(parent, ids, cost, size, signature, (signature, text, -1, None), text=text)
        # a free text that begins or is a key the schema may require is kept apart from the others of its
        # signature and length: ``{"a`` from ``{"x``, ``{"a": `` from ``{"x": ``, where the masks are
        # alike but only one leads on
        tail = self._tail(parent.tail, piece) if parent else (frozenset(), b"")
        if self.level == 1:
            return _Node(parent, ids, cost, size, signature, (signature, size, -1, tail), tail=tail)
        # states of one signature and one length but for whitespace are one state, whatever the path
        # (so whitespace and the choice of a value do not multiply the search); a signature met before
        # on the way (a counted repetition: the next digit of [0-3]{2}, the next array item) is kept
        # apart from its first state elsewhere by the whole length
        solid = (parent.solid if parent else 0) + len(piece) - sum(piece.count(space) for space in _SPACES)
        repeat = parent is not None and signature in parent.seen
        key = (signature, solid, size if repeat else -1, tail)
        return _Node(parent, ids, cost, size, signature, key, solid=solid, tail=tail)

    def _tail(self, tail: Tail, piece: bytes) -> Tail:
        """``tail`` (see :data:`Tail`) once ``piece`` is written after it (the same where no key is named)."""
        if not self.names:
            return tail
        done, current = tail
        for index, part in enumerate(piece.split(b'"')):
            if index:  # a quote: the text before it ends, a new one begins
                if current is not None and current in self.names:
                    done = done | {current}
                current = b""
            if current is not None and part:
                current += part
                if not any(name.startswith(current) for name in self.names):
                    current = None
        return done, current

    def _moves(self, node: _Node, probe: Matcher) -> list[list[int]]:
        """The moves out of ``node`` (see :func:`completion`), fewest tokens first."""
        if node.signature in self.moves and self.level < 2:  # met before on the way here: the moves that mattered
            return self.moves[node.signature]
        forced = node.signature[0]
        if forced:  # the fewest tokens that spell it, and those that spell it and run past it
            if forced not in self.covers:
                self.covers[forced] = self.vocab.cover(forced.encode(), self.fanout)
            exact, runs_past = self.covers[forced]
            if exact is None:
                chunk = take_forced(probe, forced, self.encode, self.vocab.char_tokens)
                if chunk:
                    probe.rollback(len(chunk))
                exact = chunk
            return sorted(([exact] if exact else []) + runs_past, key=len)
        probe.fill_next_token_bitmask(self.bitmask)
        bits = unpack(self.bitmask[0])  # [32 * ceil(V / 32)] bool
        allowed = np.flatnonzero(bits & (self.vocab.rank >= 0))  # [k] int64
        hints = [ids for ids in self.hints if bits[ids[0]]]
        if len(allowed) > self.fanout:  # free text: its characters
            chars = self.vocab.char_ids[bits[self.vocab.char_ids]]
            allowed = chars if len(chars) else allowed[: self.fanout]
        allowed = allowed[np.argsort(self.vocab.rank[allowed], kind="stable")]
        return [[int(t)] for t in allowed] + hints

    def _known(self, node: _Node) -> bool:
        """Whether ``node``'s key was reached before, as cheaply."""
        return node.key in self.settled or self.queued.get(node.key, node.cost + 1) <= node.cost

    def _expand(self, node: _Node, bound: int) -> tuple[list[_Node], list[list[int]]]:
        """The children of ``node`` worth queueing (one per signature and length, and such that a path on
        from them may cost less than ``bound``), and the cheapest completing paths among its moves if
        they cost less than ``bound`` (several of one cost: their re-tokenized lengths may differ)."""
        parent = node.parent
        if node.probe is None:
            assert parent is not None and parent.probe is not None
            node.probe = parent.probe.fork()
            node.probe.accept_tokens(node.ids)
        probe = node.probe
        node.seen = parent.seen | {node.signature} if parent else frozenset({node.signature})
        looping = node.signature in self.moves
        children: list[_Node] = []
        useful: list[list[int]] = []
        siblings: set[object] = set()
        goals: list[list[int]] = []
        for ids in self._moves(node, probe):
            cost = node.cost + len(ids)
            if cost > bound or (cost == bound and not goals):
                continue
            taken = probe.accept_tokens(ids)
            if taken == len(ids):
                if probe.is_completed():
                    useful.append(ids)
                    goals = [*goals, node.path() + ids] if cost == bound else [node.path() + ids]
                    bound = cost
                elif cost + 1 < bound:  # else nothing on from it is cheaper: no need for its mask
                    child = self._node(node, ids, probe)
                    alike = child.key if self.level == 2 else (child.signature, child.size, child.tail)
                    if alike not in siblings:
                        siblings.add(alike)
                        useful.append(ids)
                        children.append(child)
            probe.rollback(taken)
        if not looping:
            self.moves[node.signature] = useful
        return [c for c in children if c.cost + 1 < bound and not self._known(c)], goals[:_TIES]

    def run(self, bound: int, max_nodes: int, deadline: float | None) -> list[list[int]]:
        """The cheapest completing paths that cost less than ``bound`` tokens (see ``_expand``), expanding
        at most ``max_nodes`` states (counted in :attr:`expanded`) before ``deadline`` (a
        ``time.perf_counter()`` value; None: no time limit); ``[]`` if none was found."""
        probe = self.root.fork()
        if probe.is_completed():
            return [[]]
        root = self._node(None, [], probe)
        root.probe = probe
        order = itertools.count()
        heap: list[tuple[int, int, int, _Node]] = [(0, 0, next(order), root)]
        best: list[list[int]] = []
        while self.expanded < max_nodes:
            if not heap or heap[0][0] + 1 >= bound or (deadline is not None and time.perf_counter() > deadline):
                break
            node = heapq.heappop(heap)[3]
            if node.key in self.settled:
                continue
            self.settled.add(node.key)
            self.expanded += 1
            children, goals = self._expand(node, bound)
            if goals:
                best, bound = goals, len(goals[0])
            for child in children:
                self.queued[child.key] = child.cost
                heapq.heappush(heap, (child.cost, -child.size, next(order), child))
        self.exhausted = not heap
        return best


def completion(
    matcher: Matcher,
    encode: Encode,
    *,
    max_tokens: int = 512,
    max_nodes: int = 20_000,
    max_seconds: float | None = None,
    fanout: int = FANOUT,
    hints: Sequence[str] | None = None,
    fallback: bool = True,
) -> list[int] | None:
    """A short token sequence that completes ``matcher``'s match, at most ``max_tokens`` long; ``[]`` if
    already complete; None if none was found. Does not change ``matcher``.

    A uniform-cost search (fewest tokens first) of at most ``max_nodes`` expansions in all (its levels,
    below, share them); where it finds nothing within them and ``fallback`` (default True; False where
    the caller ran it already), the greedy closing (``max_nodes=0``: the greedy closing alone, for the
    budget's checks during generation), bounded by its own steps
    (:data:`~constrain.match.greedy.TRIES_PER_TOKEN`). The result is deterministic: a function of the
    matcher's state and the arguments. ``max_seconds`` (default None: no time limit) is an extra safety
    for callers that need one, which makes the result depend on the machine's speed: the search and the
    greedy closing each stop after that long. The moves
    out of a state: for forced text, the fewest tokens that spell it and the token sequences that spell
    it and run past its end; else every allowed token where the grammar allows at most ``fanout``, else
    every allowed single-character token (inside a free string, every character); and ``hints``, texts
    worth trying inside free text (None: the constraint's own, :func:`~constrain.match.hints.hints`; the
    greedy closing tries them where it loops). States are merged by their signature (forced text and
    next-token mask) and their text length but for whitespace, so that whitespace and the choice of a
    value do not multiply the search; where the signature was met before on the way (the next digit of
    ``[0-9]{3}``, the next item of an array with ``minItems``), the whole length counts too. The signature
    stands in for the grammar state, which neither engine exposes: where it merges states that differ,
    the search runs out of states and is run again trusting it less (``_Search``); the tests check the
    result against the fewest tokens found by brute force.

    The path is re-tokenized by ``encode`` (a piece of text to ids, no special tokens) where that is
    shorter: the search counts free text character by character, so it looks for paths up to
    :data:`_SLACK` times ``max_tokens`` (plus 16) and keeps one that re-tokenizes to ``max_tokens``.
    """
    matcher = matcher.fork(search=True)  # the search meets dead ends of the value checks, and backs out of them
    vocab = closing_vocab(matcher.compiled.tokenizer)
    spelled = (vocab.cover(text.encode(), 0)[0] for text in (constraint_hints(matcher) if hints is None else hints))
    hinted = [ids for ids in spelled if ids]
    names = frozenset(name.encode() for name in required_keys(matcher))
    limit = _SLACK * max_tokens + 16
    found: list[list[int]] = []
    deadline = None if max_seconds is None else time.perf_counter() + max_seconds
    nodes = max_nodes
    for level in range(3 if max_nodes > 0 else 0):
        search = _Search(matcher, encode, vocab, fanout, level, hinted, names)
        found = search.run(limit + 1, nodes, deadline)
        nodes -= search.expanded
        if found or not search.exhausted:
            break
    if not found and fallback:  # no search, or cut short: the greedy closing
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds
        greedy = greedy_closing(matcher, encode, vocab, limit, hinted, deadline, names)
        found = [greedy] if greedy is not None else []
    best = min((_retokenized(matcher, path, encode) if path else path for path in found), key=len, default=None)
    return best if best is None or len(best) <= max_tokens else None


def _retokenized(matcher: Matcher, path: list[int], encode: Encode) -> list[int]:
    """``path``'s text in the tokenizer's own tokens when that is shorter and completes as well."""
    pieces = closing_vocab(matcher.compiled.tokenizer).pieces
    text = b"".join(pieces[t] for t in path).decode("utf-8", errors="replace")
    ids = encode(text)
    if len(ids) >= len(path):
        return path
    probe = matcher.fork()
    return ids if probe.accept_tokens(ids) == len(ids) and probe.is_completed() else path
