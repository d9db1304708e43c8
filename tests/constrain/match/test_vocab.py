"""The per-tokenizer tables: the vectorized builds against a token-by-token reading of the same texts, and
the token texts' file, read back exactly and skipped where it cannot be written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import constrain
from constrain.match import vocab

_BLANK = b" \t\n\r"


def _reference(info: constrain.TokenizerInfo) -> dict[str, list[int]]:
    """The tables' id sets, worked out one token at a time from the texts (what the vectorized builds
    must equal)."""
    texts = vocab.token_texts(info).texts
    found: dict[str, list[int]] = {name: [] for name in ("quote", "closer", "value_end", "spaced", "numeric")}
    for token_id, text in enumerate(texts):
        if not text:
            continue
        stripped = text.lstrip(_BLANK)
        closes = any(c in b",]}" for c in text)
        end = closes or text.count(b'"') >= 2 or any(c in _BLANK for c in stripped)
        for name, holds in (
            ("quote", b'"' in text),
            ("closer", closes),
            ("value_end", end),
            ("spaced", end or len(stripped) < len(text)),
            ("numeric", stripped[:1] != b"" and stripped[:1] in b"-.0123456789"),
        ):
            if holds:
                found[name].append(token_id)
    nonempty = [(text, token_id) for token_id, text in enumerate(texts) if text]
    found["sorted_ids"] = [token_id for _, token_id in sorted(nonempty)]
    found["two_quotes"] = [token_id for token_id, text in enumerate(texts) if text.count(b'"') >= 2]
    return found


@pytest.mark.parametrize("tokenizer", ["smol_tokenizer", "gemma_tokenizer", "sp_tokenizer"])
def test_the_vectorized_tables_equal_a_token_by_token_reading(tokenizer, request):
    info = constrain.tokenizer_info(request.getfixturevalue(tokenizer))
    expected = _reference(info)
    values = vocab.value_vocab(info)
    for name in ("quote", "closer", "value_end", "spaced", "numeric"):
        assert getattr(values, name).tolist() == expected[name], name
    for entry in dataclasses.fields(values):  # the O(1) membership tables hold exactly their table's ids
        table = getattr(values, entry.name)
        if isinstance(table, np.ndarray):
            held = [token for token in range(info.vocab_size + 64) if values.holds(table, token)]
            assert held == table.tolist(), entry.name
            rng = np.random.default_rng(len(table))
            for width in (-(-info.vocab_size // 32), -(-info.vocab_size // 32) + 3):  # padded rows too
                row = rng.integers(-(2**31), 2**31, size=width, dtype=np.int64).astype(np.int32)  # [W] int32
                allowed = [t for t in table.tolist() if (int(row[t >> 5]) >> (t & 31)) & 1]
                assert values.count_among(row, table) == len(allowed), entry.name
    keys = vocab.key_vocab(info)
    assert list(keys.sorted_ids) == expected["sorted_ids"]
    assert keys.multi_quote[0].tolist() == expected["two_quotes"]
    closing = vocab.closing_vocab(info)
    pieces = vocab.token_texts(info).pieces
    skip = vocab.token_texts(info).special | set(info.eos_token_ids)
    moves = [t for t in range(info.vocab_size) if t < len(pieces) and pieces[t] and t not in skip]
    assert sorted(np.flatnonzero(closing.rank >= 0).tolist()) == moves
    firsts: dict[bytes, int] = {}
    for token_id in moves:  # one-character ASCII texts, the first id of each
        if len(pieces[token_id]) == 1 and pieces[token_id][0] < 128:
            firsts.setdefault(pieces[token_id], token_id)
    assert closing.char_tokens == {piece.decode(): token_id for piece, token_id in firsts.items()}
    for piece, token_id in closing.by_piece.items():  # the best-ranked id of each text
        assert pieces[token_id] == piece
    longest = [0] * 256
    for piece in closing.by_piece:
        longest[piece[0]] = max(longest[piece[0]], len(piece))
    assert list(closing.longest) == longest


def test_the_token_texts_are_read_back_from_their_file(smol_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("CONSTRAIN_CACHE", str(tmp_path))
    info = constrain.tokenizer_info(smol_tokenizer)
    read = vocab.token_texts.__wrapped__(info)  # past the in-process cache: from the engine, then saved
    saved = list((tmp_path / "vocab").glob("*.npz"))
    assert len(saved) == 1
    decoded = tuple(bytes(p) for p in info.xgr_info.decoded_vocab)
    assert vocab.token_texts.__wrapped__(info).pieces == read.pieces == decoded

    whole = saved[0].read_bytes()
    for damaged in (b"not a file numpy wrote", whole[: len(whole) // 2]):  # read from the engine again
        saved[0].write_bytes(damaged)
        assert vocab.token_texts.__wrapped__(info).pieces == read.pieces


def test_the_token_texts_need_no_writable_cache(smol_tokenizer, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("CONSTRAIN_CACHE", str(blocked))  # a file where the folder would be
    info = constrain.tokenizer_info(smol_tokenizer)
    assert vocab.token_texts.__wrapped__(info).pieces == tuple(bytes(p) for p in info.xgr_info.decoded_vocab)


def test_the_tables_are_built_in_the_background_from_the_tokenizers_info(smol_tokenizer, monkeypatch):
    """A new tokenizer info builds the JSON scanners' tables on a thread of its own: the first request finds
    them built (it waited 40 to 55 ms for them). A table that fails there is left to its user."""
    from constrain.backends import tokenizer

    def fails(info: constrain.TokenizerInfo) -> None:
        raise RuntimeError("a table that cannot be built")

    monkeypatch.setattr(tokenizer, "_PREPARERS", [fails, *tokenizer._PREPARERS])
    info = constrain.tokenizer_info(smol_tokenizer, vocab_size=len(smol_tokenizer) + 3)  # a new info
    info.wait_prepared()
    for table in (vocab.key_vocab, vocab.value_vocab, vocab.closing_vocab):
        hits = table.cache_info().hits
        table(info)
        assert table.cache_info().hits == hits + 1, table
