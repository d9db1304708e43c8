"""The value checks' native validators (jsonschema-rs) give ``jsonschema``'s verdicts, which the output is
validated with: on random JSON values, on the values where the two packages are known to differ, and
where they would differ the checks keep ``jsonschema``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from constrain.constraints.constraint import NATIVE_VALIDATORS
from constrain.match import checks
from constrain.match.validate import schema_validator

SCHEMAS = {
    "unique and numbers": {
        "type": "array",
        "items": {"type": ["integer", "boolean", "object"]},
        "uniqueItems": True,
        "maxItems": 4,
    },
    "literals": {"anyOf": [{"const": 1}, {"enum": ["a", None, [1], {"k": 1}]}], "not": {"const": True}},
    "object keywords": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 1}, "b": {"type": "string", "maxLength": 2}},
        "required": ["a"],
        "dependentRequired": {"b": ["c"]},
        "propertyNames": {"maxLength": 3},
        "maxProperties": 3,
    },
    "conditional": {
        "if": {"properties": {"kind": {"const": "n"}}},
        "then": {"properties": {"v": {"type": "number", "exclusiveMaximum": 10}}},
        "else": {"properties": {"v": {"type": "string", "format": "date"}}},
    },
    "contains": {"type": "array", "contains": {"type": "integer", "minimum": 0}, "maxContains": 2, "minContains": 1},
    "pattern and formats": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "mail": {"type": "string", "format": "email"},
            "when": {"type": "string", "format": "date-time"},
        },
    },
    "references": {
        "$id": "https://example.com/references.json",
        "$defs": {
            "pos": {"type": "integer", "minimum": 0},
            "pair": {"type": "array", "items": {"$ref": "#/$defs/pos"}},
        },
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/pair"}, "q": {"$ref": "#/$defs/pos", "maximum": 5}},
    },
    "pattern properties": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "patternProperties": {"^c$": {"type": "integer", "maximum": 5}, "^l": {"type": "string"}, "^z": False},
        "additionalProperties": {"type": "array"},
        "propertyNames": {"pattern": "^[a-z]+$"},
    },
    "closed with patterns": {
        "type": "object",
        "patternProperties": {"^(kind|v)$": True, "^c$": {"type": "boolean"}},
        "additionalProperties": False,
    },
    "multiples": {
        "type": "array",
        "items": {"anyOf": [{"type": "number", "multipleOf": 0.01}, {"type": "integer", "multipleOf": 3}]},
        "uniqueItems": True,
    },
    "references under patterns": {
        "definitions": {
            "leaf": {"type": "object", "patternProperties": {"^c": {"$ref": "#/definitions/n"}}},
            "n": {"type": "integer", "maximum": 5},
        },
        "type": "object",
        "patternProperties": {"^l": {"$ref": "#/definitions/leaf"}},
    },
    "recursive patterns": {
        "definitions": {
            "node": {
                "type": "object",
                "patternProperties": {"^c": {"$ref": "#/definitions/node"}},
                "additionalProperties": {"type": "integer", "maximum": 5},
            }
        },
        "$ref": "#/definitions/node",
    },
    "draft 4": {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 2, "exclusiveMinimum": True}},
        "additionalProperties": {"type": "boolean"},
    },
}

EDGES = [
    1, 1.0, True, False, 0, -0.5, 10, 10.0, 2**70, None, "", "a", "AB", "AB\n", "ab", "2024-02-30", "x@y.z",
    [1, 1.0], [True, 1], [False, 0], [{"k": 1}, {"k": 1.0}], [[1], [1.0]], {"a": 1}, {"a": 1.0}, {"a": 0},
    {"a": 2, "b": "xy"}, {"a": 2, "b": "xy", "c": 1}, {"kind": "n", "v": 9.5}, {"kind": "n", "v": "2024-01-01"},
    {"kind": "m", "v": "2024-01-01"}, {"code": "AB\n"}, {"code": "ab"}, {"mail": "nobody"}, {"p": [0, 1]},
    {"p": [-1]}, {"q": 6}, {"q": 5}, {"n": 2}, {"n": 3}, {"n": 3, "extra": True}, {"n": 3, "extra": 1},
    [-1, 0, 1, 2], [-1, -2], [0, 1, 2], {"c\n": 5}, {"c": 6}, {"c\n": 6}, {"lx": 1}, {"z": 0}, {"zz": []},
    {"q": [1]}, {"q": 1}, {"A": 1}, {"c": True}, {"kind": 1, "v\n": 2}, {"vv": 1}, 0.07, [0.07], [0.3, 6],
    [0.5, 7], {"lx": {"c": 6}}, {"lx": {"c": 5}}, {"c": {"c": {"a": 6}}}, {"c": {"c": {"a": 5}, "x": 1}},
]  # fmt: skip

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 12)
    | st.floats(-3, 12, allow_nan=False)
    | st.sampled_from(["", "a", "AB", "AB\n", "2024-01-01", "x@y.z", "kind", "n", "v", "c"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["a", "b", "c", "c\n", "z", "lx", "A", "kind", "v", "p", "q", "n", "code", "long"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=8,
)


def _built(schema: dict) -> list[object]:
    """The validator the checks of ``schema`` build for each of its subschemas, whole."""
    value_checks = checks.ValueChecks(schema, schema_validator(json.dumps(schema)), ())
    return [value_checks._node_validator(index) for index in range(len(value_checks.nodes))]


def _validators(schema: dict) -> list[checks._Native]:
    return [v for v in _built(schema) if isinstance(v, checks._Native)]


@pytest.fixture(scope="module")
def validators() -> dict[str, list[checks._Native]]:
    return {name: _validators(schema) for name, schema in SCHEMAS.items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_native_verdicts_are_jsonschemas_on_the_known_differences(validators, name):
    assert validators[name], "no native validator built: the test would check nothing"
    for validator in validators[name]:
        for value in EDGES:
            assert validator.native.is_valid(value) == validator.python.is_valid(value), (name, value)


@seed(29)
@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=_json)
def test_native_verdicts_are_jsonschemas_on_random_values(validators, value):
    for name, found in validators.items():
        for validator in found:
            assert validator.native.is_valid(value) == validator.python.is_valid(value), (name, value)


def test_where_the_packages_differ_the_checks_keep_jsonschema():
    """What an ``$id`` below the root rebases stays with jsonschema, and so does ``unevaluatedProperties``
    (beside keywords read in Python, whose annotations it would not see)."""
    for schema in (
        {"type": "array", "items": {"$id": "https://example.com/item", "type": "array"}, "uniqueItems": True},
        {"type": "object", "patternProperties": {"^x$": True}, "unevaluatedProperties": False},
    ):
        root = _built(schema)[0]  # the subschema holding the keyword (or reaching it)
        assert root is not None and not isinstance(root, checks._Native), schema


def test_multiple_of_is_read_as_jsonschema_reads_it():
    """jsonschema-rs divides floats exactly (0.07 is a multiple of 0.01 there, not in jsonschema): the
    checks' native validators take ``multipleOf`` from jsonschema."""
    assert NATIVE_VALIDATORS["Draft202012Validator"]({"multipleOf": 0.01}).is_valid(0.07)  # the difference itself
    (validator,) = _validators({"type": "number", "multipleOf": 0.01})
    assert not validator.native.is_valid(0.07) and validator.native.is_valid(0.5)


