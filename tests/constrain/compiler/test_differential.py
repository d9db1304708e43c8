"""Both engines enforce the same language for the same constraint (issue 13): a differential test.

xgrammar and llguidance compile the same ``json_schema`` constraint; every text (MaskBench's
instances, instances drawn by hypothesis-jsonschema, labelled mutations) is walked through both
engines' masks, and the two verdicts must be the same. In generation mode they must agree
everywhere, except the causes listed in ``KNOWN_GENERATION`` (each with its reason); in
specification mode the disagreements are counted and must stay within ``SPECIFICATION_BOUND``.
``python bench/differential.py`` runs the same comparison on a larger sample and prints the counts.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

import constrain
from constrain.backends.xgrammar import KEYS_MAX
from constrain.testing import (
    DIFFERENTIAL_MODES,
    DifferentialCounts,
    accepts,
    hypothesis_instances,
    mutations,
    run_differential,
    schema_ordered,
    text_mutations,
)

DATA = Path(__file__).resolve().parents[4] / "shared" / "maskbench" / "dev.jsonl.gz"
SAMPLE = 40
"""MaskBench dev schemas in the seeded sample (45 to 60 s on 2 shared CPU cores)."""
SEED = 0
SAMPLE_OPTIONS: dict[str, Any] = {
    "hypothesis_count": 1,
    "seed": SEED,
    "hypothesis_time_s": 0.5,
    "compile_timeout_s": 3.0,
    "max_chars": 1500,
}
"""Smaller than the bench's defaults, so that the sample takes under a minute."""

KNOWN_GENERATION: dict[str, str] = {
    "string: escape in a length-bounded string": "xgrammar spells a character of a string with minLength or "
    "maxLength without escapes (constrain.backends.xgrammar._JSON_CHARACTER: 300x faster masks); llguidance takes them",
    "xgrammar accepts a violation of format": "xgrammar's format regexes are looser than the format checker "
    "(a date takes days 29 to 31 in every month; llguidance checks the calendar); validate() flags the text",
    "llguidance grammar superset: minProperties": "llguidance refuses minProperties beside optional keys: dropped "
    "and checked by validate() (constrain.compiler.json_schema.llguidance_schema)",
    "llguidance grammar superset: maxProperties": "as minProperties",
    "llguidance mask narrower than its grammar": "where the grammar forces bytes (the rest of an enum value, a "
    "key), llguidance's mask allows its own tokenization of them only; xgrammar's, every one",
    "number: bounds": "xgrammar's grammar for a number with bounds takes at most 6 fraction digits; llguidance any",
    "key: escape": "xgrammar matches a key's pattern (patternProperties beside additionalProperties: false) against "
    "the key as written, so a key with an escape (json.dumps writes a control character as \\u00XX) is refused; "
    "llguidance takes it",
}
"""Causes of generation-mode disagreements that are known approximations, with the reason."""

REPORTED_GENERATION: dict[str, str] = {
    "property named like an annotation": "xgrammar 0.2.8 drops properties named description, title, default or "
    "examples from an object equal, without them, to one converted before",
}
"""Disagreements from an engine's bug that constrain does not work around yet: tolerated in the sample, and
each has a minimal reproduction below (``REPORTED_EXAMPLES``, xfail)."""

KNOWN_SPECIFICATION: dict[str, str] = {
    **KNOWN_GENERATION,
    "key order": "llguidance takes declared properties in the schema's order where one of its object's own "
    "patternProperties may match a declared name (constrain.compiler.json_schema.llguidance_schema); xgrammar "
    "takes any order",
    "xgrammar grammar superset: additionalProperties": "past OPEN_KEY_RULES_MAX, xgrammar's extra keys of an open "
    "object are any string, declared ones included, with any value; validate() flags the text",
    "xgrammar grammar superset: required": "xgrammar's any-order object can skip a required key beside optional "
    "or extra keys; coverage says checked and validate() flags the text",
    "xgrammar grammar superset: additionalProperties/required": "both of the above",
}
"""Causes of specification-mode disagreements that are known approximations, with the reason."""

REPORTED_SPECIFICATION: dict[str, str] = {**REPORTED_GENERATION}

SPECIFICATION_BOUND = 0.35
"""Most specification-mode texts that may disagree, as a share of the texts compared (25% on 400 schemas)."""
UNEXPLAINED_SPECIFICATION_BOUND = 0.03
"""Most specification-mode texts that may disagree for a cause neither known nor reported."""


