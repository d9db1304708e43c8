"""Constraint constructors: values, hashing, and errors that name the culprit."""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

import constrain
from constrain import GrammarError, RegexError, SchemaError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(TypedDict):
    x: int
    y: int


@dataclasses.dataclass
class Pair:
    a: str
    b: float


class Person(BaseModel):
    name: str
    age: int


python_type__schema_fragment = [
    (int, {"type": "integer"}),
    (float, {"type": "number"}),
    (bool, {"type": "boolean"}),
    (str, {"type": "string"}),
    (Literal["a", "b"], {"enum": ["a", "b"]}),
    (Color, {"enum": ["red", "blue"]}),
    (list[int], {"type": "array"}),
    (dict[str, int], {"type": "object"}),
    (Point, {"required": ["x", "y"]}),
    (Pair, {"required": ["a", "b"]}),
    (int | None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
    (Person, {"required": ["name", "age"]}),
]


@pytest.mark.parametrize("python_type,fragment", python_type__schema_fragment)
def test_json_schema_from_python_types(python_type, fragment):
    c = constrain.json_schema(python_type)
    schema = c.schema_value
    assert all(schema.get(key) == value for key, value in fragment.items()), schema
    assert c.python_type is python_type


def test_constraints_are_immutable_hashable_and_equal_by_value():
    a = constrain.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    b = constrain.json_schema('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b)
    assert constrain.json_schema({"type": "object"}, lenient=True) != constrain.json_schema({"type": "object"})
    assert constrain.regex("a+") == constrain.regex("a+")
    assert constrain.choice(["x", "y"]) == constrain.choice(("x", "y"))
    assert constrain.grammar("json") == constrain.grammar("json")
    assert constrain.json_object() == constrain.json_schema({"type": "object"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.lenient = True  # type: ignore[misc]


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"a": {"patternProperties": {"(": {}}}}},
        {"$defs": {"x": {"minLength": -1}}},
        {"type": "objects"},
    ],
)
def test_metaschema_fast_path_refuses_what_python_jsonschema_refuses(schema):
    """jsonschema-rs decides first; a schema it refuses gets python-jsonschema's verdict and message."""
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft202012Validator.check_schema(schema)
    with pytest.raises(SchemaError):
        constrain.json_schema(schema)


@pytest.mark.parametrize(
    "schema,pointer",
    [
        ({"type": "objekt"}, "/type"),
        ({"properties": {"a": {"minLength": -1}}}, "/properties/a/minLength"),
        ({"items": {"type": 3}}, "/items/type"),
        ("{not json", ""),
        ({"minimum": float("nan")}, ""),
        ([1, 2], ""),
    ],
)
def test_malformed_schema_names_the_pointer(schema, pointer):
    with pytest.raises(SchemaError) as info:
        constrain.json_schema(schema)
    assert info.value.pointer == pointer
    assert isinstance(info.value, constrain.ConstraintError)


@pytest.mark.parametrize(
    "pattern,position",
    [("a(b", 3), ("[a-", 3), ("a{2,1}", 2), ("(?<=a)b", 3), (r"(a)\1", 4), (r"\p{L}+", 1), ("*a", 0)],
)
def test_bad_regex_names_the_position(pattern, position):
    with pytest.raises(RegexError) as info:
        constrain.regex(pattern)
    assert info.value.position == position
    assert repr(pattern) in str(info.value)


@pytest.mark.parametrize(
    "ebnf,line,column",
    [('root ::= "a" |', 1, 15), ("root ::= foo", 1, 10), ('root ::= "a"\nx ::= [a-', 2, 10), ('a ::= "b"', 1, 1)],
)
def test_bad_grammar_names_line_and_column(ebnf, line, column):
    with pytest.raises(GrammarError) as info:
        constrain.grammar(ebnf)
    assert (info.value.line, info.value.column) == (line, column)
    assert f"line {line}, column {column}" in str(info.value)


def test_unknown_grammar_name_lists_the_shipped_ones():
    with pytest.raises(GrammarError, match="available: arithmetic, csv, function_call, json, sql_select"):
        constrain.grammar("yaml")


@pytest.mark.parametrize(
    "options,message", [([], "at least one"), (["a", 1], "not str"), (["a", "a"], "twice"), ("ab", "sequence")]
)
def test_bad_choices(options, message):
    with pytest.raises(ValueError, match=message):
        constrain.choice(options)


def test_bad_options():
    with pytest.raises(ValueError, match="whitespace"):
        constrain.json_schema({}, whitespace="loose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="property_order"):
        constrain.json_schema({}, property_order="sorted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="constraint from constrain"):
        constrain.compile("a+", constrain.load_tokenizer())  # type: ignore[arg-type]


def test_unicode_property_patterns_are_schemas_the_value_checks_enforce(smol_tokenizer):
    """ECMA 262's ``\\p{..}`` is a valid pattern (Python's ``re`` cannot read it: the metaschema check
    called the schema invalid); the engines lack it, so the value checks match it, with ``regex``."""
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{Lu}\\p{Ll}+$"}}}
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer)
    for text, valid in (('{"w": "Éa"}', True), ('{"w": "Ab"}', True), ('{"w": "ab"}', False), ('{"w": "A1"}', False)):
        assert compiled.matcher().accept_string(text) is valid, text
        assert (compiled.validate(text) == []) is valid, text
    with pytest.raises(constrain.SchemaError, match="/properties/w/pattern"):
        constrain.json_schema({"properties": {"w": {"pattern": "(\\p{L}"}}})
