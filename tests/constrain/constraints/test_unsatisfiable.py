"""Schemas that admit no value are refused at preparation, naming the keyword; near misses are not."""

from __future__ import annotations

import random
from typing import Any

import jsonschema
import pytest

import constrain
from constrain.constraints import prepare
from constrain.errors import UnsatisfiableSchemaError
from constrain.testing import accepts

KEYS = ["a", "b", "c", "d", "e"]
FIVE_KEYS = {"type": "object", "properties": {k: {"type": "string"} for k in KEYS}, "required": KEYS}
"""The object of issue 28: five required keys."""

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"

# (schema, the pointer the refusal names, a piece of its message)
schema__pointer__message__test_refused = [
    (
        {**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        "/oneOf",
        "required keys a, b, c, d, e matches branches 0 and 1",
    ),
    ({"type": "string", "oneOf": [{}, True, {"type": "integer"}]}, "/oneOf", "branches 0 and 1"),
    (
        {"type": "integer", "oneOf": [{"type": "integer"}, {"type": "number", "title": "n"}]},
        "/oneOf",
        "branches 0 and 1",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "required": ["a"],
            "oneOf": [{"properties": {"a": {"type": "string"}}}, {"required": ["a"]}],
        },
        "/oneOf",
        "branches 0 and 1",
    ),
    (
        {
            "type": "object",
            "properties": {"x": {**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}},
            "required": ["x"],
        },
        "/properties/x/oneOf",
        "'x' is required at '/'",
    ),
    ({"oneOf": [False, False]}, "/oneOf", "no branch admits a value"),
    ({"anyOf": [False, {"type": "string", "minLength": 2, "maxLength": 1}]}, "/anyOf", "no branch admits a value"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "/allOf", "never meet"),
    ({"allOf": [{}, False]}, "/allOf/1", "`false`"),
    ({"type": "object", "not": {}}, "/not", "takes every value"),
    ({"not": True}, "/not", "takes every value"),
    ({"type": "object", "required": ["a", "b"], "not": {"required": ["a"]}}, "/not", "matches the schema under `not`"),
    ({"required": ["a"], "not": {"required": ["a"]}}, "/not", "matches the schema under `not`"),
    ({"type": "object", "not": {"type": ["object", "null"]}}, "/not", "under `not`"),
    ({"type": "number", "minimum": 5, "maximum": 1}, "/minimum", "no number lies between minimum 5 and maximum 1"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "/exclusiveMinimum", "no number"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "/minimum", "no number"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "/minimum", "no integer"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "/exclusiveMinimum", "no integer"),
    ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "/minimum", "no multiple of 5"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "/minLength", "minLength 3 is above maxLength 2"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "/minItems", "minItems 3 is above maxItems 2"),
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "/minProperties", "above maxProperties 2"),
    ({"type": "object", "required": ["a", "b", "c"], "maxProperties": 2}, "/required", "3 keys are required"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "/properties/a", "'a' is required"),
    (
        {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 1}}, "required": ["a"]},
        "/properties/a/minLength",
        "'a' is required",
    ),
    (
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False, "required": ["b"]},
        "/required",
        "additionalProperties forbids",
    ),
    (
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 2},
        "/minProperties",
        "the 1 keys it allows",
    ),
    ({"type": "object", "propertyNames": False, "required": ["a"]}, "/propertyNames", "propertyNames is `false`"),
    ({"type": "string", "const": 1}, "/const", "1 is not of type"),
    ({"type": "integer", "enum": ["a", 1.5]}, "/enum", "any of its 2 values"),
    ({"type": "string", "enum": ["ab", "abc"], "maxLength": 1}, "/enum", "longer than maxLength 1"),
    ({"type": "object", "enum": [{"a": 1}], "required": ["b"]}, "/enum", "lacks the required key 'b'"),
    ({"const": "a", "enum": ["b"]}, "/const", "not one of the values of enum"),
    ({"const": True, "enum": [1]}, "/const", "not one of the values of enum"),  # true is not 1 in JSON
    ({"enum": []}, "/enum", "enum is empty"),
    ({"type": "array", "items": False, "minItems": 1}, "/items", "items forbids every one"),
    ({"type": "array", "prefixItems": [{}, False], "minItems": 2}, "/prefixItems/1", "needs item 1"),
    ({"type": "array", "contains": False}, "/contains", "contains is `false`"),
    ({"type": "array", "contains": {}, "minContains": 3, "maxContains": 2}, "/minContains", "above maxContains 2"),
    ({"type": "array", "contains": {}, "minContains": 3, "maxItems": 2}, "/contains", "above maxItems 2"),
    (
        {"type": ["string", "array"], "minLength": 3, "maxLength": 1, "minItems": 3, "maxItems": 1},
        "/type",
        "no type it allows has a value",
    ),
    ({"$schema": DRAFT4, "type": "number", "minimum": 5, "maximum": 1}, "/minimum", "no number"),
    (False, "", "the schema is `false`"),
]


