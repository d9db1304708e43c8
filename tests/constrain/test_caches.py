"""The cache registry (constrain.caches): every cache of the match layer is bounded and reported."""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import pkgutil
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

import constrain
from constrain import caches
from constrain.match import checks, vocab
from constrain.match.budget import Encodings, InitialClosings
from constrain.match.repetition import comma_tokens
from constrain.match.validate import schema_validator

PACKAGE = Path(constrain.__file__).parent

WEAK = {"backends.tokenizer_info", "models.forward_cost"}
"""The caches keyed weakly by a live tokenizer or model (maxsize -1): they go with their keys."""

FIGURES = {"entries", "hits", "misses", "maxsize"}


def _declared() -> dict[str, str]:
    """Every cache name the package's source registers (``bounded("...")`` or ``register("...")``), with its module."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "bounded", "register"
            ) and node.args and isinstance(node.args[0], ast.Constant) and path.name != "caches.py":  # fmt: skip
                found[node.args[0].value] = str(path.relative_to(PACKAGE.parent))
    return found


@pytest.fixture(scope="module")
def registry() -> dict[str, dict[str, int]]:
    """The registry once every module of the package is imported (vLLM's integration needs vLLM)."""
    for module in pkgutil.walk_packages(constrain.__path__, "constrain."):
        if module.name != "constrain.integrations.vllm":
            importlib.import_module(module.name)
    return caches.stats()


def test_every_declared_cache_is_registered(registry):
    declared = _declared()
    assert len(declared) >= 20
    assert set(declared) <= set(registry), sorted(set(declared) - set(registry))


def test_every_registered_cache_is_bounded_and_reported(registry):
    for name, figures in registry.items():
        if name in WEAK:
            assert figures["maxsize"] == -1 and figures["entries"] >= 0, name
            continue
        assert FIGURES <= set(figures), (name, figures)
        assert 0 < figures["maxsize"] and 0 <= figures["entries"] <= figures["maxsize"], (name, figures)


def test_no_cache_outside_the_registry():
    """A ``functools.cache``/``lru_cache`` would be unbounded or unreported: ``caches.bounded`` is the one way."""
    for path in PACKAGE.rglob("*.py"):
        if path.name != "caches.py":
            assert not re.search(r"functools\.(cache|lru_cache)\b|@(cache|lru_cache)\b", path.read_text()), path


def test_the_vocabulary_tables_are_read_once_per_tokenizer(smol_tokenizer):
    # a TokenizerInfo of its own (padded vocabulary): every table is built for it (asked for here while a
    # thread of the info's builds them: each is built once, whoever asks first)
    before = caches.stats()["match.vocab.token_texts"]
    info = constrain.tokenizer_info(smol_tokenizer, vocab_size=len(smol_tokenizer) + 96)
    tables = [vocab.closing_vocab(info), vocab.key_vocab(info), vocab.value_vocab(info), comma_tokens(info)]
    info.wait_prepared()
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


def test_a_serial_cache_builds_a_value_once_for_threads_that_ask_at_once():
    import threading
    import time

    calls: list[int] = []

    @caches.bounded("tests.caches.slow_square", maxsize=2, serial=True)
    def slow_square(x: int) -> int:
        calls.append(x)
        time.sleep(0.05)  # a build another thread asks for meanwhile
        return x * x

    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(slow_square(3))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [9] * 4 and calls == [3]
    assert slow_square.cache_info().hits == 3 and caches.stats()["tests.caches.slow_square"]["misses"] == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # (Python 3.12+)
def test_a_serial_cache_works_in_a_child_forked_during_a_build():
    import threading
    import time

    @caches.bounded("tests.caches.slow_cube", maxsize=2, serial=True)
    def slow_cube(x: int) -> int:
        time.sleep(0.3 if x == 2 else 0)
        return x**3

    builder = threading.Thread(target=slow_cube, args=(2,))
    builder.start()
    time.sleep(0.1)  # the thread holds the cache's lock, in its build
    pid = os.fork()
    if pid == 0:  # the child: the builder is not there to let go of the lock
        signal.alarm(5)  # a deadlock ends the child by SIGALRM
        os._exit(0 if slow_cube(3) == 27 else 1)
    builder.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


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


def test_encodings_are_kept_per_tokenizer_and_bounded():
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [len(text), ord(text[0])]

    memo = Encodings(maxsize=2)
    mine, theirs = memo.encoder("tok", encode), memo.encoder("other", encode)
    assert mine("ab") == [2, 97] and mine("ab") == [2, 97] and calls == ["ab"]  # the second is kept
    ids = mine("ab")
    ids.append(0)  # a caller's copy: the memo keeps its own
    assert mine("ab") == [2, 97]
    assert theirs("ab") == [2, 97] and calls == ["ab", "ab"]  # another tokenizer: encoded anew
    mine("xyz")  # ("tok", "ab") is the least recently used: dropped
    mine("ab")
    assert calls == ["ab", "ab", "xyz", "ab"]
    assert memo.stats() == {"entries": 2, "hits": 3, "misses": 4, "maxsize": 2}


def test_the_value_check_memos_are_bounded_and_reported(monkeypatch):
    monkeypatch.setattr(checks, "MEMO_ENTRIES", 8)
    gc.collect()
    before = caches.stats()["match.checks.memos"]
    validator = schema_validator(json.dumps({"type": "array", "uniqueItems": True}))
    memo = checks.ValueChecks(validator.schema, validator, ())
    root = memo.root_location
    for n in range(30):
        assert memo.accepts(root, [n, n + 1]) and not memo.accepts(root, [n, n])
        assert len(memo._verdicts) <= 8  # starts over at MEMO_ENTRIES
    assert memo.accepts(root, [29, 30])  # just judged: kept
    twice = ["x" * checks.MEMO_KEY_CHARS] * 2  # not unique, and its text too long to keep
    assert not memo.accepts(root, twice)
    assert not memo.accepts(root, twice)
    assert (memo.hits, memo.misses) == (1, 62)
    during = caches.stats()["match.checks.memos"]
    assert during["instances"] == before["instances"] + 1
    assert during["entries"] == before["entries"] + memo.memo_entries > before["entries"]
    assert during["maxsize"] == 2 * 8 * during["instances"] and memo.memo_entries <= 2 * 8  # (others kept theirs)
    assert during["hits"] == before["hits"] + 1 and during["misses"] == before["misses"] + 62
    del memo
    gc.collect()
    after = caches.stats()["match.checks.memos"]
    assert (after["instances"], after["entries"]) == (before["instances"], before["entries"])
