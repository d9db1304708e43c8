"""Per-tokenizer vocabulary tables: every token's bytes, and the tables the closing search moves by.

Reading the vocabulary out of the engine takes 0.4 s on a 50k-token tokenizer (1.2 s on Gemma 3's
262k), so it is read once per machine and tokenizer and kept in a file (:func:`token_texts`), and
every table is derived from it, with numpy: the key scanner's
(:func:`key_vocab`, :mod:`constrain.match.keys`), the value scanner's (:func:`value_vocab`,
:mod:`constrain.match.values`) and the closing search's (:func:`closing_vocab`,
:mod:`constrain.match.closing`); the repetition guard and the repeated-call filter derive theirs.
Each table is cached per :class:`~constrain.backends.tokenizer.TokenizerInfo` (by identity:
:func:`~constrain.backends.tokenizer.tokenizer_info` returns one per tokenizer), bounded and reported
in :func:`constrain.caches.stats`; a table is immutable, so requests and threads share it. The JSON
scanners' and the closing search's are built on a thread of their own once the info is made
(:func:`~constrain.backends.tokenizer.prepare_with`): each is built once, and a request that asks for
one meanwhile waits for that build.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from constrain.backends.tokenizer import TokenizerInfo, prepare_with
from constrain.caches import bounded
from constrain.match.bitmask import pack
from constrain.match.lengths import token_lengths
from constrain.models.loading import cache_dir

__all__ = [
    "PRIORITY",
    "TOKENIZERS_KEPT",
    "ClosingVocab",
    "KeyVocab",
    "TokenTexts",
    "ValueVocab",
    "closing_vocab",
    "key_vocab",
    "token_texts",
    "value_vocab",
]

TOKENIZERS_KEPT = 8
"""Tokenizers whose tables each cache keeps (least recently used dropped): a table holds every token's bytes."""

PRIORITY = '"a}]),0123456789ntf[{:-.eE '
"""The characters a closing tries first: close a string, else fill it (``a`` is allowed only inside
strings in JSON); close containers and numbers; then the shortest values. Both the search's move
order (:attr:`ClosingVocab.rank`) and the greedy closing follow it."""


@dataclass(frozen=True, slots=True)
class TokenTexts:
    """Every token's bytes, as the engine decodes them."""

    # (tuples, here and below: the collector leaves a tuple of bytes or ints alone once it has seen it, where
    # it would walk a list's tens of thousands of items at every full collection)
    pieces: tuple[bytes, ...]  # per token id the tokenizer has (special tokens included), its bytes
    # per token id up to the model's vocab_size (at least), its bytes; b"" for the special tokens
    # and for the ids past the tokenizer (padded embeddings)
    texts: tuple[bytes, ...]
    special: frozenset[int]  # the tokenizer's special token ids (EOS ids are ``info.eos_token_ids``)
    data: np.ndarray  # [N] uint8: ``texts`` end to end (what the tables below are computed from, vectorized)
    owner: np.ndarray  # [N] int64: per byte of ``data``, the token id it belongs to
    starts: np.ndarray  # [V] int64: where each token's text starts in ``data``
    lengths: np.ndarray  # [V] int64: each token's text, in bytes

    def per_token(
        self,
        # [N] bool: a property of each byte of ``data``
        flags: np.ndarray,
    ) -> np.ndarray:
        """How many bytes of each token's text have ``flags`` set: [V] int64."""
        return np.bincount(self.owner[flags], minlength=len(self.texts))


@bounded("match.vocab.token_texts", maxsize=TOKENIZERS_KEPT, serial=True)
def token_texts(info: TokenizerInfo) -> TokenTexts:
    """The token texts of ``info``'s tokenizer (cached: see the module docstring).

    Read out of the engine once per machine and tokenizer, then from a file under
    :func:`~constrain.models.loading.cache_dir` (``vocab/``, named by the tokenizer's fingerprint and the
    engine's version): 20 ms (SmolLM2) to 60-100 ms (Gemma 3) instead of 0.4 s to 1.2 s, on a 2-core Intel
    Xeon (family 6 model 207). Where that folder cannot be written, each process reads the engine.
    """
    xgr_info = info.xgr_info
    special = frozenset(xgr_info.special_token_ids)
    what = (info.fingerprint, xgr_info.vocab_type, xgr_info.add_prefix_space, _engine_version())
    path = cache_dir() / "vocab" / f"{hashlib.sha256(repr(what).encode()).hexdigest()[:32]}.npz"
    pieces = _read_pieces(path)
    if pieces is None:
        pieces = [bytes(piece) for piece in xgr_info.decoded_vocab]
        _write_pieces(path, pieces)
    texts = [b"" if i in special else piece for i, piece in enumerate(pieces)]
    texts += [b""] * (info.vocab_size - len(texts))
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))  # [V]
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)  # [N]
    owner = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)  # [N]
    return TokenTexts(tuple(pieces), tuple(texts), special, data, owner, np.cumsum(lengths) - lengths, lengths)


