"""The guarantees table (constrain.testing.guarantees): complete, and true of the compiled masks."""

from __future__ import annotations

import json
from typing import get_args

import jsonschema
import pytest

import constrain
from constrain.compiler.json_schema import AT_BOUNDARIES
from constrain.constraints.formats import FORMATS
from constrain.testing import accepts
from constrain.testing import guarantees as g

CORE_AND_ANNOTATIONS = (
    "$id", "$schema", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary", "$comment", "$defs",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "contentEncoding", "contentMediaType", "contentSchema",
)  # fmt: skip
"""Draft 2020-12 keywords that are not assertions (so not in jsonschema's VALIDATORS)."""


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return g.tokenizer()
    except constrain.ModelNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def rows(tokenizer) -> dict[str, g.Row]:
    return {row.keyword: row for row in g.keyword_rows()}


def _compile(schema, mode, tokenizer):
    return constrain.compile(constrain.json_schema(schema, mode=mode), tokenizer)


def test_every_draft_2020_12_keyword_has_a_row(rows):
    asserted = set(jsonschema.Draft202012Validator.VALIDATORS) - {"$dynamicRef", "$ref"}
    expected = asserted | set(CORE_AND_ANNOTATIONS) | {"definitions", "dependencies"}
    assert expected <= set(rows)
    assert {keyword for keyword, _ in g.draft_keywords()} == set(rows)


def test_every_keyword_has_an_example_written_for_it():
    # a keyword added to the metaschemas gets a row with a placeholder example: write one for it here
    assert {keyword for keyword, _ in g.draft_keywords()} <= set(g.EXAMPLES)


def test_every_status_is_one_of_the_documented_ones(rows):
    allowed = set(get_args(g.Guarantee))
    assert set(g.STATUSES) == allowed
    for row in rows.values():
        assert set(row.status) == set(g.MODE_ORDER)
        assert set(row.status.values()) <= allowed, row
    for row in g.format_rows():
        assert set(row.status.values()) <= allowed, row


def test_the_examples_instances_are_what_they_say(rows):
    for row in rows.values():
        example = row.example
        validator = jsonschema.Draft202012Validator(example.schema, format_checker=FORMATS)  # formats asserted
        if example.has_valid and "refused" not in row.status.values():
            assert validator.is_valid(example.valid), row.keyword
        if example.has_invalid and row.status["specification"] != "ignored":
            assert not validator.is_valid(example.invalid), row.keyword


@pytest.mark.parametrize("mode", g.MODE_ORDER)
def test_an_enforced_keyword_is_enforced_by_the_mask(rows, tokenizer, mode):
    enforced = [r for r in rows.values() if r.status[mode] in ("grammar", "value check") and r.example.has_invalid]
    assert len(enforced) >= 35
    for row in enforced:
        compiled = _compile(row.example.schema, mode, tokenizer)
        assert accepts(compiled, tokenizer, json.dumps(row.example.valid)), row.keyword
        assert not accepts(compiled, tokenizer, json.dumps(row.example.invalid)), row.keyword