def _merge(found: list[dict[str, DifferentialCounts]]) -> dict[str, DifferentialCounts]:
    total = {mode: DifferentialCounts(mode) for mode in DIFFERENTIAL_MODES}
    for counts in found:
        for mode, c in counts.items():
            total[mode].add(c)
    return total


def _report(c: DifferentialCounts, known: dict[str, str], reported: dict[str, str]) -> str:
    """The counts and causes of ``c``, with the examples of every cause neither known nor reported."""
    lines = [
        f"{c.mode}: {c.compiled} schemas compiled by both, {c.texts} texts, {c.disagreements} disagreements "
        f"({c.xgrammar_only} xgrammar-only accepts, {c.llguidance_only} llguidance-only accepts)"
    ]
    for cause, tally in sorted(c.causes.items()):
        tag = "known" if cause in known else "reported" if cause in reported else "UNEXPLAINED"
        lines.append(f"  {tag} {cause}: {tally}")
        if tag == "UNEXPLAINED":
            lines += [f"    {json.dumps(example, ensure_ascii=False)}" for example in c.examples[cause]]
    return "\n".join(lines)


def _unexplained(c: DifferentialCounts, known: dict[str, str], reported: dict[str, str]) -> int:
    """Disagreements whose cause is neither known nor reported."""
    return sum(t["xgrammar"] + t["llguidance"] for cause, t in c.causes.items() if cause not in known | reported)