@bounded("match.vocab.engine_version", maxsize=1)
def _engine_version() -> str:
    """xgrammar's version, which decodes the texts (its ``_version`` module: the package metadata takes
    0.5 s to find on a large environment)."""
    try:
        from xgrammar._version import version
    except ImportError:
        from importlib.metadata import version as of

        return of("xgrammar")
    return str(version)


def _read_pieces(path: Path) -> list[bytes] | None:
    """The pieces :func:`_write_pieces` saved at ``path``, or None where there is no readable file."""
    try:
        with path.open("rb") as f, np.load(f) as saved:  # the file closed even where numpy fails
            data = saved["data"].tobytes()  # every piece, end to end
            ends = saved["ends"].tolist()  # [n] int64: where each piece ends in ``data``
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # none, or not whole
        return None
    return [data[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _write_pieces(path: Path, pieces: list[bytes]) -> None:
    """Save ``pieces`` at ``path`` (written whole, then renamed: readers see no half file); nothing
    where the folder cannot be written."""
    ends = np.cumsum([len(piece) for piece in pieces], dtype=np.int64)  # [n]
    temp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
            temp = Path(f.name)
            np.savez(f, data=np.frombuffer(b"".join(pieces), dtype=np.uint8), ends=ends)
        os.replace(temp, path)
    except OSError:
        if temp is not None:
            temp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class ClosingVocab:
    """The tables the closing search (:mod:`constrain.match.closing`) moves by."""

    char_tokens: dict[str, int]  # one-character texts (ASCII) -> their token id
    pieces: tuple[bytes, ...]  # per token id, its bytes (``TokenTexts.pieces``)
    # [32 * ceil(V / 32)] int64: per token id, its place in the search's move order; -1: never a move
    # (special and EOS tokens, empty pieces, ids past the tokenizer)
    rank: np.ndarray
    char_ids: np.ndarray  # [C] int64: the single-character token ids, in move order
    by_piece: dict[bytes, int]  # bytes -> the first token id (in move order) with them
    sorted_pieces: tuple[bytes, ...]  # the keys of ``by_piece``, sorted (to find the tokens that start with some bytes)
    longest: tuple[int, ...]  # per first byte, the bytes in the longest piece that starts with it

    def cover(self, text: bytes, limit: int) -> tuple[list[int] | None, list[list[int]]]:
        """The fewest tokens that spell ``text`` (None: no tokens do), and up to ``limit`` token sequences
        that spell a prefix of it and then one token that starts with the rest and runs past its end
        (fewest tokens first): a shortest path over ``text``'s byte offsets."""
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


@bounded("match.vocab.closing", maxsize=TOKENIZERS_KEPT, serial=True)
def closing_vocab(info: TokenizerInfo) -> ClosingVocab:
    """The closing search's tables for ``info``'s tokenizer (cached: see the module docstring).

    The move order: the :data:`PRIORITY` characters, then the other single-character tokens by
    character, then every other token by id.
    """
    vocab = token_texts(info)
    pieces, size = vocab.pieces, info.vocab_size
    lengths = vocab.lengths[:size]  # [V] int64: 0 for the special tokens, whose texts are b""
    moves = lengths > 0
    moves[[t for t in info.eos_token_ids if t < size]] = False
    rank = np.full(32 * ((size + 31) // 32), -1, dtype=np.int64)  # [32 * ceil(V / 32)]
    rank[:size][moves] = 1_000 + np.flatnonzero(moves)  # multi-character tokens after the characters, by id
    ones = np.flatnonzero(moves & (lengths == 1))  # [O] one-byte texts
    chars: dict[str, int] = {}
    for token_id in ones[vocab.data[vocab.starts[ones]] < 128].tolist():  # the first id of each ASCII character
        chars.setdefault(pieces[token_id].decode(), token_id)
    for ch, token_id in chars.items():
        rank[token_id] = 128 + ord(ch)
    for place, ch in enumerate(PRIORITY):
        if ch in chars:
            rank[chars[ch]] = place
    char_ids = np.array(sorted(chars.values(), key=lambda t: rank[t]), dtype=np.int64)  # [C]
    in_order = np.argsort(rank, kind="stable")[np.count_nonzero(rank < 0) :].tolist()  # the moves, first first
    by_piece: dict[bytes, int] = {}
    for token_id in in_order:
        by_piece.setdefault(pieces[token_id], token_id)
    ids = np.fromiter(by_piece.values(), dtype=np.int64, count=len(by_piece))  # [P]
    longest = np.zeros(256, dtype=np.int64)
    np.maximum.at(longest, vocab.data[vocab.starts[ids]], lengths[ids])
    return ClosingVocab(chars, pieces, rank, char_ids, by_piece, tuple(sorted(by_piece)), tuple(longest.tolist()))


@dataclass(frozen=True, slots=True)
class KeyVocab:
    """The key scanner's tables (:mod:`constrain.match.keys`)."""

    texts: tuple[bytes, ...]  # per token id, its bytes (b"" for special tokens): ``TokenTexts.texts``
    sorted_texts: tuple[bytes, ...]  # the non-empty texts, sorted (prefix search)
    sorted_ids: tuple[int, ...]  # the token id of each sorted text
    multi_quote: tuple[np.ndarray, np.ndarray]  # [m] int64: ids of the tokens holding two or more '"'; three or more
    # the tokens that may start an object's next key, by (from inside a string, only those that may begin
    # one after the ',', only those holding '}' or ']'): [c] int64 ids holding a ','; from inside a string,
    # a '"' too (to close it); beginning a key: a '"' and more after the ','; holding a closer: they may
    # leave the innermost container first
    after_comma: dict[tuple[bool, bool, bool], np.ndarray]
    # the tokens that open a key where one may start: '"' first, after any whitespace; their texts from
    # that '"' on, sorted (prefix search), and the ids of each; and the tokens as bitmask words
    key_sorted_texts: tuple[bytes, ...]
    key_sorted_ids: tuple[int, ...]
    key_start: np.ndarray  # [ceil(V / 32)] int32
    # per (inside a key, its text so far, the known keys left that it may become): the ids of the tokens
    # that go on writing one of them (``KeyState``'s prefix searches, kept: objects of a schema recur);
    # starts over at KEPT_KEYS entries (thread-safe: what two threads build is equal)
    kept: dict[tuple[bool, bytes, frozenset[bytes]], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False
    )


_COMMA_KEY = re.compile(rb',[^"]*"[^"]')
_STRING_COMMA_KEY = re.compile(rb'"[^,]*,[^"]*"[^"]')


@bounded("match.vocab.keys", maxsize=TOKENIZERS_KEPT, serial=True)
def key_vocab(info: TokenizerInfo) -> KeyVocab:
    """The key scanner's tables for ``info``'s tokenizer (cached: see the module docstring)."""
    vocab = token_texts(info)
    texts = vocab.texts
    order = sorted(np.flatnonzero(vocab.lengths).tolist(), key=texts.__getitem__)  # stable: equal texts by id
    quotes = vocab.per_token(vocab.data == ord('"'))  # [V]
    multi = (np.flatnonzero(quotes >= 2), np.flatnonzero(quotes >= 3))  # [m] int64 each
    commas = vocab.per_token(vocab.data == ord(",")) > 0  # [V] bool
    closing = vocab.per_token((vocab.data == ord("}")) | (vocab.data == ord("]"))) > 0  # [V] bool
    begins = {  # [V] bool: may begin a key after a ',' (from inside a string or not)
        in_string: np.array([bool(pattern.search(text)) for text in texts])
        for in_string, pattern in ((False, _COMMA_KEY), (True, _STRING_COMMA_KEY))
    }
    after_comma = {
        (in_string, key, closer): np.flatnonzero(
            (begins[in_string] if key else commas & ((quotes > 0) | (not in_string))) & (closing | (not closer))
        )
        for in_string in (False, True)
        for key in (False, True)
        for closer in (False, True)
    }
    opening = {i: text.lstrip(b" \t\n\r") for i, text in enumerate(texts) if text.lstrip(b" \t\n\r")[:1] == b'"'}
    key_order = sorted(opening, key=opening.__getitem__)
    starts = np.zeros(-(-len(texts) // 32) * 32, dtype=bool)  # [32 * ceil(V / 32)]
    starts[key_order] = True
    return KeyVocab(
        texts, tuple(texts[i] for i in order), tuple(order), multi, after_comma,
        tuple(opening[i] for i in key_order), tuple(key_order), pack(starts),
    )  # fmt: skip


KEPT_KEYS = 4096
"""Entries of :attr:`KeyVocab.kept` (each the ids of the tokens that may go on writing a key)."""

LENGTH_TAILS = 64
"""Unsettled string tails (an escape or a character begun) whose token lengths a :class:`ValueVocab` keeps."""

_CLOSERS = np.frombuffer(b",]}", dtype=np.uint8)
_WHITESPACE = np.frombuffer(b" \t\n\r", dtype=np.uint8)
_NUMBER_STARTS = np.frombuffer(b"-.0123456789", dtype=np.uint8)
_VALUE_STARTS = np.frombuffer(b'"-0123456789tfn[{', dtype=np.uint8)
_SPACES = re.compile(rb"[ \t\n\r]+")  # a whitespace run (``ValueVocab.parts``)


@dataclass(frozen=True, slots=True)
class ValueVocab:
    """The value scanner's tables (:mod:`constrain.match.values`): per token, its bytes; and the ids of
    the tokens that can complete a value, per scanner mode."""

    texts: tuple[bytes, ...]  # per token id, its bytes (b"" for special tokens): ``TokenTexts.texts``
    quote: np.ndarray  # [q] int64: ids holding '"' (in a string: they may close it)
    quote_closer: np.ndarray  # [qc] int64: ids holding '"' and a closer (close a string, then a container)
    value_end: np.ndarray  # [e] int64: a closer, two '"' or whitespace after other text (outside strings)
    key_end: np.ndarray  # [k] int64: ``value_end`` with a '"' (in a key: close it, then complete a value)
    closer: np.ndarray  # [c] int64: ids holding ',', ']' or '}'
    spaced: np.ndarray  # [s] int64: ``value_end`` or any whitespace (in a scalar: end it)
    numeric: np.ndarray  # [n] int64: a '-', '.' or digit first, after any whitespace (start or extend a number)
    spaced_numeric: np.ndarray  # [sn] int64: ``spaced`` or ``numeric`` (in a number under check)
    value_end_numeric: np.ndarray  # [en] int64: ``value_end`` or ``numeric`` (where a number under check may start)
    value_begin: np.ndarray  # [b] int64: ``value_end`` or a value's first byte first, after any whitespace
    # per id(table) of the tables above, ``[V]`` bytes of 0 or 1: whether the table holds a token, in O(1)
    members: dict[int, bytes] = field(init=False, repr=False, compare=False)
    # per id(table), ``[ceil(V / 32)]`` uint32: the table as bitmask words (a row's members counted at once)
    words: dict[int, np.ndarray] = field(init=False, repr=False, compare=False)
    # built on first use (:meth:`longer_than`): per unsettled tail of a string, ``[V]`` int32 the characters
    # each token adds (:func:`~constrain.match.lengths.token_lengths`), and per (tail, room) the tokens that
    # add more, as bitmask words (None: no token does)
    lengths: dict[bytes, np.ndarray] = field(init=False, repr=False, compare=False)
    longer: dict[tuple[bytes, int], np.ndarray | None] = field(init=False, repr=False, compare=False)
    # filled as tokens are asked about (:meth:`parts`, at most two entries a token; the MaskBench sample's
    # 400 schemas asked about 136 of SmolLM2's): per (token id, inside a string or key), its parts
    split: dict[tuple[int, bool], tuple[bool, bytes, bytes]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        members, words = {}, {}
        for ids in (getattr(self, entry.name) for entry in fields(self) if entry.init):
            if not isinstance(ids, np.ndarray):
                continue
            table = np.zeros(-(-len(self.texts) // 32) * 32, dtype=np.uint8)  # [32 * ceil(V / 32)]
            table[ids] = 1
            members[id(ids)] = table[: len(self.texts)].tobytes()
            words[id(ids)] = np.packbits(table, bitorder="little").view(np.uint32)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "lengths", {})
        object.__setattr__(self, "longer", {})
        object.__setattr__(self, "split", {})

    def parts(self, token: int, inside: bool) -> tuple[bool, bytes, bytes]:
        """Token ``token``'s text in the two parts the value checks scan apart, read inside a string or key
        (``inside``) or not: whether it holds an escape there (then it is scanned whole, as its head); its
        head, up to and with the quote that closes the string or key (b"" outside); and the rest, whose
        whitespace runs are one space each unless it holds a quote (outside strings, texts differing in
        whitespace alone act alike). Worked out once per token."""
        found = self.split.get((token, inside))
        if found is None:
            text = self.texts[token]
            escaped = inside and b"\\" in text
            cut = ((0 if escaped else text.find(b'"') + 1) or len(text)) if inside else 0
            rest = text[cut:]
            found = self.split[token, inside] = (escaped, text[:cut], rest if b'"' in rest else _SPACES.sub(b" ", rest))
        return found

    def holds(
        self,
        # [n] int64: one of this vocabulary's tables
        ids: np.ndarray,
        token: int,
    ) -> bool:
        """Whether ``ids`` (a table of this vocabulary) holds ``token``."""
        table = self.members[id(ids)]
        return token < len(table) and table[token] == 1

    def longer_than(self, room: int, tail: bytes = b"") -> np.ndarray | None:
        """``[ceil(V / 32)]`` int32 bitmask words: the tokens that add more than ``room`` characters to a
        string whose text ends in the unsettled piece ``tail`` (b"": settled; see
        :mod:`~constrain.match.lengths`), up to a closing quote; ``room`` < 0: every token. None where no
        token does. Built on first use, then kept: the lengths per tail (at most :data:`LENGTH_TAILS`;
        for SmolLM2's 49,152 tokens, 8 ms for the settled text and 175 ms for a tail, Intel Xeon family 6
        model 167), the words per tail and room (thread-safe: what two threads build is equal)."""
        lengths = self.lengths.get(tail)
        if lengths is None:
            if len(self.lengths) >= LENGTH_TAILS:
                self.lengths.clear()
                self.longer.clear()
            lengths = self.lengths[tail] = token_lengths(self.texts, tail)  # [V] int32
        room = min(max(room, -1), int(lengths.max(initial=0)))  # (every room past the longest token alike)
        key = (tail, room)
        if key not in self.longer:
            over = np.zeros(-(-len(self.texts) // 32) * 32, dtype=bool)  # [32 * ceil(V / 32)]
            over[: len(lengths)] = lengths > room
            self.longer[key] = pack(over) if over.any() else None
        return self.longer[key]

    def count_among(
        self,
        # [ceil(V' / 32)] int32: a mask row (V' >= V: padding ids past the tokenizer's hold no table's token)
        row: np.ndarray,
        # [n] int64: one of this vocabulary's tables
        ids: np.ndarray,
    ) -> int:
        """How many tokens of ``ids`` (a table of this vocabulary) ``row`` allows: ``len(allowed_among(row,
        ids))`` in one pass over the row's words."""
        table = self.words[id(ids)]  # [ceil(V / 32)] uint32
        return int(np.bitwise_count(row.view(np.uint32)[: len(table)] & table).sum())


@bounded("match.vocab.values", maxsize=TOKENIZERS_KEPT, serial=True)
def value_vocab(info: TokenizerInfo) -> ValueVocab:
    """The value scanner's tables for ``info``'s tokenizer (cached: see the module docstring)."""
    vocab = token_texts(info)
    data, owner = vocab.data, vocab.owner  # [N] uint8, [N] int64
    blank = np.isin(data, _WHITESPACE)  # [N] bool
    # per token, where its text starts once leading whitespace is skipped (its end where all is blank)
    lead = vocab.starts + vocab.lengths  # [V]
    solid = np.flatnonzero(~blank)  # [S]: the byte offsets of the other bytes
    firsts = solid[np.r_[True, owner[solid[1:]] != owner[solid[:-1]]]] if len(solid) else solid
    lead[owner[firsts]] = firsts
    inner_blank = blank & (np.arange(len(data)) > lead[owner])  # [N]: whitespace after other text
    quote = vocab.per_token(data == ord('"'))  # [V] int64
    closes = vocab.per_token(np.isin(data, _CLOSERS)) > 0  # [V] bool
    end = closes | (quote >= 2) | (vocab.per_token(inner_blank) > 0)
    spaced = end | (lead > vocab.starts)
    has_lead = lead < vocab.starts + vocab.lengths  # [V]
    numeric = np.zeros(len(vocab.texts), dtype=bool)
    numeric[has_lead] = np.isin(data[lead[has_lead]], _NUMBER_STARTS)
    begins = np.zeros(len(vocab.texts), dtype=bool)
    begins[has_lead] = np.isin(data[lead[has_lead]], _VALUE_STARTS)
    quote = quote > 0

    def ids(test: np.ndarray) -> np.ndarray:  # [V] bool -> [n] int64
        return np.flatnonzero(test).astype(np.int64)

    return ValueVocab(
        vocab.texts,
        quote=ids(quote),
        quote_closer=ids(quote & closes),
        value_end=ids(end),
        key_end=ids(quote & end),
        closer=ids(closes),
        spaced=ids(spaced),
        numeric=ids(numeric),
        spaced_numeric=ids(spaced | numeric),
        value_end_numeric=ids(end | numeric),
        value_begin=ids(end | begins),
    )


for _table in (key_vocab, value_vocab, closing_vocab):  # what a first JSON request would wait for
    prepare_with(_table)