@pytest.mark.parametrize("schema, pointer, message", schema__pointer__message__test_refused)
def test_refused(schema, pointer, message):
    for lenient in (False, True):  # no value in either mode: nothing to approximate
        with pytest.raises(UnsatisfiableSchemaError) as info:
            prepare(schema, lenient=lenient)
        assert info.value.pointer == pointer
        assert message in str(info.value), str(info.value)
        assert str(info.value).startswith(f"the schema admits no value: at '{pointer or '/'}': ")
    with pytest.raises(UnsatisfiableSchemaError):
        prepare(schema, lenient=False, closed=True)  # closing only takes values away


# (satisfiable schemas close to a refused one, a value that satisfies each)
schema__witness__test_near_miss_not_refused = [
    ({**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"required": ["x"]}]}, dict.fromkeys(KEYS, "s")),
    ({**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"properties": {"a": {"const": "z"}}}]}, dict.fromkeys(KEYS, "s")),
    ({"type": "object", "required": ["a"], "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, {"a": 1}),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "s"),
    ({"type": "integer", "oneOf": [{"type": "integer"}, {"minimum": 2}]}, 1),
    ({"type": "number", "oneOf": [{"type": "integer"}, {"type": "number"}]}, 1.5),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "oneOf": [{"properties": {"a": {"minLength": 1}}}, {"required": ["a"]}],
        },
        {},
    ),
    ({"type": "object", "required": ["a"], "not": {"required": ["b"]}}, {"a": 1}),
    ({"type": "object", "not": {"type": "object", "required": ["a"]}}, {}),
    ({"type": "number", "not": {"type": "integer"}}, 1.5),
    ({"not": {"required": ["a"]}}, {"b": 1}),
    ({"minimum": 5, "maximum": 1}, "no type: strings are free of number bounds"),
    ({"minLength": 3, "maxLength": 2, "type": ["string", "null"]}, None),
    ({"type": "number", "minimum": 1.2, "maximum": 1.8}, 1.5),
    ({"type": "number", "minimum": 1, "maximum": 1}, 1),
    ({"type": "integer", "minimum": 1, "maximum": 1}, 1),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 3}, 2),
    ({"type": "integer", "minimum": 1, "maximum": 5, "multipleOf": 5}, 5),
    ({"type": "integer", "minimum": -4, "maximum": -1, "multipleOf": 3}, -3),
    ({"type": "number", "minimum": 1, "maximum": 2, "multipleOf": 0.5}, 1.5),
    ({"type": "object", "properties": {"a": False}}, {}),
    ({"properties": {"a": False}, "required": ["a"]}, 1),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 5, "maximum": 1}}}, {}),
    ({"type": "object", "required": ["b"], "additionalProperties": False, "patternProperties": {"^b$": {}}}, {"b": 1}),
    ({"type": "object", "required": ["a", "b"], "maxProperties": 2}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 1}, {"a": 1}),
    ({"type": "array", "items": False}, []),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 1}, [1]),
    ({"type": "array", "contains": False, "minContains": 0}, []),
    ({"type": "array", "contains": {}, "minContains": 2, "maxContains": 2, "maxItems": 2}, [1, 2]),
    ({"type": "integer", "const": 1.0}, 1.0),
    ({"enum": [1], "const": 1.0}, 1),
    ({"type": "string", "enum": [1, "a"]}, "a"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}, {}),
    (
        {
            "type": "object",
            "allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "integer"}}}],
        },
        {},
    ),
    ({"anyOf": [False, {"type": "string"}]}, "s"),
    # keywords the schema's draft does not read, or reads otherwise
    ({"$schema": DRAFT4, "type": "string", "const": 5}, "draft 4 has no const"),
    ({"$schema": DRAFT7, "type": "array", "prefixItems": [False], "minItems": 1}, [1]),
    ({"$schema": DRAFT7, "type": "array", "contains": {}, "minContains": 3, "maxItems": 2}, [1]),
    (
        {
            "$schema": DRAFT7,
            "definitions": {"s": {"type": "string"}},
            "$ref": "#/definitions/s",
            "minLength": 3,
            "maxLength": 1,
        },
        "ab",
    ),
]


@pytest.mark.parametrize("schema, witness", schema__witness__test_near_miss_not_refused)
def test_near_miss_not_refused(schema, witness):
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    assert validator(schema).is_valid(witness), "the witness must show the schema satisfiable"
    for lenient in (False, True):
        prepare(schema, lenient=lenient)


