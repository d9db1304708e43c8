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

DATA = Path(__file__).resolve().parents[3] / "shared" / "maskbench" / "dev.jsonl.gz"
SAMPLE = 40
"""MaskBench dev schemas in the seeded sample (about 40 s on 2 CPU cores)."""
SEED = 0
SAMPLE_OPTIONS: dict[str, Any] = {
    "hypothesis_count": 2,
    "seed": SEED,
    "hypothesis_time_s": 0.5,
    "compile_timeout_s": 3.0,
    "max_chars": 2000,
}
"""Smaller than the bench's defaults, so that the sample takes under a minute."""

KNOWN_GENERATION: dict[str, str] = {}
"""Causes of generation-mode disagreements that are known approximations, with the reason."""

KNOWN_SPECIFICATION: dict[str, str] = {
    "key order": "llguidance takes declared properties in the schema's order only (compile()'s docstring); "
    "xgrammar takes any order",
}
"""Causes of specification-mode disagreements that are known approximations, with the reason."""

SPECIFICATION_BOUND = 0.25
"""Most specification-mode texts that may disagree, as a share of the texts compared."""
UNEXPLAINED_SPECIFICATION_BOUND = 0.02
"""Most specification-mode texts that may disagree for a cause not in ``KNOWN_SPECIFICATION``."""


def _merge(found: list[dict[str, DifferentialCounts]]) -> dict[str, DifferentialCounts]:
    total = {mode: DifferentialCounts(mode) for mode in DIFFERENTIAL_MODES}
    for counts in found:
        for mode, c in counts.items():
            total[mode].add(c)
    return total


def _report(c: DifferentialCounts, known: dict[str, str]) -> str:
    lines = [
        f"{c.mode}: {c.compiled} schemas compiled by both, {c.texts} texts, {c.disagreements} disagreements "
        f"({c.xgrammar_only} xgrammar-only accepts, {c.llguidance_only} llguidance-only accepts)"
    ]
    for cause, tally in sorted(c.causes.items()):
        tag = "known" if cause in known else "UNEXPLAINED"
        lines.append(f"  {tag} {cause}: {tally}")
        if cause not in known:
            lines += [f"    {json.dumps(example, ensure_ascii=False)}" for example in c.examples[cause]]
    return "\n".join(lines)


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


def _unexplained(c: DifferentialCounts, known: dict[str, str]) -> int:
    return sum(t["xgrammar"] + t["llguidance"] for cause, t in c.causes.items() if cause not in known)


def test_generation_mode_engines_agree_on_maskbench(maskbench_counts):
    c = maskbench_counts["generation"]
    assert c.compiled >= SAMPLE * 0.8, c.refusals
    assert c.texts >= 10 * c.compiled
    assert _unexplained(c, KNOWN_GENERATION) == 0, _report(c, KNOWN_GENERATION)


def test_specification_mode_disagreements_within_bound(maskbench_counts):
    c = maskbench_counts["specification"]
    print(_report(c, KNOWN_SPECIFICATION))
    assert c.compiled >= SAMPLE * 0.8, c.refusals
    assert c.disagreements <= SPECIFICATION_BOUND * c.texts, _report(c, KNOWN_SPECIFICATION)
    assert _unexplained(c, KNOWN_SPECIFICATION) <= UNEXPLAINED_SPECIFICATION_BOUND * c.texts, _report(
        c, KNOWN_SPECIFICATION
    )


def test_generation_mode_engines_agree_on_hand_written_schemas(hand_written_counts):
    c = hand_written_counts["generation"]
    assert c.compiled == len(HAND_WRITTEN), c.refusals
    assert c.both_accept > 0 and c.both_reject > 0
    assert _unexplained(c, KNOWN_GENERATION) == 0, _report(c, KNOWN_GENERATION)


def test_specification_mode_hand_written_disagreements_are_known(hand_written_counts):
    c = hand_written_counts["specification"]
    assert c.compiled == len(HAND_WRITTEN), c.refusals
    assert _unexplained(c, KNOWN_SPECIFICATION) == 0, _report(c, KNOWN_SPECIFICATION)


DUPLICATE_KEY_TEXTS = [
    ({"type": "object"}, '{"a":1,"a":1}', '{"a":1,"b":1}'),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        '{"a":1,"b":2,"a":3}',
        '{"a":1,"b":2,"c":3}',
    ),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"k":1,"k":2}', '{"k":1,"j":2}'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"xa":1,"xa":1}', '{"xa":1,"xb":1}'),
    ({"type": "array", "items": {"type": "object"}}, '[{"a":{},"a":[]}]', '[{"a":{},"b":[]}]'),
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
    """The harness is not vacuous: llguidance's schema-order-only keys show up in specification mode."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    counts = run_differential("two keys", schema, [{"valid": True, "data": {"b": 1, "a": "x"}}], smol_tokenizer,
                              hypothesis_count=0)  # fmt: skip
    spec = counts["specification"]
    assert spec.causes["key order"]["xgrammar"] >= 1
    assert counts["generation"].disagreements == 0


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
