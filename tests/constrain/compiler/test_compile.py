"""Compiling and matching: the cache, the matcher API, batched fills, and several tokenizer families."""

from __future__ import annotations

import threading

import pytest
import torch

import constrain
from constrain.compiler.cache import ByteLRU
from constrain.testing import accepts, allowed_ids, token_ids, walk


def spec(schema, **options):
    """JSON Schema's own semantics (open objects, any key order, single whitespace): what these tests check."""
    return constrain.json_schema(schema, mode="specification", **options)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_second_compile_is_a_cache_hit(smol_tokenizer):
    c = spec(PERSON | {"title": "cache-hit"})
    first = constrain.compile(c, smol_tokenizer)
    before = constrain.cache_stats()
    again = constrain.compile(spec(PERSON | {"title": "cache-hit"}), smol_tokenizer)
    assert again is first
    assert constrain.cache_stats()["hits"] == before["hits"] + 1


def test_concurrent_compiles_of_one_key_compile_once(smol_tokenizer):
    c = spec(PERSON | {"title": "concurrent"})
    results, before = [], constrain.cache_stats()["misses"]
    threads = [threading.Thread(target=lambda: results.append(constrain.compile(c, smol_tokenizer))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert constrain.cache_stats()["misses"] == before + 1


def test_byte_lru_evicts_least_recent_and_never_caches_errors():
    lru: ByteLRU[str] = ByteLRU(10, len)
    lru.get_or_create("a", lambda: "aaaa")
    lru.get_or_create("b", lambda: "bbbb")
    lru.get_or_create("a", lambda: "x")  # a hit: "a" becomes most recent
    lru.get_or_create("c", lambda: "cccc")  # 12 bytes > 10: evicts "b"
    assert lru.get_or_create("a", lambda: "new") == "aaaa"
    assert lru.get_or_create("b", lambda: "BBBB") == "BBBB"
    assert lru.nbytes <= 10
    with pytest.raises(KeyError):
        lru.get_or_create("d", lambda: {}["boom"])
    assert lru.get_or_create("d", lambda: "ok") == "ok"
    assert lru.get_or_create("big", lambda: "x" * 11) == "x" * 11 and "big" not in lru


def test_byte_lru_bounds_entries_too():
    lru: ByteLRU[str] = ByteLRU(1000, len, max_entries=2)
    for key in "abc":
        lru.get_or_create(key, lambda: "v")
    assert len(lru) == 2 and "a" not in lru and "c" in lru
    with pytest.raises(ValueError, match="max_entries"):
        ByteLRU(10, len, max_entries=0)


def test_the_compile_cache_is_sized_to_the_machine(monkeypatch):
    from constrain import caches
    from constrain.compiler import compiler

    for memory, expected in ((24 << 30, int(0.01 * (24 << 30))), (1 << 30, 64 << 20), (1 << 40, 1 << 30),
                             (None, 1 << 30)):  # fmt: skip
        monkeypatch.setattr(caches, "machine_memory", lambda memory=memory: memory)
        assert compiler.default_cache_bytes() == expected
    figures = constrain.cache_stats()["caches"]["compile.compiled"]
    assert figures["maxsize"] == compiler._cache.max_bytes and figures["max_entries"] == compiler.CACHE_MAX_ENTRIES


def test_matcher_api(smol_tokenizer):
    compiled = constrain.compile(spec(PERSON, whitespace="compact", property_order="schema"), smol_tokenizer)
    m = compiled.matcher()
    assert m.forced_text() == '{"name":"'
    ids = token_ids(smol_tokenizer, '{"name":"Al","age":7}')
    ok, m = walk(compiled, ids)
    assert ok and m.is_completed() and not m.is_terminated()
    twin = m.fork()
    eos = compiled.tokenizer.eos_token_ids[0]
    assert m.accept_token(eos) and m.is_terminated()
    assert not twin.is_terminated()  # a fork is independent
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    m.rollback(3)
    assert not m.is_completed()
    assert not m.accept_token(token_ids(smol_tokenizer, "[")[0])  # rejected: False, no exception
    m.reset()
    assert m.num_accepted == 0 and m.forced_text() == '{"name":"'
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(1)


def test_eos_is_masked_until_the_grammar_can_end(smol_tokenizer):
    compiled = constrain.compile(constrain.regex("ab?"), smol_tokenizer)
    eos = set(compiled.tokenizer.eos_token_ids)
    m = compiled.matcher()
    bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    assert not eos & allowed_ids(bitmask[0], compiled.vocab_size)
    assert m.accept_token(token_ids(smol_tokenizer, "a")[0])
    m.fill_next_token_bitmask(bitmask)
    allowed = allowed_ids(bitmask[0], compiled.vocab_size)
    assert eos <= allowed and len(allowed) == len(eos) + len([t for t in allowed if t not in eos])


def test_batched_fill_equals_one_by_one(smol_tokenizer):
    constraints = [
        spec(PERSON),
        constrain.regex(r"\d{3}-\d{4}"),
        constrain.choice(["yes", "no", "maybe"]),
        constrain.grammar("arithmetic"),
    ]
    matchers = [constrain.compile(c, smol_tokenizer).matcher() for c in constraints]
    matchers[0].accept_string('{"name": "A')
    matchers[1].accept_string("55")
    vocab = matchers[0].compiled.vocab_size
    batched = constrain.allocate_token_bitmask(6, vocab)
    constrain.fill_next_token_bitmasks(matchers, batched, indices=[5, 0, 2, 3])
    for matcher, row in zip(matchers, [5, 0, 2, 3], strict=True):
        single = constrain.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(single)
        assert torch.equal(batched[row], single[0])
    assert (batched[[1, 4]] == -1).all()  # untouched rows stay "all allowed"


def test_bitmask_errors_say_what_to_do(smol_tokenizer):
    m = constrain.compile(constrain.regex("a"), smol_tokenizer).matcher()
    with pytest.raises(ValueError, match="int32"):
        m.fill_next_token_bitmask(torch.zeros(1, 1536, dtype=torch.int64))
    with pytest.raises(ValueError, match="positive"):
        constrain.allocate_token_bitmask(0, 10)


samples = ['{"name": "Zoë", "age": 30}', '{"age": 1, "name": "日本語 😀"}', '{"name":"a\\"b\\\\c\\n","age":0}']


@pytest.mark.parametrize("text", samples)
def test_tokenizer_families(text, smol_tokenizer, gemma_tokenizer, sp_tokenizer):
    schema = spec(PERSON)
    for tokenizer in (smol_tokenizer, gemma_tokenizer, sp_tokenizer):
        compiled = constrain.compile(schema, tokenizer)
        assert accepts(compiled, tokenizer, text), type(tokenizer).__name__
        assert not accepts(compiled, tokenizer, text.replace('"age"', '"agE"')), type(tokenizer).__name__


def test_vocab_padded_beyond_the_tokenizer(smol_tokenizer):
    real = len(smol_tokenizer)
    compiled = constrain.compile(constrain.json_object(), smol_tokenizer, vocab_size=real + 64)
    assert compiled.vocab_size == real + 64
    bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    compiled.matcher().fill_next_token_bitmask(bitmask)
    assert max(allowed_ids(bitmask[0], compiled.vocab_size)) < real
    assert accepts(compiled, smol_tokenizer, '{"a": [1, 2]}')
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        constrain.compile(constrain.json_object(), smol_tokenizer, vocab_size=real - 1)


def test_several_eos_ids(gemma_tokenizer):
    eos = [1, 106]  # <eos> and <end_of_turn>
    compiled = constrain.compile(constrain.choice(["yes", "no"]), gemma_tokenizer, eos_token_ids=eos)
    assert compiled.tokenizer.eos_token_ids == tuple(eos)
    for stop in eos:
        m = compiled.matcher()
        bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
        assert m.accept_string("yes")
        m.fill_next_token_bitmask(bitmask)
        assert set(eos) <= allowed_ids(bitmask[0], compiled.vocab_size)
        assert m.accept_token(stop) and m.is_terminated()


def test_compile_budget(smol_tokenizer):
    slow = constrain.regex("(a|b|c|d){1,2000}x" + "[a-z]{1,64}" * 8)  # seconds for xgrammar (auto: llguidance)
    with pytest.raises(constrain.CompileError, match="budget"):
        constrain.compile(slow, smol_tokenizer, timeout_s=1e-4, engine="xgrammar")


def test_a_model_and_its_schema_share_a_grammar_not_a_type(smol_tokenizer):
    from pydantic import BaseModel

    import constrain

    class Point(BaseModel):
        x: int

    typed = constrain.compile(constrain.json_schema(Point), smol_tokenizer)
    plain = constrain.compile(constrain.json_schema(Point.model_json_schema()), smol_tokenizer)
    assert plain.constraint.python_type is None and typed.constraint.python_type is Point
    assert plain.grammar is typed.grammar, "one compiled grammar"
    again = constrain.compile(constrain.json_schema(Point), smol_tokenizer)
    assert again.constraint.python_type is Point


_LOOP = {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}}, "required": ["x"]}