def test_issue_28_is_refused_before_any_search(smol_tokenizer):
    """The schema of issue 28 used to be refused with 'no valid output fits in max_tokens=384' after a
    search of seconds: now compiling it says what is wrong, and a server answers 400 (a SchemaError)."""
    schema = {**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    for mode in ("generation", "specification"):
        with pytest.raises(constrain.SchemaError) as info:
            constrain.compile(constrain.json_schema(schema, mode=mode), smol_tokenizer)
        assert isinstance(info.value, UnsatisfiableSchemaError) and info.value.pointer == "/oneOf"


def test_issue_28_through_generate(tiny):
    schema = {**FIVE_KEYS, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    with pytest.raises(UnsatisfiableSchemaError, match="matches branches 0 and 1"):
        constrain.generate(tiny, "Fill in the form.", schema=schema, max_tokens=384)


def test_a_subschema_without_a_value_is_left_out(smol_tokenizer):
    """An optional key whose schema admits no value must be absent; validate() flags it if present."""
    schema = {"type": "object", "properties": {"a": {"type": "number", "minimum": 5, "maximum": 1}, "b": {}}}
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, "{}") and accepts(compiled, smol_tokenizer, '{"b": 1}')
    text = '{"a": 3}'
    assert not accepts(compiled, smol_tokenizer, text) or compiled.validate(text)
    generation = constrain.compile(constrain.json_schema(schema), smol_tokenizer)  # closed: `a` is not declared
    assert accepts(generation, smol_tokenizer, '{"b": 1}') and not accepts(generation, smol_tokenizer, '{"a": 3}')


POOL = [
    None, True, False, 0, 1, 2, -1, 1.5, 3, 5, "", "a", "ab", "abc", "abcd", [], [1], [1, 2], [1, "a", 3], ["a"],
    {}, {"a": 1}, {"b": "x"}, {"a": 1, "b": 2}, {"a": "s", "b": "t", "c": "u"}, {"c": []}, {"a": None}, {"d": 1},
]  # fmt: skip
"""Candidate values: a schema one of them satisfies must not be refused."""

DRAFTS = [None, None, DRAFT4, DRAFT7, "https://json-schema.org/draft/2019-09/schema"]


def random_schema(rng: random.Random, depth: int = 0) -> Any:
    """A small schema of the keywords the proofs read (and some they must not misread)."""
    if depth > 2 or rng.random() < 0.15:
        return rng.choice([True, False, {}, {"type": "string"}, {"type": "integer"}, {"minimum": 2}])
    schema: dict[str, Any] = {}
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(
            ["type", "type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
             "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "required", "properties",
             "additionalProperties", "items", "prefixItems", "contains", "minContains", "maxContains", "enum", "const",
             "oneOf", "anyOf", "allOf", "not", "propertyNames"]
        )  # fmt: skip
        if key == "type":
            schema[key] = rng.choice(["string", "integer", "number", "object", "array", "null", ["string", "null"]])
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            schema[key] = rng.choice([0, 1, 1.5, 2, 3, 5, -1])
        elif key == "multipleOf":
            schema[key] = rng.choice([1, 2, 3, 0.5, 5])
        elif key.startswith(("min", "max")):
            schema[key] = rng.randint(0, 3)
        elif key == "required":
            schema[key] = rng.sample(["a", "b", "c"], rng.randint(0, 3))
        elif key == "properties":
            schema[key] = {n: random_schema(rng, depth + 1) for n in rng.sample(["a", "b", "c"], rng.randint(1, 2))}
        elif key in ("additionalProperties", "items", "contains", "not", "propertyNames"):
            schema[key] = random_schema(rng, depth + 1)
        elif key in ("prefixItems", "oneOf", "anyOf", "allOf"):
            schema[key] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]
        elif key == "enum":
            schema[key] = rng.sample(POOL, rng.randint(0, 3))
        else:
            schema[key] = rng.choice(POOL)
    return schema


def test_no_random_schema_a_value_satisfies_is_refused():
    rng = random.Random(28)
    refused = 0
    for _ in range(1500):
        schema = random_schema(rng)
        draft = rng.choice(DRAFTS)
        if not isinstance(schema, dict):
            continue
        if draft is not None:
            schema["$schema"] = draft
        try:
            prepare(schema, lenient=True)
            continue
        except UnsatisfiableSchemaError:
            refused += 1
        except constrain.ConstraintError:
            continue
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
        witnesses = [v for v in [*POOL, *schema.get("enum", [])] if validator.is_valid(v)]
        assert not witnesses, (schema, witnesses[0])
    assert refused > 50  # the proofs do find empty schemas among these
