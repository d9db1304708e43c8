"""Per-tokenizer vocabulary tables: every token's bytes, and the tables the closing search moves by.

Reading the vocabulary out of the engine takes about 0.6 s on a 50k-token tokenizer, so it is read
once per tokenizer (:func:`token_texts`), and every table is derived from it: the key scanner's
(:func:`key_vocab`, :mod:`constrain.match.keys`), the value scanner's (:func:`value_vocab`,
:mod:`constrain.match.values`) and the closing search's (:func:`closing_vocab`,
:mod:`constrain.match.closing`); the repetition guard and the repeated-call filter derive theirs.
Each table is cached per :class:`~constrain.backends.tokenizer.TokenizerInfo` (by identity:
:func:`~constrain.backends.tokenizer.tokenizer_info` returns one per tokenizer), bounded and reported
in :func:`constrain.caches.stats`; a table is immutable, so requests and threads share it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded

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

PRIORITY = '"a}]),0123456789[{ntf:-.eE '
"""The characters a closing tries first: close a string, else fill it (``a`` is allowed only inside
strings in JSON); close containers and numbers; then the shortest values. Both the search's move
order (:attr:`ClosingVocab.rank`) and the greedy closing follow it."""


@dataclass(frozen=True, slots=True)
class TokenTexts:
    """Every token's bytes, as the engine decodes them."""

    pieces: list[bytes]  # per token id the tokenizer has (special tokens included), its bytes
    # per token id up to the model's vocab_size (at least), its bytes; b"" for the special tokens
    # and for the ids past the tokenizer (padded embeddings)
    texts: list[bytes]
    special: frozenset[int]  # the tokenizer's special token ids (EOS ids are ``info.eos_token_ids``)


@bounded("match.vocab.token_texts", maxsize=TOKENIZERS_KEPT)
def token_texts(info: TokenizerInfo) -> TokenTexts:
    """The token texts of ``info``'s tokenizer (cached: see the module docstring)."""
    special = frozenset(info.xgr_info.special_token_ids)
    pieces = [bytes(piece) for piece in info.xgr_info.decoded_vocab]
    texts = [b"" if i in special else piece for i, piece in enumerate(pieces)]
    texts += [b""] * (info.vocab_size - len(texts))
    return TokenTexts(pieces, texts, special)


@dataclass(frozen=True, slots=True)
class ClosingVocab:
    """The tables the closing search (:mod:`constrain.match.closing`) moves by."""

    char_tokens: dict[str, int]  # one-character texts (ASCII) -> their token id
    pieces: list[bytes]  # per token id, its bytes (``TokenTexts.pieces``)
    # [32 * ceil(V / 32)] int64: per token id, its place in the search's move order; -1: never a move
    # (special and EOS tokens, empty pieces, ids past the tokenizer)
    rank: np.ndarray
    char_ids: np.ndarray  # [C] int64: the single-character token ids, in move order
    by_piece: dict[bytes, int]  # bytes -> the first token id (in move order) with them
    sorted_pieces: list[bytes]  # the keys of ``by_piece``, sorted (to find the tokens that start with some bytes)
    longest: list[int]  # per first byte, the bytes in the longest piece that starts with it

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


