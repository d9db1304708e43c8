"""The two grammar engines: llguidance behind the same matcher API as xgrammar, and ``engine="auto"``."""

from __future__ import annotations

import time

import pytest
import torch

import constrain
from constrain.compiler import routing
from constrain.testing import accepts, allowed_ids, token_ids, walk


def spec(schema, **options):
    """JSON Schema's own semantics (open objects, any key order, single whitespace): what these tests check."""
    return constrain.json_schema(schema, mode="specification", **options)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
LIGHT_PERSON = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}}
"""PERSON without its maxLength, which alone sends it to llguidance under "auto" (AutoLimits.string_repeat)."""
TEXTS = [
    ('{"name": "Al", "age": 7}', True),
    ('{"name":"Zoë 😀","age":150,"tags":["a",3]}', True),
    ('{"name": "Al", "age": 7, "tags": []}', True),
    ('{"name": "Al", "age": -1}', False),
    ('{"name": "Al", "age": 7, "tags": ["c"]}', False),
    ('{"name": "Al", "age": 7, "tags": ["a", "b", 3]}', False),
    ('{"name": "Al", "age": 7, "x": 1}', False),
    ('{"name": "a very long name", "age": 7}', False),
    ('{"name": "Al"}', False),
    ('{"name": "Al",  "age": 7}', False),  # two spaces: whitespace is bounded to one
    ('{"name": "a\tb", "age": 1}', False),  # a raw control character is not JSON
]


@pytest.mark.parametrize(("text", "valid"), TEXTS)
def test_both_engines_enforce_the_same_language(smol_tokenizer, text, valid):
    c = spec(PERSON, property_order="schema")
    for engine in ("xgrammar", "llguidance"):
        compiled = constrain.compile(c, smol_tokenizer, engine=engine)
        assert compiled.engine == engine
        assert accepts(compiled, smol_tokenizer, text) == valid, engine


@pytest.mark.parametrize(
    ("pattern", "text"),
    [(r"[0-9]{3}-[0-9]{4}", "555-1234"), (r"(yes|no)!?", "no!"), (r"[a-z]+@[a-z]+\.(com|org)", "ab@cd.org")],
)
def test_regex_masks_are_identical_across_engines(smol_tokenizer, pattern, text):
    r"""Token by token along a valid text, both engines allow exactly the same tokens.

    (Not for ``\d``: llguidance reads it as any Unicode digit, as Python does; xgrammar as ``[0-9]``.)
    """
    matchers = [constrain.compile(constrain.regex(pattern), smol_tokenizer, engine=e).matcher() for e in ENGINES]
    vocab = matchers[0].compiled.vocab_size
    for token in [*token_ids(smol_tokenizer, text), None]:
        masks = []
        for m in matchers:
            bitmask = constrain.allocate_token_bitmask(1, vocab)
            m.fill_next_token_bitmask(bitmask)
            masks.append(allowed_ids(bitmask[0], vocab))
        assert masks[0] == masks[1]
        if token is not None:
            assert all(m.accept_token(token) for m in matchers)


ENGINES = ("xgrammar", "llguidance")


def test_llguidance_matcher_semantics(smol_tokenizer):
    """Rejection leaves the state unchanged; EOS terminates; rollback, fork, reset and forced text."""
    compiled = constrain.compile(
        spec(PERSON, whitespace="compact", property_order="schema"),
        smol_tokenizer,
        engine="llguidance",
    )
    m = compiled.matcher()
    assert m.forced_text() == '{"name":"'
    assert not m.accept_token(token_ids(smol_tokenizer, "[")[0])  # False, and no error state
    ids = token_ids(smol_tokenizer, '{"name":"Al","age":7}')
    ok, m = walk(compiled, ids)
    assert ok and m.is_completed() and not m.is_terminated()
    assert not m.accept_token(token_ids(smol_tokenizer, "x")[0])
    twin = m.fork()
    eos = compiled.tokenizer.eos_token_ids[0]
    assert m.accept_token(eos) and m.is_terminated()
    assert not m.accept_token(eos) and not twin.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    m.rollback(3)
    assert not m.is_completed() and m.accept_tokens(ids[-3:]) == 3 and m.is_completed()
    m.reset()
    assert m.num_accepted == 0 and m.forced_text() == '{"name":"'
    early = compiled.matcher()
    assert not early.accept_token(eos)  # EOS before the grammar can end: rejected, state kept
    assert early.accept_string('{"name":"')


