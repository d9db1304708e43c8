"""The cache registry (constrain.caches): every cache of the match layer is bounded and reported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import constrain
import constrain.tools.repeats  # registers its cache on import
from constrain import caches
from constrain.match import vocab
from constrain.match.budget import InitialClosings
from constrain.match.repetition import comma_tokens

MATCH_CACHES = [
    "match.budget.initial_closings",
    "match.checks.patterns",
    "match.repetition.comma_tokens",
    "match.values.parse",
    "match.vocab.closing",
    "match.vocab.keys",
    "match.vocab.token_texts",
    "match.vocab.values",
    "tools.repeats.pieces",
]

FIGURES = {"entries", "hits", "misses", "maxsize"}


@pytest.mark.parametrize("name", MATCH_CACHES)
def test_every_cache_is_reported_and_bounded(name):
    figures = caches.stats()[name]
    assert FIGURES <= set(figures)
    assert 0 < figures["maxsize"] and 0 <= figures["entries"] <= figures["maxsize"]


def test_the_vocabulary_tables_are_read_once_per_tokenizer(smol_tokenizer):
    # a TokenizerInfo of its own (padded vocabulary): every table is built here, whatever ran before
    info = constrain.tokenizer_info(smol_tokenizer, vocab_size=len(smol_tokenizer) + 96)
    before = caches.stats()["match.vocab.token_texts"]
    tables = [vocab.closing_vocab(info), vocab.key_vocab(info), vocab.value_vocab(info), comma_tokens(info)]
    assert vocab.closing_vocab(info) is tables[0] and vocab.key_vocab(info) is tables[1]
    after = caches.stats()["match.vocab.token_texts"]
    assert after["misses"] - before["misses"] == 1  # every table derives from the one read of the vocabulary
    assert 1 <= after["entries"] <= vocab.TOKENIZERS_KEPT
    # the tables share the token texts rather than copying them
    texts = vocab.token_texts(info)
    assert tables[0].pieces is texts.pieces and tables[1].texts is texts.texts and tables[2].texts is texts.texts
    assert caches.stats()["match.vocab.closing"]["hits"] >= 1


def test_bounded_wraps_lru_cache_and_reports_it():
    @caches.bounded("tests.caches.square", maxsize=2)
    def square(x: int) -> int:
        return x * x

    assert [square(x) for x in (1, 2, 1, 3, 4)] == [1, 4, 1, 9, 16]
    assert caches.stats()["tests.caches.square"] == {"entries": 2, "hits": 1, "misses": 4, "maxsize": 2}
    with pytest.raises(ValueError, match="registered already"):
        caches.register("tests.caches.square", lambda: {})
    with pytest.raises(ValueError, match="positive"):
        caches.bounded("tests.caches.unbounded", maxsize=0)


def _compiled(schema: str, fingerprint: str = "tok", engine: str = "xgrammar") -> SimpleNamespace:
    """What the initial-closing memo keys by: a constraint value, a tokenizer fingerprint, an engine."""
    return SimpleNamespace(
        constraint=constrain.json_schema({"type": "string", "pattern": schema}),
        tokenizer=SimpleNamespace(fingerprint=fingerprint),
        grammar=SimpleNamespace(engine=engine),
    )


def test_initial_closings_are_a_bounded_lru_keyed_by_value():
    memo = InitialClosings(maxsize=2)
    a, b, c = _compiled("a"), _compiled("b"), _compiled("c")
    memo.put(a, 64, [1, 2])
    memo.put(b, 64, None)  # nothing fits is remembered too
    assert memo.get(_compiled("a"), 64) == (True, [1, 2])  # an equal constraint compiled again: the same key
    assert memo.get(a, 32) == (False, None)  # another max_tokens
    assert memo.get(_compiled("a", engine="llguidance"), 64) == (False, None)
    assert memo.get(_compiled("a", fingerprint="other"), 64) == (False, None)
    memo.put(c, 64, [3])  # b is the least recently used: dropped
    assert memo.get(b, 64) == (False, None) and memo.get(a, 64) == (True, [1, 2])
    path = memo.get(c, 64)[1]
    assert path is not None
    path.append(99)  # a caller's copy: the memo keeps its own
    assert memo.get(c, 64) == (True, [3])
    assert memo.stats() == {"entries": 2, "hits": 4, "misses": 4, "maxsize": 2}
    with pytest.raises(ValueError, match="positive"):
        InitialClosings(maxsize=0)