@pytest.mark.parametrize(
    ("engine", "wait"), [("auto", None), ("auto", 0.0), ("xgrammar", None)], ids=["auto", "auto-waiting", "xgrammar"]
)
def test_a_schema_whose_values_never_end_is_refused_at_compile(smol_tokenizer, engine, wait):
    """A required property that refers back to its object admits no finite value: refused when compiled,
    as no value where it is the whole schema, as a branch decoding could enter without end where it is one
    (both made xgrammar's jump-forward run out of memory). An optional one is a tree, and compiles. Where
    ``"auto"`` waits for xgrammar (4 cores or more), the refusal is not llguidance's cue to serve it."""
    limits = constrain.AutoLimits(xgrammar_wait_s=wait)
    whole = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(constrain.UnsatisfiableSchemaError, match="no value is finite"):
        constrain.compile(constrain.json_schema(whole), smol_tokenizer, engine=engine, auto_limits=limits)
    branch = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/loop"}], "$defs": {"loop": _LOOP}}
    with pytest.raises(constrain.CompileError, match="admits no finite value"):
        constrain.compile(constrain.json_schema(branch), smol_tokenizer, engine=engine, auto_limits=limits)
    tree = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    compiled = constrain.compile(constrain.json_schema(tree), smol_tokenizer, engine=engine, auto_limits=limits)
    assert compiled.matcher().forced_text() == "{"