def test_references_under_patterns_are_read_natively():
    """A ``$ref`` inside ``patternProperties`` whose target has patterns of its own: the keyword's own
    validators resolve it in the document (they once could not, and the whole schema fell back to
    jsonschema, about 100 times slower)."""
    root = _built(SCHEMAS["references under patterns"])[0]
    assert isinstance(root, checks._Native)
    assert not root.is_valid({"lx": {"c": 6}}) and root.is_valid({"lx": {"c": 5}})


def test_recursive_patterns_are_read_natively():
    """A subschema under ``patternProperties`` that reaches itself: the keyword's own validators are built at
    their first value, not with the validator that holds them (built eagerly, each built the next until
    Python's recursion limit, after 70 ms on ``wp_27``, and the schema fell back to jsonschema)."""
    root = _built(SCHEMAS["recursive patterns"])[0]
    assert isinstance(root, checks._Native)
    assert not root.is_valid({"c": {"c": {"a": 6}}}) and root.is_valid({"c": {"c": {"a": 5}, "x": 1}})


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_dependencies_is_read_only_by_the_drafts_that_have_it(smol_tokenizer, engine):
    """2019-09 split ``dependencies`` into ``dependentRequired`` and ``dependentSchemas``; jsonschema-rs still
    applies it under 2020-12, where the mask then refused ``{"a": 1}`` that the schema (and the coverage:
    "ignored") allows. Draft 7 has it, and the mask refuses that text there."""
    import constrain
    from constrain.testing import token_ids, walk

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a"], "dependencies": {"a": ["b"]}}  # fmt: skip
    for draft, allowed in [({}, True), ({"$schema": "http://json-schema.org/draft-07/schema#"}, False)]:
        spec = constrain.json_schema({**draft, **schema}, mode="specification")
        compiled = constrain.compile(spec, smol_tokenizer, engine=engine)
        ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"a": 1}'))
        assert (ok and matcher.is_completed()) is allowed, draft
        assert (compiled.validate('{"a": 1}') == []) is allowed, draft