@pytest.fixture(scope="module")
def maskbench_counts(smol_tokenizer) -> dict[str, DifferentialCounts]:
    if not DATA.is_file():
        pytest.skip(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    sample = random.Random(SEED).sample(entries, SAMPLE)
    return _merge(
        [run_differential(e["name"], e["schema"], e["tests"], smol_tokenizer, **SAMPLE_OPTIONS) for e in sample]
    )


HAND_WRITTEN: list[tuple[str, dict[str, Any], list[Any]]] = [
    (
        "closed object",
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name"], "additionalProperties": False},
        [{"name": "Al", "age": 7}, {"name": "Bo"}, {"age": 7, "name": "Cy"}],
    ),
    (
        "additionalProperties with a schema",
        {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        [{"id": 1, "note": "x"}, {"note": "y"}, {"id": 2, "a": "b", "c": "d"}],
    ),
    (
        "patternProperties",
        {"type": "object", "properties": {"name": {"type": "string"}},
         "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
        [{"name": "n", "x-a": 1}, {"x-b": 2, "x-c": 3}, {}],
    ),
    (
        "nested objects",
        {"type": "object", "required": ["user"], "properties": {"user": {"type": "object", "required": ["address"],
         "properties": {"name": {"type": "string"}, "address": {"type": "object", "required": ["city"],
         "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
        [{"user": {"name": "A", "address": {"city": "Paris", "zip": "75001"}}}, {"user": {"address": {"city": "X"}}}],
    ),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        [["a", 1], ["b"], []],
    ),
    (
        "prefixItems then items",
        {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"}, "maxItems": 3},
        [["a", True, False], ["b"]],
    ),
    (
        "enums",
        {"type": "object", "properties": {"color": {"enum": ["red", "green", 1, None]}, "size": {"const": "L"}},
         "required": ["color"]},
        [{"color": "red", "size": "L"}, {"color": 1}, {"color": None}],
    ),
    (
        "open object (duplicate keys)",
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        [{"a": 1, "b": [1, {"c": 2}]}, {"b": {}}],
    ),
]  # fmt: skip
"""Schemas that exercise what differs most between the engines' JSON Schema converters, with valid
instances (each also mutated, see ``run_differential``)."""


@pytest.fixture(scope="module")
def hand_written_counts(smol_tokenizer) -> dict[str, DifferentialCounts]:
    return _merge(
        [
            run_differential(name, schema, [{"valid": True, "data": d} for d in data], smol_tokenizer, seed=SEED)
            for name, schema, data in HAND_WRITTEN
        ]
    )


def test_generation_mode_engines_agree_on_maskbench(maskbench_counts):
    c = maskbench_counts["generation"]
    print(_report(c, KNOWN_GENERATION, REPORTED_GENERATION))
    assert c.compiled >= SAMPLE * 0.8, c.refusals
    assert c.texts >= 5 * c.compiled
    assert not c.errors, c.errors
    assert _unexplained(c, KNOWN_GENERATION, REPORTED_GENERATION) == 0, _report(
        c, KNOWN_GENERATION, REPORTED_GENERATION
    )


def test_specification_mode_disagreements_within_bound(maskbench_counts):
    c = maskbench_counts["specification"]
    report = _report(c, KNOWN_SPECIFICATION, REPORTED_SPECIFICATION)
    print(report)
    assert c.compiled >= SAMPLE * 0.8, c.refusals
    assert not c.errors, c.errors
    assert c.disagreements <= SPECIFICATION_BOUND * c.texts, report
    assert _unexplained(c, KNOWN_SPECIFICATION, REPORTED_SPECIFICATION) <= UNEXPLAINED_SPECIFICATION_BOUND * c.texts, (
        report
    )


def test_generation_mode_engines_agree_on_hand_written_schemas(hand_written_counts):
    c = hand_written_counts["generation"]
    assert c.compiled == len(HAND_WRITTEN), c.refusals
    assert c.both_accept > 0 and c.both_reject > 0
    assert _unexplained(c, KNOWN_GENERATION, REPORTED_GENERATION) == 0, _report(c, KNOWN_GENERATION, {})


def test_specification_mode_hand_written_disagreements_are_known(hand_written_counts):
    c = hand_written_counts["specification"]
    assert c.compiled == len(HAND_WRITTEN), c.refusals
    assert _unexplained(c, KNOWN_SPECIFICATION, REPORTED_SPECIFICATION) == 0, _report(
        c, KNOWN_SPECIFICATION, REPORTED_SPECIFICATION
    )


FIXED_EXAMPLES = [
    (
        "keywords beside anyOf",
        "generation",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
         "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        '{"a": "x"}',
    ),
    ("keywords beside anyOf", "generation", {"properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
     '{"a": 1}'),
    ("required key not in properties", "generation", {"type": "object", "required": ["a"]}, '{"b": 1}'),
]  # fmt: skip
"""Disagreements this harness found and constrain/schema.py fixed (issue 13): (cause, mode, schema, text)."""


@pytest.mark.parametrize(("cause", "mode", "schema", "text"), FIXED_EXAMPLES)
def test_fixed_disagreement_stays_fixed(smol_tokenizer, cause, mode, schema, text):
    verdicts = [
        accepts(constrain.compile(constrain.json_schema(schema, mode=mode), smol_tokenizer, engine=e), smol_tokenizer,
                text)
        for e in ("xgrammar", "llguidance")
    ]  # fmt: skip
    assert verdicts[0] == verdicts[1], (cause, verdicts)


def test_required_in_any_order_is_enforced_by_the_grammar(smol_tokenizer):
    """Keys in any order on xgrammar: the grammar follows which keys came (at most KEYS_MAX per object), so it
    refuses the closing brace of an object without a required key, and a key written twice in an object
    that takes no others, with no value checks or key guard left on the per-token path."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine="xgrammar")
    assert not any(e.keyword == "required" and e.status != "enforced" for e in compiled.coverage)
    assert not compiled.matcher().checks_tokens  # nothing for Python to do per token
    for text in ('{"b": 1}', "{}"):
        assert compiled.validate(text) and not accepts(compiled, smol_tokenizer, text), text
    for text in ('{"a": 1, "a": 2}', '{"b": 1, "a": 2, "b": 3}'):  # valid as JSON parsers read them (the last wins)
        assert not accepts(compiled, smol_tokenizer, text), text
    for text in ('{"b": 1, "a": 2}', '{"a": 2}', '{"a": 2, "b": 1}'):
        assert accepts(compiled, smol_tokenizer, text), text


def test_required_in_any_order_past_the_grammar_is_enforced_at_the_object_end(smol_tokenizer):
    """An object requiring more keys than the grammar follows (xgrammar's any-order objects then can skip
    one): coverage says so, and the mask refuses the closing brace of an object without it
    (constrain.match.values)."""
    names = "abcdef"
    schema = {"type": "object", "properties": {name: {"type": "integer"} for name in names},
              "required": list(names[: KEYS_MAX + 1])}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine="xgrammar")
    entry = next(e for e in compiled.coverage if e.keyword == "required" and "any order" in e.note)
    assert entry.status == "enforced" and "value boundaries" in entry.note
    missing = '{"b": 1, "c": 1, "d": 1, "e": 1, "f": 1}'
    assert compiled.validate(missing) and not accepts(compiled, smol_tokenizer, missing)
    assert accepts(compiled, smol_tokenizer, '{"e": 1, "d": 1, "c": 1, "b": 1, "a": 2}')


REPORTED_EXAMPLES = [
    (
        "property named like an annotation",
        "generation",
        {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                          "b": {"type": "object", "properties": {"description": {"type": "string"}}}}},
        '{"b": {"description": "x"}}',
    ),
]  # fmt: skip
"""A minimal reproduction of each reported disagreement: (cause, mode, schema, text)."""


@pytest.mark.parametrize(
    ("cause", "mode", "schema", "text"),
    [pytest.param(*example, marks=pytest.mark.xfail(strict=False, reason=REPORTED_SPECIFICATION[example[0]]))
     for example in REPORTED_EXAMPLES],
)  # fmt: skip
def test_reported_disagreement_is_fixed(smol_tokenizer, cause, mode, schema, text):
    """Xfail, not strict: xgrammar's bug shows only where an equal object was converted before in the
    process, so whether it shows here depends on which tests ran first (a fresh clone's run passed it
    once, 2026-11-28). Once the engines agree for good, the cause leaves ``REPORTED_*`` (and this list)."""
    verdicts = {
        engine: accepts(constrain.compile(constrain.json_schema(schema, mode=mode), smol_tokenizer, engine=engine),
                        smol_tokenizer, text)
        for engine in ("xgrammar", "llguidance")
    }  # fmt: skip
    assert verdicts["xgrammar"] == verdicts["llguidance"], cause


DUPLICATE_KEY_TEXTS = [
    ({"type": "object"}, '{"a": 1, "a": 1}', '{"a": 1, "b": 1}'),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        '{"a": 1, "b": 2, "a": 3}',
        '{"a": 1, "b": 2, "c": 3}',
    ),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"k": 1, "k": 2}', '{"k": 1, "j": 2}'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"xa": 1, "xa": 1}', '{"xa": 1, "xb": 1}'),
    (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        '{"xa": 1, "xa": 1}',
        '{"xa": 1, "xb": 1}',
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "additionalProperties": False},
        '{"a": 1, "b": 1, "a": 2}',
        '{"a": 1, "b": 1}',
    ),
    ({"type": "array", "items": {"type": "object"}}, '[{"a": {}, "a": []}]', '[{"a": {}, "b": []}]'),
]
"""(schema, a text with a key written twice, the same text with distinct keys)."""


@pytest.mark.parametrize("mode", DIFFERENTIAL_MODES)
@pytest.mark.parametrize(("schema", "duplicate", "distinct"), DUPLICATE_KEY_TEXTS)
def test_both_engines_reject_a_key_written_twice(smol_tokenizer, schema, duplicate, distinct, mode):
    for engine in ("xgrammar", "llguidance"):
        compiled = constrain.compile(constrain.json_schema(schema, mode=mode), smol_tokenizer, engine=engine)
        assert not accepts(compiled, smol_tokenizer, duplicate), engine
        assert accepts(compiled, smol_tokenizer, distinct), engine


def test_the_comparison_sees_a_disagreement(smol_tokenizer):
    """The harness is not vacuous: xgrammar's fraction digits under bounds show up in both modes."""
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}}
    counts = run_differential("bounded number", schema, [{"valid": True, "data": {"x": 0.12345678}}], smol_tokenizer,
                              hypothesis_count=0)  # fmt: skip
    for mode in DIFFERENTIAL_MODES:
        assert counts[mode].causes["number: bounds"]["llguidance"] >= 1, mode


def test_both_engines_take_keys_in_any_order_in_specification_mode(smol_tokenizer):
    """llguidance writes declared properties in the schema's order; given as patterns, in any order
    (constrain.compiler.json_schema.llguidance_schema). Its required keys are checked at the object's end."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    counts = run_differential("three keys", schema, [{"valid": True, "data": {"b": 1, "a": "x"}}], smol_tokenizer,
                              hypothesis_count=0)  # fmt: skip
    assert "key order" not in counts["specification"].causes
    spec = constrain.json_schema(schema, mode="specification")
    compiled = constrain.compile(spec, smol_tokenizer, engine="llguidance")
    assert accepts(compiled, smol_tokenizer, '{"b": 1, "c": null, "a": "x"}')
    assert not accepts(compiled, smol_tokenizer, '{"b": 1, "c": null}')  # a required key missing
    assert not accepts(compiled, smol_tokenizer, '{"b": "1", "a": "x"}')  # each key's own schema
    assert not accepts(compiled, smol_tokenizer, '{"b": 1, "d": 1, "a": "x"}')  # no other key
    entry = next(e for e in compiled.coverage if e.keyword == "required" and "any order" in e.note)
    assert entry.status == "enforced" and "value boundaries" in entry.note
    # names that regexes read as more than themselves are matched as written
    odd = {"type": "object", "properties": {"$schema": {"type": "string"}, "a.b": {}, "x-y (z)": {}},
           "additionalProperties": False}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(odd, mode="specification"), smol_tokenizer, engine="llguidance")
    assert accepts(compiled, smol_tokenizer, '{"x-y (z)": 1, "a.b": 2, "$schema": "s"}')
    assert not accepts(compiled, smol_tokenizer, '{"aXb": 2}')  # "." is no wildcard
    assert not accepts(compiled, smol_tokenizer, '{"$schema": 1}')
    # beside the object's own patterns (a compose file's "^x-" extensions), where no declared name matches one
    engine = "llguidance"
    extended = {**schema, "patternProperties": {"^x-": {"type": "integer"}}}
    compiled = constrain.compile(constrain.json_schema(extended, mode="specification"), smol_tokenizer, engine=engine)
    assert accepts(compiled, smol_tokenizer, '{"b": 1, "x-q": 2, "a": "x"}')
    assert not accepts(compiled, smol_tokenizer, '{"b": 1, "x-q": "2", "a": "x"}')
    assert not accepts(compiled, smol_tokenizer, '{"b": 1, "y": 2, "a": "x"}')
    clash = {**extended, "properties": {**schema["properties"], "x-a": {"type": "string"}}}  # "x-a": both schemas
    compiled = constrain.compile(constrain.json_schema(clash, mode="specification"), smol_tokenizer, engine=engine)
    assert "properties" in compiled.engine_schema


def test_schema_ordered_follows_the_schema_through_refs_and_branches():
    schema = {
        "$defs": {"item": {"type": "object", "properties": {"x": {}, "y": {}}}},
        "type": "object",
        "properties": {"b": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                       "a": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"q": {}, "p": {}}}]}},
    }  # fmt: skip
    data = {"extra": 0, "a": {"p": 1, "q": 2}, "b": [{"y": 1, "x": 2}]}
    ordered = schema_ordered(data, schema)
    assert json.dumps(ordered) == '{"b": [{"x": 2, "y": 1}], "a": {"q": 2, "p": 1}, "extra": 0}'


def test_mutations_are_labelled_and_change_the_first_place_they_apply():
    schema = {"type": "object", "properties": {"n": {"type": "string"}, "l": {"type": "array"}}, "required": ["n"]}
    found = dict(mutations({"n": "a", "l": [1]}, schema))
    assert found == {
        "drop required key": {"l": [1]},
        "undeclared key": {"n": "a", "l": [1], "zz_undeclared": 1},
        "change type": {"n": 12345, "l": [1]},
        "extra item": {"n": "a", "l": [1, 1]},
    }
    texts = dict(text_mutations('{"n":"a,b","l":[1]}'))
    assert texts["duplicate key"] == '{"n":"a,b","n":"a,b","l":[1]}'
    assert texts["whitespace: two spaces"] == '{"n":  "a,b","l":[1]}'
    assert texts["whitespace: newline"] == '{"n":\n"a,b","l":[1]}'
    assert dict(text_mutations('{"n": "a", "l": []}'))["duplicate key"] == '{"n": "a", "n": "a", "l": []}'


def test_hypothesis_instances_are_seeded_and_bounded():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = hypothesis_instances(schema, count=3, seed=1, time_limit_s=30)
    assert first == hypothesis_instances(schema, count=3, seed=1, time_limit_s=30)
    assert 1 <= len(first) <= 3 and all(isinstance(v, dict) and isinstance(v["a"], int) for v in first)
    recursive = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert hypothesis_instances(recursive, count=2) == []  # the library cannot handle it: skipped
