"""Guaranteed termination: the shortest way to finish from a matcher's state, and the budget that uses it.

:func:`completion` finds a token sequence that takes a matcher from its current state to a complete
match, short in tokens: a uniform-cost (Dijkstra) search over the grammar's continuations, where a
move spells the forced text (in the fewest tokens, or running past its end), or is any allowed token
where the grammar allows at most :data:`FANOUT`, else any allowed single-character token. It is
grammar-agnostic, so it serves JSON Schema, regexes, EBNF grammars and choices alike. States are
told apart by a *signature* (the forced text and the next-token mask), which keeps optional
whitespace and the choice of a value from multiplying the search; see :func:`completion` for how
counted repetitions stay apart. Where the search runs out of time, a greedy closing (close strings
and containers first, then the shortest values) is the fallback; it is also the cheap check the
budget makes during generation.

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

import bisect
import heapq
import itertools
import json
import string
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.constraint import JsonSchema, Regex
from constrain.errors import BudgetError
from constrain.match.matcher import Matcher, allocate_token_bitmask

__all__ = ["FANOUT", "NEAR", "Budget", "RepetitionGuard", "completion"]

NEAR = 24
""":class:`Budget` checks every token once the tokens left are at most twice the closing length plus this."""

FANOUT = 32
""":func:`completion` takes every allowed token as a move where the grammar allows at most this many
(structure, enum values, pattern characters), else only the single-character ones (free text)."""

_PRIORITY = '"a}]),0123456789[{ntf:-.eE '
"""Greedy closing: the characters tried first: close a string, else fill it (``a`` is allowed only
inside strings in JSON); close containers and numbers; then the shortest values. The search tries
these first."""

_STREAK = 8
"""Greedy closing: after this many copies of one character in a row, look for an allowed character
that changes the next mask (the ``@`` of an e-mail pattern), else go on."""

_SLACK = 2
""":func:`completion` searches for paths up to this many times ``max_tokens`` long (in its own count:
free text character by character), as re-tokenized they are shorter."""

_TIES = 8
""":func:`completion` re-tokenizes up to this many paths of the cheapest cost found from one state, and keeps
the shortest."""

_ESCAPES = 8
"""Greedy closing: at most this many escapes from loops (each tries every allowed character's mask)."""

Encode = Callable[[str], list[int]]

Signature = tuple[str, int]
"""What a matcher state allows next: its forced text and a hash of its next-token mask (and value digest)."""


@dataclass(frozen=True, slots=True)
class _Vocab:
    char_tokens: dict[str, int]  # one-character texts (ASCII) -> their token id
    pieces: list[bytes]  # per token id, its bytes
    comma_pieces: list[tuple[int, str]]  # (id, text) of the tokens whose text holds a ","
    # [32 * ceil(V / 32)] int64: per token id, its place in the search's move order; -1: never a move
    # (special tokens, empty pieces, ids past the tokenizer)
    rank: np.ndarray
    char_ids: np.ndarray  # [C] int64: the single-character token ids, in move order
    by_piece: dict[bytes, int]  # bytes -> the first token id (in move order) with them
    sorted_pieces: list[bytes]  # the keys of ``by_piece``, sorted (to find the tokens that start with some bytes)
    longest: list[int]  # per first byte, the bytes in the longest piece that starts with it

    def cover(self, text: bytes, limit: int) -> tuple[list[int] | None, list[list[int]]]:
        """The fewest tokens that spell ``text``, and up to ``limit`` token sequences that spell a prefix
        of it and then one token that starts with the rest and runs past its end (fewest tokens first):
        a shortest path over ``text``'s byte offsets."""
        best: list[list[int] | None] = [None] * (len(text) + 1)
        best[0] = []
        runs_past: list[list[int]] = []
        for start in range(len(text)):
            path = best[start]
            if path is None:
                continue
            for end in range(start + 1, min(len(text), start + self.longest[text[start]]) + 1):
                token = self.by_piece.get(text[start:end])
                if token is not None and (best[end] is None or len(path) + 1 < len(best[end] or ())):
                    best[end] = [*path, token]
            # the tokens that start with the rest: unless there are many (free text follows; a short rest
            # such as '"' starts thousands of tokens in a large vocabulary)
            rest = text[start:]
            first = bisect.bisect_right(self.sorted_pieces, rest)  # after ``rest`` itself
            last = bisect.bisect_left(self.sorted_pieces, rest + b"\xff" * self.longest[rest[0]], first)
            if last - first <= 4 * limit:
                runs_past += ([*path, self.by_piece[p]] for p in self.sorted_pieces[first:last] if p.startswith(rest))
        runs_past.sort(key=lambda ids: (len(ids), len(self.pieces[ids[-1]])))
        return best[-1], runs_past[:limit]


VOCAB_CACHE_SIZE = 8
"""Tokenizers whose closing tables are kept (least recently used dropped): a table holds every token's text."""

_vocab_cache: OrderedDict[str, _Vocab] = OrderedDict()
_vocab_lock = threading.Lock()


def _vocab(info: TokenizerInfo) -> _Vocab:
    with _vocab_lock:
        found = _vocab_cache.get(info.fingerprint)
        if found is not None:
            _vocab_cache.move_to_end(info.fingerprint)
    if found is not None:
        return found
    chars: dict[str, int] = {}
    commas: list[tuple[int, str]] = []
    special = set(info.xgr_info.special_token_ids) | set(info.eos_token_ids)
    pieces = list(info.xgr_info.decoded_vocab)
    rank = np.full(32 * ((info.vocab_size + 31) // 32), -1, dtype=np.int64)
    for token_id, raw in enumerate(pieces[: info.vocab_size]):
        if token_id in special or not raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        if len(text) == 1 and text.isascii() and text not in chars:
            chars[text] = token_id
        if "," in text:
            commas.append((token_id, text))
        rank[token_id] = 1_000 + token_id  # multi-character tokens after the characters, by id
    for token_id in chars.values():
        rank[token_id] = 128 + ord(pieces[token_id].decode())
    for place, ch in enumerate(_PRIORITY):
        if ch in chars:
            rank[chars[ch]] = place
    char_ids = np.array(sorted(chars.values(), key=lambda t: rank[t]), dtype=np.int64)
    by_piece: dict[bytes, int] = {}
    for token_id in np.argsort(rank, kind="stable").tolist():
        if rank[token_id] >= 0:
            by_piece.setdefault(pieces[token_id], token_id)
    longest = [0] * 256
    for piece in by_piece:
        longest[piece[0]] = max(longest[piece[0]], len(piece))
    result = _Vocab(chars, pieces, commas, rank, char_ids, by_piece, sorted(by_piece), longest)
    with _vocab_lock:
        _vocab_cache[info.fingerprint] = result
        while len(_vocab_cache) > VOCAB_CACHE_SIZE:
            _vocab_cache.popitem(last=False)
    return result


def _allowed_chars(matcher: Matcher, bitmask: torch.Tensor, chars: dict[str, int]) -> list[str]:
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return [c for c, t in chars.items() if (words[t // 32] >> (t % 32)) & 1]


def _bits(
    # [1, ceil(V / 32)] int32, filled
    bitmask: torch.Tensor,
) -> np.ndarray:
    """The mask as one flag per token id: ``[32 * ceil(V / 32)]`` uint8 (little-endian words)."""
    return np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")


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


def _signature(probe: Matcher, bitmask: torch.Tensor) -> Signature:
    """What ``probe`` allows next: its forced text and a hash of its next-token mask and of what its value
    checks still depend on (fills ``bitmask``)."""
    probe.fill_next_token_bitmask(bitmask)
    return probe.forced_text(), hash((bitmask[0].numpy().tobytes(), probe.value_digest()))


def _escape(
    probe: Matcher,
    pick: int,
    bitmask: torch.Tensor,
    vocab: _Vocab,
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
    allowed = vocab.char_ids[_bits(bitmask)[vocab.char_ids] == 1]
    if not probe.accept_token(pick):
        return None
    looping = _signature(probe, bitmask)
    probe.rollback(1)
    if looping in stuck:
        return None
    for ids in hints:  # the constraint's own examples first: a blind pattern has no other way out
        taken_ids = probe.accept_tokens(ids)
        if taken_ids == len(ids) and (probe.is_completed() or _signature(probe, bitmask) != looping):
            return ids
        probe.rollback(taken_ids)
    best: tuple[int, int, Signature] | None = None  # (times taken, token, where it leads)
    for token in allowed.tolist():
        if token != pick and probe.accept_token(token):
            after = _signature(probe, bitmask)
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


def _advance(probe: Matcher, ids: list[int], bitmask: torch.Tensor) -> bool:
    """Accept ``ids`` on ``probe`` (a search fork) if it can go on after them, else leave it as it was:
    under value checks a dead end allows nothing (``fork(search=True)``); without them every state can
    go on."""
    taken = probe.accept_tokens(ids)
    if taken == len(ids):
        if not probe.checks_values or probe.is_completed():
            return True
        probe.fill_next_token_bitmask(bitmask)
        if bool(bitmask.any()):
            return True
    probe.rollback(taken)
    return False


def _greedy(
    matcher: Matcher, encode: Encode, vocab: _Vocab, max_tokens: int, hints: list[list[int]], deadline: float
) -> list[int] | None:
    chars = vocab.char_tokens
    bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
    priority = [chars[c] for c in _PRIORITY if c in chars]
    moves = [[t] for t in priority[:1]] + hints + [[t] for t in priority[1:]]  # a string's closing quote first
    probe, out = matcher.fork(), list[int]()
    streak = 0
    stuck: set[Signature] = set()  # loops no character leads out of
    taken: dict[Signature, int] = {}  # where escapes from loops led, how often
    escapes = 0
    while len(out) <= max_tokens and (len(out) % 16 or time.perf_counter() < deadline):
        if probe.is_completed():
            return out
        forced = probe.forced_text()
        ids = _take_forced(probe, forced, encode, chars) if forced else None
        if ids:
            out += ids
            streak = 0
            continue
        if streak >= _STREAK and escapes < _ESCAPES:  # one character again and again: free text, or a loop
            escaped = _escape(probe, out[-1], bitmask, vocab, hints, stuck, taken)
            streak, escapes = 0, escapes + 1
            if escaped is not None:
                out += escaped
                continue
        # try the priority characters in turn, not into a dead end of the value checks ("a where the
        # array holds "a" already); where a string cannot close yet, the constraint's own examples before
        # the other characters (a date: 2000-01-01, where 0000-... has no valid day)
        pick = next((ids for ids in moves if _advance(probe, ids, bitmask)), None)
        if pick is None:
            allowed = [[chars[c]] for c in sorted(_allowed_chars(probe, bitmask, chars))]
            pick = next((ids for ids in allowed if _advance(probe, ids, bitmask)), None)
            if pick is None:
                return None
        streak = streak + 1 if out and pick == out[-1:] else 1
        out += pick
    return None


_FORMATS = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z", "duration": "P1D",
    "email": "a@a.aa", "idn-email": "a@a.aa", "hostname": "a", "idn-hostname": "a", "ipv4": "0.0.0.0",
    "ipv6": "::1", "uri": "a:a", "iri": "a:a", "uri-reference": "a", "iri-reference": "a",
    "uuid": "00000000-0000-0000-0000-000000000000",
}  # fmt: skip
"""A short valid string per JSON Schema ``format`` (a hint for the search, checked by the matcher)."""

_HINTS = 32
"""The most hints :func:`completion` takes from one constraint."""

_CANDIDATES = "a0A_-.:/@ " + string.printable


def _example(pattern: str) -> str | None:
    """A short string that ``pattern`` matches (the fewest repeats, the shortest branch), or None.

    Built from the pattern's syntax tree as Python's ``re`` parses it (lookarounds ignored): a guess
    the matcher checks, not a proof.
    """
    try:
        from re import _parser  # type: ignore[attr-defined,unused-ignore]  # the stdlib's regex parser (3.11+)

        tree = _parser.parse(pattern)
    except Exception:  # a pattern Python cannot parse, or another Python: no example
        return None
    groups: dict[int, str] = {}

    def matches(ch: str, items: list[tuple[Any, Any]]) -> bool:
        found, negate = False, False
        for op, arg in items:
            kind = str(op)
            if kind == "NEGATE":
                negate = True
            elif kind == "LITERAL":
                found |= ord(ch) == arg
            elif kind == "RANGE":
                found |= arg[0] <= ord(ch) <= arg[1]
            elif kind == "CATEGORY":
                name = str(arg)
                test = (
                    ch.isdigit() if "DIGIT" in name else ch.isspace() if "SPACE" in name else ch.isalnum() or ch == "_"
                )
                found |= test != ("NOT" in name)
        return found != negate

    def walk(seq: Any) -> str | None:
        out: list[str] = []
        for op, arg in seq:
            kind = str(op)
            piece: str | None = ""
            if kind == "LITERAL":
                piece = chr(arg)
            elif kind in ("NOT_LITERAL", "ANY", "IN", "CATEGORY"):
                items = {"NOT_LITERAL": [("NEGATE", None), ("LITERAL", arg)], "ANY": [("NEGATE", None)]}.get(
                    kind, arg if kind == "IN" else [(op, arg)]
                )
                piece = next((ch for ch in _CANDIDATES if ch != "\n" and matches(ch, items)), None)
            elif kind.endswith("_REPEAT"):
                sub = walk(arg[2])
                piece = None if sub is None else sub * arg[0]
            elif kind == "SUBPATTERN":
                piece = walk(arg[3])
                if piece is not None and arg[0] is not None:
                    groups[arg[0]] = piece
            elif kind == "ATOMIC_GROUP":
                piece = walk(arg)
            elif kind == "BRANCH":
                options = [text for text in map(walk, arg[1]) if text is not None]
                piece = min(options, key=len) if options else None
            elif kind == "GROUPREF":
                piece = groups.get(arg, "")
            elif kind not in ("AT", "ASSERT", "ASSERT_NOT"):
                return None
            if piece is None:
                return None
            out.append(piece)
        return "".join(out)

    return walk(tree)


def _hints(matcher: Matcher) -> list[str]:
    """Texts worth trying inside free text, from the constraint itself: the shortest examples of its
    regexes (a JSON Schema's ``pattern`` strings, as JSON string content) and of its ``format`` strings.

    Where a string must match a pattern, the masks alone may not show which character leads out (the
    suffix of ``[A-Z_]+(_DEVICE|_LAYOUT)``, an unanchored pattern): without these the search is blind.
    """
    compiled = matcher.compiled
    constraint = compiled.constraint
    if isinstance(constraint, Regex):
        found = _example(constraint.pattern)
        return [found] if found else []
    if not isinstance(constraint, JsonSchema):
        return []

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found = _example(node["pattern"])
                if found is not None:
                    yield json.dumps(found)[1:-1]
            if isinstance(node.get("format"), str) and node["format"] in _FORMATS:
                yield _FORMATS[node["format"]]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    schema = compiled.engine_schema if compiled.engine_schema is not None else constraint.schema_value
    return list(itertools.islice(dict.fromkeys(text for text in walk(schema) if text), _HINTS))


@dataclass(slots=True, eq=False)
class _Node:
    """One state of the closing search: where ``ids`` lead from ``parent``."""

    parent: _Node | None
    ids: list[int]
    cost: int  # tokens from the start
    size: int  # bytes of text from the start
    signature: Signature
    key: tuple[Signature, int, int]  # what the search deduplicates by (see ``_Search._node``)
    solid: int = 0  # bytes of text but for whitespace (``_Search`` level 0)
    text: int = 0  # a hash of the text from the start (``_Search`` level 2)
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
        self, matcher: Matcher, encode: Encode, vocab: _Vocab, fanout: int, level: int, hints: list[list[int]]
    ) -> None:
        self.encode, self.vocab, self.fanout, self.level = encode, vocab, fanout, level
        self.bitmask = allocate_token_bitmask(1, matcher.compiled.vocab_size)
        self.settled: set[tuple[Signature, int, int]] = set()
        self.queued: dict[tuple[Signature, int, int], int] = {}  # the cheapest cost queued per key
        self.moves: dict[Signature, list[list[int]]] = {}  # per signature, the moves that mattered
        self.root = matcher
        self.hints = hints  # tried wherever free text is allowed
        self.exhausted = False  # the last run found no state left to expand below its bound
        self.covers: dict[str, tuple[list[int] | None, list[list[int]]]] = {}  # per forced text, its moves

    def _node(self, parent: _Node | None, ids: list[int], probe: Matcher) -> _Node:
        signature = _signature(probe, self.bitmask)
        piece = b"".join(self.vocab.pieces[t] for t in ids)
        size = (parent.size if parent else 0) + len(piece)
        cost = (parent.cost if parent else 0) + len(ids)
        if self.level == 2:
            text = parent.text if parent else 0
            for byte in piece:
                text = (text * 257 + byte + 1) % _MODULUS
            return _Node(parent, ids, cost, size, signature, (signature, text, -1), text=text)
        if self.level == 1:
            return _Node(parent, ids, cost, size, signature, (signature, size, -1))
        # states of one signature and one length but for whitespace are one state, whatever the path
        # (so whitespace and the choice of a value do not multiply the search); a signature met before
        # on the way (a counted repetition: the next digit of [0-3]{2}, the next array item) is kept
        # apart from its first state elsewhere by the whole length
        solid = (parent.solid if parent else 0) + len(piece) - sum(piece.count(space) for space in _SPACES)
        repeat = parent is not None and signature in parent.seen
        return _Node(parent, ids, cost, size, signature, (signature, solid, size if repeat else -1), solid=solid)

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
                chunk = _take_forced(probe, forced, self.encode, self.vocab.char_tokens)
                if chunk:
                    probe.rollback(len(chunk))
                exact = chunk
            return sorted(([exact] if exact else []) + runs_past, key=len)
        probe.fill_next_token_bitmask(self.bitmask)
        bits = _bits(self.bitmask)
        allowed = np.flatnonzero(bits & (self.vocab.rank >= 0))
        hints = [ids for ids in self.hints if bits[ids[0]]]
        if len(allowed) > self.fanout:  # free text: its characters
            chars = self.vocab.char_ids[bits[self.vocab.char_ids] == 1]
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
                    alike = child.key if self.level == 2 else (child.signature, child.size)
                    if alike not in siblings:
                        siblings.add(alike)
                        useful.append(ids)
                        children.append(child)
            probe.rollback(taken)
        if not looping:
            self.moves[node.signature] = useful
        return [c for c in children if c.cost + 1 < bound and not self._known(c)], goals[:_TIES]

    def run(self, bound: int, max_nodes: int, deadline: float) -> list[list[int]]:
        """The cheapest completing paths that cost less than ``bound`` tokens (see ``_expand``); ``[]`` if
        none was found."""
        probe = self.root.fork()
        if probe.is_completed():
            return [[]]
        root = self._node(None, [], probe)
        root.probe = probe
        order = itertools.count()
        heap: list[tuple[int, int, int, _Node]] = [(0, 0, next(order), root)]
        best: list[list[int]] = []
        for _ in range(max_nodes):
            if not heap or heap[0][0] + 1 >= bound or time.perf_counter() > deadline:
                break
            node = heapq.heappop(heap)[3]
            if node.key in self.settled:
                continue
            self.settled.add(node.key)
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
    max_seconds: float = 1.0,
    fanout: int = FANOUT,
    hints: Sequence[str] | None = None,
) -> list[int] | None:
    """A short token sequence that completes ``matcher``'s match, at most ``max_tokens`` long; ``[]`` if
    already complete; None if none was found. Does not change ``matcher``.

    A uniform-cost search (fewest tokens first) of at most ``max_nodes`` expansions and ``max_seconds``;
    where it finds nothing in that time, the greedy closing, within ``max_seconds`` of its own
    (``max_nodes=0``: the greedy closing alone, for the budget's checks during generation). The moves
    out of a state: for forced text, the fewest tokens that spell it and the token sequences that spell
    it and run past its end; else every allowed token where the grammar allows at most ``fanout``, else
    every allowed single-character token (inside a free string, every character); and ``hints``, texts
    worth trying inside free text (None: the constraint's own, see ``_hints``; the greedy closing tries
    them where it loops). States are merged by their signature (forced text and next-token mask) and
    their text length but for whitespace, so that whitespace and the choice of a value do not multiply
    the search; where the signature was met before on the way (the next digit of ``[0-9]{3}``, the next
    item of an array with ``minItems``), the whole length counts too. The signature stands in for the
    grammar state, which neither engine exposes: where it merges states that differ, the search runs out
    of states and is run again trusting it less (``_Search``); the tests check the result against the
    fewest tokens found by brute force.

    The path is re-tokenized by ``encode`` (a piece of text to ids, no special tokens) where that is
    shorter: the search counts free text character by character, so it looks for paths up to
    :data:`_SLACK` times ``max_tokens`` (plus 16) and keeps one that re-tokenizes to ``max_tokens``.
    """
    matcher = matcher.fork(search=True)  # the search meets dead ends of the value checks, and backs out of them
    vocab = _vocab(matcher.compiled.tokenizer)
    spelled = (vocab.cover(text.encode(), 0)[0] for text in (_hints(matcher) if hints is None else hints))
    hinted = [ids for ids in spelled if ids]
    limit = _SLACK * max_tokens + 16
    found: list[list[int]] = []
    deadline = time.perf_counter() + max_seconds
    for level in range(3 if max_nodes > 0 else 0):
        search = _Search(matcher, encode, vocab, fanout, level, hinted)
        found = search.run(limit + 1, max_nodes, deadline)
        if found or not search.exhausted:
            break
    if not found:  # no search, or cut short: the greedy closing
        greedy = _greedy(matcher, encode, vocab, limit, hinted, time.perf_counter() + max_seconds)
        found = [greedy] if greedy is not None else []
    best = min((_retokenized(matcher, path, encode) if path else path for path in found), key=len, default=None)
    return best if best is None or len(best) <= max_tokens else None


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
    matcher's (initial) state fits in ``max_tokens``: the greedy closing does not fit, and the search
    of :func:`completion` finds none that does (it searches every state below the budget unless it
    runs out of time first: 1 s by default, on grammars whose masks are slow or whose signatures
    merge states that differ).
    """

    REFRESH_EVERY = 8
    """Far from the end, the closing length is re-estimated every this many tokens."""

    GREEDY_SECONDS = 0.05
    """Mid-generation, the greedy closing gives up after this long (it can wander where value checks
    refuse its short values)."""

    SEARCH_SECONDS = 0.02
    """When the greedy closing fails mid-generation, :func:`completion` searches this long (then not
    again for :data:`REFRESH_EVERY` tokens, if it found nothing)."""

    CHECKED_SEARCH_SECONDS = 0.1
    """Likewise under value checks, where the greedy closing fails more often (its short values can be
    refused), and a failed search refuses the model's token."""

    def __init__(self, matcher: Matcher, encode: Encode, max_tokens: int, *, initial: bool = False) -> None:
        """``initial``: ``matcher`` is in its constraint's initial state, so the closing path found
        is kept on the compiled constraint for the next request (``encode`` must be its tokenizer's)."""
        self.matcher = matcher
        self.encode = encode
        self.forced = 0  # tokens taken from the closing path instead of the sampled one, near the end
        self.steered = 0  # likewise far from the end: the sampled token left no completion that could be found
        self.hints = _hints(matcher)  # for every completion() of this request
        closings = matcher.compiled.initial_closings
        if initial and max_tokens in closings:
            plan = closings[max_tokens]
        else:
            plan = completion(matcher, encode, max_tokens=max_tokens, max_nodes=0, hints=self.hints)
            if plan is None or len(plan) > max_tokens:
                plan = completion(matcher, encode, max_tokens=max_tokens, hints=self.hints)
            if initial:
                closings[max_tokens] = plan
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