@pytest.mark.parametrize(
    ("keyword", "status", "schema", "good", "bad"),
    [
        ("uniqueItems", "value check", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
         [3, 1, 2], [3, 1, 3]),
        ("not", "value check", {"type": "string", "not": {"enum": ["no"]}}, "yes", "no"),
        ("multipleOf", "grammar", {"type": "integer", "multipleOf": 3}, 9, 10),
        ("maxProperties", "grammar", {"type": "object", "maxProperties": 2}, {"a": 1, "b": 2},
         {"a": 1, "b": 2, "c": 3}),
        ("if", "value check", {"if": {"type": "string"}, "then": {"minLength": 2}}, "ab", "a"),
        ("const", "grammar", {"const": {"a": [1, 2]}}, {"a": [1, 2]}, {"a": [1, 3]}),
        ("pattern", "grammar", {"type": "string", "pattern": "\\d{3}"}, "x123y", "x12y"),
    ],
)  # fmt: skip
def test_more_instances_of_the_statuses(tokenizer, keyword, status, schema, good, bad):
    """Cases beyond the table's examples: the coverage says ``status``, and the mask holds to it."""
    for mode in g.MODE_ORDER:
        compiled = _compile(schema, mode, tokenizer)
        entries = [e for e in compiled.coverage if e.keyword == keyword and e.pointer == ""]
        assert entries and (entries[-1].status == "enforced"), (keyword, mode, entries)
        assert (AT_BOUNDARIES in entries[-1].note) == (status == "value check"), (keyword, mode)
        assert accepts(compiled, tokenizer, json.dumps(good)), (keyword, mode)
        assert not accepts(compiled, tokenizer, json.dumps(bad)), (keyword, mode)


def test_an_ignored_keyword_changes_nothing(rows, tokenizer):
    """An ignored keyword beside ``type`` leaves exactly ``type``'s language: its example's valid value passes,
    and a value of another type does not."""
    ignored = [r for r in rows.values() if r.status["generation"] == "ignored" and r.example.has_valid]
    assert {"title", "description", "$comment"} <= {r.keyword for r in ignored}
    for row in ignored:
        compiled = _compile(row.example.schema, "generation", tokenizer)
        assert accepts(compiled, tokenizer, json.dumps(row.example.valid)), row.keyword
        other = 1 if isinstance(row.example.valid, str) else "x"
        assert not accepts(compiled, tokenizer, json.dumps(other)), row.keyword


def test_a_refused_keyword_raises_in_strict_mode_and_compiles_when_lenient(rows, tokenizer):
    refused = [r for r in rows.values() if "refused" in r.status.values()]
    assert {"$dynamicRef", "$recursiveRef"} <= {r.keyword for r in refused}
    for row in refused:
        with pytest.raises(constrain.UnsupportedSchemaError):
            _compile(row.example.schema, "specification", tokenizer)
        lenient = constrain.compile(constrain.json_schema(row.example.schema, lenient=True), tokenizer)
        assert any(e.status == "approximated" for e in lenient.coverage)


def test_a_format_checked_per_value_is_enforced_by_the_mask(tokenizer):
    statuses = {row.name: row.status["specification"] for row in g.format_rows()}
    assert statuses["date"] == "grammar" and statuses["regex"] == "value check"
    for name, good, bad in [("date", "2024-02-29", "2023-02-31"), ("regex", "a+", "a(")]:
        compiled = _compile({"type": "string", "format": name}, "specification", tokenizer)
        assert accepts(compiled, tokenizer, json.dumps(good)) and not accepts(compiled, tokenizer, json.dumps(bad))


def test_dependencies_has_no_effect_under_draft_2020_12(rows):
    """Not a 2020-12 keyword: the coverage says it is checked, but the validator (and so the mask) ignores it."""
    assert rows["dependencies"].status == {"specification": "ignored", "generation": "ignored"}


def test_a_reference_below_a_nested_id_resolves_against_that_id(tokenizer):
    schema = {
        "$defs": {
            "n": {"type": "string"},
            "inner": {"$id": "https://example.com/inner", "$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"},
        },
        "$ref": "#/$defs/inner",
    }
    for mode in ("specification", "generation"):
        compiled = _compile(schema, mode, tokenizer)
        assert accepts(compiled, tokenizer, "1")
        assert not accepts(compiled, tokenizer, '"abc"')
    inner = {"$id": "https://example.com/i", "$defs": {"n": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}
    anchored = {"$defs": {"s": {"$anchor": "num", "type": "string"}, "inner": inner}, "$ref": "#/$defs/inner"}
    compiled = _compile(anchored, "specification", tokenizer)
    assert accepts(compiled, tokenizer, "1") and not accepts(compiled, tokenizer, '"abc"')