def test_batched_fill_mixes_engines(smol_tokenizer):
    c = spec(PERSON, property_order="schema")
    matchers = [constrain.compile(c, smol_tokenizer, engine=e).matcher() for e in (*ENGINES, *ENGINES)]
    for m, prefix in zip(matchers, ["", "", '{"name": "A', '{"name": "A'], strict=True):
        assert m.accept_string(prefix) or not prefix
    vocab = matchers[0].compiled.vocab_size
    batched = constrain.allocate_token_bitmask(5, vocab)
    rows = [4, 0, 3, 1]
    constrain.fill_next_token_bitmasks(matchers, batched, indices=rows)
    for m, row in zip(matchers, rows, strict=True):
        single = constrain.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(single)
        assert torch.equal(batched[row], single[0])
    assert (batched[2] == -1).all()


WAIT_FOR_XGRAMMAR = constrain.AutoLimits(xgrammar_wait_s=None)
"""Routing alone, whatever the time xgrammar's compile takes on this machine."""


def test_auto_picks_llguidance_only_where_xgrammar_is_slow_to_compile(smol_tokenizer):
    light = spec(LIGHT_PERSON)
    heavy = spec({"type": "object", "properties": {"bio": {"type": "string", "maxLength": 1024}}})
    assert constrain.compile(light, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "xgrammar"
    compiled = constrain.compile(heavy, smol_tokenizer)
    assert compiled.engine == "llguidance"
    assert constrain.compile(heavy, smol_tokenizer) is compiled  # deterministic, and cached
    assert accepts(compiled, smol_tokenizer, '{"bio": "' + "ab" * 512 + '"}')
    assert not accepts(compiled, smol_tokenizer, '{"bio": "' + "ab" * 513 + '"}')
    # each limit of AutoLimits on its own: a bounded pattern (107 ms in xgrammar), an open object's
    # "any key but these" trie of 6+ rules (3 keys: 14 rules; one key of 9 letters: 11 rules, 90 to 110
    # ms; from 4 keys on, xgrammar's extra keys are any string), a schema too large to build xgrammar's
    # grammar for
    keys = {k: {"type": "integer"} for k in ("name", "age", "email")}
    for schema in (
        {"type": "string", "pattern": "^[A-Za-z0-9 ]{1,32}$"},
        {"type": "object", "properties": keys},
        {"type": "object", "properties": {"increment": {"type": "integer"}}},
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(400)}},
    ):
        assert constrain.compile(spec(schema), smol_tokenizer).engine == "llguidance", schema
    short = spec({"type": "object", "properties": {"age": {"type": "integer"}}})  # 4 rules
    assert constrain.compile(short, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "xgrammar"
    # a string's length bounds: maxLength 10 (31 ms in xgrammar; PERSON's maxLength 12: 70 ms, against 6 ms
    # without it) or minLength 5 (32 ms), not maxLength 8 (18 ms) or four strings that share minLength 1
    # (14 ms: one rule), nor a format's narrow classes repeated (uuid's [0-9a-fA-F]{8}...: 2 ms)
    for bounds, engine in (
        ({"maxLength": 10}, "llguidance"), ({"minLength": 5}, "llguidance"),
        ({"minLength": 2, "maxLength": 6}, "llguidance"),
        ({"maxLength": 8}, "xgrammar"), ({"minLength": 4}, "xgrammar"), ({"format": "uuid"}, "xgrammar"),
    ):  # fmt: skip
        compiled = constrain.compile(spec({"type": "string", **bounds}), smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR)
        assert compiled.engine == engine, bounds
    named = {k: {"type": "string", "minLength": 1} for k in "abcd"}
    shared = spec({"type": "object", "properties": named, "required": list(named), "additionalProperties": False})
    assert constrain.compile(shared, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "xgrammar"
    # a large grammar (more than AutoLimits.rules)
    alternatives = {f"k{i}": {"enum": [f"v{i}", i]} for i in range(60)}
    large = spec({"type": "object", "properties": alternatives, "additionalProperties": False})
    assert constrain.compile(large, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "llguidance"
    unlimited = constrain.AutoLimits(rules=10**6, xgrammar_wait_s=None)
    assert constrain.compile(large, smol_tokenizer, auto_limits=unlimited).engine == "xgrammar"
    # keys in any order: a prepared schema over 3,000 characters (here 4,175), whatever its rules
    names = {f"{'long_property_name_' * 4}{i}": {"type": "integer"} for i in range(40)}
    wide = {"type": "object", "properties": names, "additionalProperties": False}
    for order, engine in (("any", "llguidance"), ("schema", "xgrammar")):
        compiled = constrain.compile(spec(wide, property_order=order), smol_tokenizer, auto_limits=unlimited)
        assert compiled.engine == engine, order
    increment = spec({"type": "object", "properties": {"increment": {"type": "integer"}}})
    loose = constrain.AutoLimits(excluded_keys=12, xgrammar_wait_s=None)
    assert constrain.compile(increment, smol_tokenizer, auto_limits=loose).engine == "xgrammar"
    # three regular expressions (AutoLimits.patterns): MaskBench's o21850 took xgrammar 39 to 49 ms, llguidance 6
    coded = {k: {"type": "string", "pattern": f"^{k}[0-9]+$"} for k in "abc"}
    three = spec({"type": "object", "properties": coded, "additionalProperties": False})
    assert constrain.compile(three, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "llguidance"
    more = constrain.AutoLimits(patterns=4, xgrammar_wait_s=None)
    assert constrain.compile(three, smol_tokenizer, auto_limits=more).engine == "xgrammar"
    # a repetition bound over 128, which xgrammar cannot compile at all
    wide = constrain.compile(constrain.regex("[a-z]{1,129}"), smol_tokenizer)
    assert wide.engine == "llguidance" and accepts(wide, smol_tokenizer, "a" * 129)
    assert not accepts(wide, smol_tokenizer, "a" * 130)


def test_auto_falls_back_to_xgrammar_where_llguidance_refuses(smol_tokenizer):
    # llguidance calls the enum-against-pattern clash unsatisfiable; xgrammar takes the enum, and the
    # pattern is checked afterwards
    schema = {
        "type": "array",
        "prefixItems": [{"type": "string", "pattern": "^a$", "enum": ["b"]}, {"maxLength": 500}],
        "minItems": 2,
    }
    with pytest.raises(constrain.CompileError, match="unsatisfiable"):
        constrain.compile(spec(schema), smol_tokenizer, engine="llguidance")
    assert constrain.compile(spec(schema), smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR).engine == "xgrammar"
    # while xgrammar compiles, llguidance would serve it, but refuses: xgrammar is waited for
    now = constrain.AutoLimits(xgrammar_wait_s=0)
    assert constrain.compile(spec({**schema, "title": "now"}), smol_tokenizer, auto_limits=now).engine == "xgrammar"


def test_auto_falls_back_to_llguidance_where_xgrammar_refuses(smol_tokenizer):
    """xgrammar 0.2.8 refuses a subschema that merging made ``false`` here (an item's key that must be null and
    a string; MaskBench's ``Github_medium---o21061``, shrunk): ``"auto"`` then serves it with llguidance,
    with the wait for xgrammar or without."""
    items = {"allOf": [{"oneOf": [{"properties": {"e": {"type": "null"}}}]}], "properties": {"e": {"type": "string"}}}
    schema = {"properties": {"n": {"items": items}}}
    with pytest.raises(constrain.CompileError, match="cannot accept any value"):
        constrain.compile(spec(schema), smol_tokenizer, engine="xgrammar")
    for limits in (WAIT_FOR_XGRAMMAR, constrain.AutoLimits(xgrammar_wait_s=0)):
        compiled = constrain.compile(spec({**schema, "title": repr(limits)}), smol_tokenizer, auto_limits=limits)
        assert compiled.engine == "llguidance"
        assert accepts(compiled, smol_tokenizer, '{"n": [{"f": 1}]}')
        assert not accepts(compiled, smol_tokenizer, '{"n": [{"e": "x"}]}') or compiled.validate('{"n": [{"e": "x"}]}')


def test_auto_serves_with_llguidance_while_xgrammar_compiles(smol_tokenizer):
    """Past ``xgrammar_wait_s``, llguidance serves the constraint and xgrammar's compile goes on; once it
    lands in the cache, ``compile`` returns it. Both take keys in any order, and refuse the same texts."""
    now = constrain.AutoLimits(xgrammar_wait_s=0)
    schema = spec({**LIGHT_PERSON, "title": "served while xgrammar compiles"})
    first = constrain.compile(schema, smol_tokenizer, auto_limits=now)
    assert first.engine == "llguidance"
    deadline = time.monotonic() + 60
    while (later := constrain.compile(schema, smol_tokenizer, auto_limits=now)).engine != "xgrammar":
        assert time.monotonic() < deadline, "xgrammar's compile never landed"
        time.sleep(0.01)
    assert constrain.compile(schema, smol_tokenizer, auto_limits=WAIT_FOR_XGRAMMAR) is later
    texts = ['{"age": 7, "name": "Al"}', '{"name": "Al", "age": 7}', '{"name": "Al"}', '{"name": 7, "age": 7}']
    for text in texts:
        assert accepts(first, smol_tokenizer, text) == accepts(later, smol_tokenizer, text), text
    assert constrain.cache_stats()["caches"]["compile.upgrades"]["misses"] >= 1


@pytest.mark.parametrize(("cores", "wait"), [(1, None), (2, None), (4, 0.05), (16, 0.05)])
def test_the_wait_for_xgrammar_is_on_from_four_cores(monkeypatch, cores, wait):
    """On fewer cores a compile in the background slows every request (constrain.compiler.routing)."""
    monkeypatch.setattr(routing.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert routing.default_xgrammar_wait() == wait
    assert constrain.AutoLimits().xgrammar_wait_s == wait


def test_auto_limits_refuse_a_negative_wait():
    with pytest.raises(ValueError, match="xgrammar_wait_s"):
        constrain.AutoLimits(xgrammar_wait_s=-1)


def test_llguidance_serves_what_it_refuses_as_a_superset(smol_tokenizer):
    """Formats llguidance does not know, and minProperties beside optional keys, are dropped from its
    grammar and enforced by the mask at value boundaries instead (llguidance alone refuses the schema)."""
    schema = {
        "type": "object",
        "properties": {"u": {"type": "string", "format": "uri-reference"}, "v": {"type": "integer"}},
        "minProperties": 1,
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine="llguidance")
    refused = {e.keyword: e for e in compiled.coverage if "llguidance serves" in e.note}
    assert set(refused) == {"format", "minProperties"}
    assert all(e.status == "enforced" for e in refused.values()) and "uri-reference" in refused["format"].note
    assert all("value boundaries" in e.note for e in refused.values())  # the mask takes them over
    assert compiled.fully_enforced
    assert accepts(compiled, smol_tokenizer, '{"u": "a/b?c", "v": 1}')
    assert not accepts(compiled, smol_tokenizer, '{"u": 1}')  # the rest is still enforced
    for text in ('{"u": "a/b?c"}', '{"v": 2}'):
        assert accepts(compiled, smol_tokenizer, text) and compiled.validate(text) == []
    assert compiled.validate("{}") and not accepts(compiled, smol_tokenizer, "{}")  # minProperties, at the "}"
    assert compiled.validate('{"u": "\\\\bad ref"}')  # not a URI reference


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_patterns_are_anchored_on_both_engines(smol_tokenizer, engine):
    """JSON Schema's ``pattern`` is a search: anchors hold in the grammar itself on both engines (not only
    in ``validate``), and an unanchored end matches anything."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "b": {"type": "string", "pattern": "x"}},
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    assert accepts(compiled, smol_tokenizer, '{"a": "00ff", "b": "yxy"}')
    for bad in ('{"a": "z00ff"}', '{"a": "00ffz"}', '{"a": "00f"}', '{"b": "yy"}'):
        assert not accepts(compiled, smol_tokenizer, bad), bad


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_pattern_holds_beside_a_format_on_both_engines(smol_tokenizer, engine):
    """xgrammar 0.2.8 writes a string's format and drops its ``pattern`` beside it: ``"ftp://invalid.com"``
    went through its mask under ``format: uri`` and ``pattern: ^(wss?|wss?\\+unix)://`` (MaskBench's
    ``Github_medium---o70464.json``). There the value checks hold the pattern, as the string completes; where
    the format leaves no way to a match (a date under ``^2`` that began with ``1``), the value is a dead end,
    taken and reported (``Matcher.dead_ends``), never passed silently."""
    schema = {
        "type": "object",
        "properties": {
            "url": {"type": "string", "format": "uri", "pattern": "^wss?://"},
            "day": {"type": "string", "format": "date", "pattern": "^2"},
        },
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    for good in ('{"url": "ws://a.b"}', '{"url": "wss://a.b/c"}', '{"day": "2020-01-01"}'):
        assert accepts(compiled, smol_tokenizer, good), good
    for bad in ('{"url": "ftp://a.b"}', '{"url": "ws://a b"}', '{"day": "2020-13-45"}'):
        assert not accepts(compiled, smol_tokenizer, bad), bad
    taken, matcher = walk(compiled, token_ids(smol_tokenizer, '{"day": "1999-01-01"}'))
    assert not taken or matcher.dead_ends


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("bound", [{}, {"minimum": 0}, {"maximum": 1000}, {"exclusiveMinimum": -1}])
def test_an_integers_multiple_of_holds_beside_a_bound_on_both_engines(smol_tokenizer, engine, bound):
    """xgrammar 0.2.8 writes an integer's range and drops its ``multipleOf`` beside a bound: under
    ``minimum: 0`` and ``multipleOf: 12``, its mask let ``{"length": 25}`` through (MaskBench's
    ``Github_trivial---o83695.json``). There the value checks hold it, as the number is written."""
    schema = {"type": "object", "properties": {"length": {"type": "integer", "multipleOf": 12, **bound}}}
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    for good in ('{"length": 24}', '{"length": 0}', '{"length": 996}'):
        assert accepts(compiled, smol_tokenizer, good), good
    for bad in ('{"length": 25}', '{"length": 1}', '{"length": 250}'):
        assert not accepts(compiled, smol_tokenizer, bad), bad


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_pattern_keys_are_refused_as_they_are_written_on_both_engines(smol_tokenizer, engine):
    """Beside ``additionalProperties: false``, a key no pattern nor declared name can match is refused by the
    mask at its first character that rules them out, not only at its closing quote (vLLM samples with no
    way back: a key refused at its quote is written on until ``max_tokens``). The patterns are searches."""
    schema = {
        "type": "object",
        "properties": {"id": {"type": "string"}},
        "patternProperties": {"^x-[a-z]+$": {"type": "integer"}, "^_v": {"type": "boolean"}},
        "additionalProperties": False,
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    assert set(compiled.engine_schema["patternProperties"]) == {"^(?:x-[a-z]+)$", "^(?:_v).*$"}
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"'))
    assert ok
    bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = allowed_ids(bitmask[0], compiled.vocab_size)
    one = {text: token_ids(smol_tokenizer, text)[0] for text in ("x", "i", "_", "b", "y")}
    assert {one["x"], one["i"], one["_"]} <= allowed and not {one["b"], one["y"]} & allowed
    for text, valid in [
        ('{"id": "s", "x-ab": 1}', True),  # llguidance takes declared keys first
        ('{"_vb": true}', True),
        ('{"a_v": true}', False),
        ('{"x-": 1}', False),
        ('{"y-ab": 1}', False),
        ('{"x-ab1": 1}', False),
    ]:
        assert accepts(compiled, smol_tokenizer, text) == valid, text
    assert not accepts(compiled, smol_tokenizer, '{"x-ab": true}')  # the pattern's own schema, in the grammar too

    entry = next(e for e in compiled.coverage if e.keyword == "patternProperties")
    assert "refused by the mask" in entry.note
    assert compiled.engine_schema["patternProperties"]["^(?:x-[a-z]+)$"] == {}  # any value: the order stays free
    generating = constrain.compile(constrain.json_schema(schema), smol_tokenizer, engine=engine)
    assert generating.engine_schema["patternProperties"]["^(?:x-[a-z]+)$"] == {"type": "integer"}  # written by it
    assert accepts(generating, smol_tokenizer, '{"id": "s", "x-ab": 1}')


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_pattern_keys_go_with_the_object_branch_of_an_untyped_schema(smol_tokenizer, engine):
    """Without ``type``, the schema is split by type for the engine: the patterns go with the object branch
    (with ``additionalProperties``), or that branch would take no key at all."""
    schema = {"patternProperties": {"^[a-z]+://": {}}, "additionalProperties": False}
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    for text, valid in [('{"http://x": 1, "ab://y": "z"}', True), ("5", True), ('{"http:x": 1}', False)]:
        assert accepts(compiled, smol_tokenizer, text) == valid, text


@pytest.mark.parametrize(
    "schema",
    [
        {"patternProperties": {"(^a|b)c": {}}, "additionalProperties": False},  # an anchor inside
        {"patternProperties": {"^a": {}, "b$": {}}, "additionalProperties": False},  # "ab" matches both
        {"patternProperties": {"^x": {}}},  # other keys are allowed anyway
        {"patternProperties": {"^x": {}}, "additionalProperties": {"type": "integer"}},
    ],
)
def test_pattern_keys_stay_checked_where_the_engine_cannot_hold_them(smol_tokenizer, schema):
    compiled = constrain.compile(spec({"type": "object", **schema}), smol_tokenizer)
    assert "patternProperties" not in compiled.engine_schema
    entry = next(e for e in compiled.coverage if e.keyword == "patternProperties")
    assert "refused by the mask" not in entry.note


def test_pattern_keys_anchored_per_alternative_are_the_engines(smol_tokenizer):
    """``^a|b$``: each alternative binds its own anchor (a key that starts with ``a`` or ends with ``b``), which
    the engine holds, padded alternative by alternative."""
    schema = {"type": "object", "patternProperties": {"^a|b$": {}}, "additionalProperties": False}
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    assert compiled.engine_schema["patternProperties"] == {"^(?:a.*|.*b)$": {}}
    for text, valid in [('{"ax": 1}', True), ('{"xb": 1}', True), ('{"xa": 1}', False), ('{"bx": 1}', False)]:
        assert accepts(compiled, smol_tokenizer, text) == valid, text


def test_engine_name_is_checked(smol_tokenizer):
    with pytest.raises(ValueError, match="engine must be one of"):
        constrain.compile(constrain.regex("a"), smol_tokenizer, engine="outlines")
    with pytest.raises(constrain.CompileError, match="JSON schemas and regexes"):
        constrain.compile(constrain.choice(["a"]), smol_tokenizer, engine="llguidance")


def test_gemma_sentencepiece_vocabulary(gemma_tokenizer):
    compiled = constrain.compile(spec(PERSON), gemma_tokenizer, engine="llguidance")
    for text, valid in TEXTS[:4]:
        assert accepts(compiled, gemma_tokenizer, text) == valid


def test_slow_for_xgrammar_tells_a_strings_bounds_from_other_repetitions():
    from constrain.compiler.routing import slow_for_xgrammar

    ebnf = 'root ::= (("\\"" name_chars{0, 8} "\\"") ("a" | "b"){2, 5} digits{4, 4})\n'
    ebnf += 'name_chars ::= (([^"\\\\\\0-\\x1f]))\ndigits ::= (([0-9]))\n'
    limits = constrain.AutoLimits(xgrammar_wait_s=None)
    assert not slow_for_xgrammar(ebnf, limits)
    # the string's bound (8) counts towards string_repeat, the group's and the digits' (5 + 4) towards repeat
    assert slow_for_xgrammar(ebnf, constrain.AutoLimits(string_repeat=8, xgrammar_wait_s=None))
    assert not slow_for_xgrammar(ebnf, constrain.AutoLimits(string_repeat=9, repeat=10, xgrammar_wait_s=None))
    assert slow_for_xgrammar(ebnf, constrain.AutoLimits(string_repeat=9, repeat=9, xgrammar_wait_s=None))