@bounded("match.vocab.closing", maxsize=TOKENIZERS_KEPT)
def closing_vocab(info: TokenizerInfo) -> ClosingVocab:
    """The closing search's tables for ``info``'s tokenizer (cached: see the module docstring).

    The move order: the :data:`PRIORITY` characters, then the other single-character tokens by
    character, then every other token by id.
    """
    pieces = token_texts(info).pieces
    skip = token_texts(info).special | set(info.eos_token_ids)
    chars: dict[str, int] = {}
    rank = np.full(32 * ((info.vocab_size + 31) // 32), -1, dtype=np.int64)  # [32 * ceil(V / 32)]
    for token_id, raw in enumerate(pieces[: info.vocab_size]):
        if token_id in skip or not raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        if len(text) == 1 and text.isascii() and text not in chars:
            chars[text] = token_id
        rank[token_id] = 1_000 + token_id  # multi-character tokens after the characters, by id
    for token_id in chars.values():
        rank[token_id] = 128 + ord(pieces[token_id].decode())
    for place, ch in enumerate(PRIORITY):
        if ch in chars:
            rank[chars[ch]] = place
    char_ids = np.array(sorted(chars.values(), key=lambda t: rank[t]), dtype=np.int64)  # [C]
    by_piece: dict[bytes, int] = {}
    for token_id in np.argsort(rank, kind="stable").tolist():
        if rank[token_id] >= 0:
            by_piece.setdefault(pieces[token_id], token_id)
    longest = [0] * 256
    for piece in by_piece:
        longest[piece[0]] = max(longest[piece[0]], len(piece))
    return ClosingVocab(chars, pieces, rank, char_ids, by_piece, sorted(by_piece), longest)


@dataclass(frozen=True, slots=True)
class KeyVocab:
    """The key scanner's tables (:mod:`constrain.match.keys`)."""

    texts: list[bytes]  # per token id, its bytes (b"" for special tokens): ``TokenTexts.texts``
    sorted_texts: list[bytes]  # the non-empty texts, sorted (prefix search)
    sorted_ids: list[int]  # the token id of each sorted text
    multi_quote: tuple[np.ndarray, np.ndarray]  # [m] int64: ids of the tokens holding two or more '"'; three or more


@bounded("match.vocab.keys", maxsize=TOKENIZERS_KEPT)
def key_vocab(info: TokenizerInfo) -> KeyVocab:
    """The key scanner's tables for ``info``'s tokenizer (cached: see the module docstring)."""
    texts = token_texts(info).texts
    order = sorted((t, i) for i, t in enumerate(texts) if t)
    quotes = [t.count(b'"') for t in texts]
    multi = tuple(np.array([i for i, n in enumerate(quotes) if n >= least], dtype=np.int64) for least in (2, 3))
    return KeyVocab(texts, [t for t, _ in order], [i for _, i in order], (multi[0], multi[1]))


_CLOSERS = frozenset(b",]}")
_WHITESPACE = frozenset(b" \t\n\r")
_NUMBER_STARTS = frozenset(bytes((c,)) for c in b"-.0123456789")


@dataclass(frozen=True, slots=True)
class ValueVocab:
    """The value scanner's tables (:mod:`constrain.match.values`): per token, its bytes; and the ids of
    the tokens that can complete a value, per scanner mode."""

    texts: list[bytes]  # per token id, its bytes (b"" for special tokens): ``TokenTexts.texts``
    quote: np.ndarray  # [q] int64: ids holding '"' (in a string: they may close it)
    quote_closer: np.ndarray  # [qc] int64: ids holding '"' and a closer (close a string, then a container)
    value_end: np.ndarray  # [e] int64: a closer, two '"' or whitespace after other text (outside strings)
    key_end: np.ndarray  # [k] int64: ``value_end`` with a '"' (in a key: close it, then complete a value)
    closer: np.ndarray  # [c] int64: ids holding ',', ']' or '}'
    spaced: np.ndarray  # [s] int64: ``value_end`` or any whitespace (in a scalar: end it)
    numeric: np.ndarray  # [n] int64: a '-', '.' or digit first, after any whitespace (start or extend a number)
    spaced_numeric: np.ndarray  # [sn] int64: ``spaced`` or ``numeric`` (in a number under check)
    value_end_numeric: np.ndarray  # [en] int64: ``value_end`` or ``numeric`` (where a number under check may start)


@bounded("match.vocab.values", maxsize=TOKENIZERS_KEPT)
def value_vocab(info: TokenizerInfo) -> ValueVocab:
    """The value scanner's tables for ``info``'s tokenizer (cached: see the module docstring)."""
    texts = token_texts(info).texts

    rows = [(False,) * 5] * len(texts)  # per token: holds '"', a closer, ends a value, is spaced, numeric
    for i, t in enumerate(texts):
        if t:
            stripped = t.lstrip(b" \t\n\r")
            closes = any(c in _CLOSERS for c in t)
            end = closes or t.count(b'"') >= 2 or any(c in _WHITESPACE for c in stripped)
            rows[i] = (b'"' in t, closes, end, end or len(stripped) < len(t), stripped[:1] in _NUMBER_STARTS)
    quote, closes, end, spaced, numeric = np.array(rows, dtype=bool).T  # 5 x [V] bool: one pass

    def ids(test: np.ndarray) -> np.ndarray:  # [V] bool -> [n] int64
        return np.flatnonzero(test).astype(np.int64)

    return ValueVocab(
        texts,
        quote=ids(quote),
        quote_closer=ids(quote & closes),
        value_end=ids(end),
        key_end=ids(quote & end),
        closer=ids(closes),
        spaced=ids(spaced),
        numeric=ids(numeric),
        spaced_numeric=ids(spaced | numeric),
        value_end_numeric=ids(end | numeric),
    )
