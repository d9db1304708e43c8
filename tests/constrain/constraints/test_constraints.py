"""Constraint constructors: values, hashing, and errors that name the culprit."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

import constrain
from constrain import GrammarError, RegexError, SchemaError
from constrain.testing import token_ids, walk


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
    [("a(b", 3), ("[a-", 3), ("a{2,1}", 2), ("(?<=a)b", 0), ("a.(?!b)", 2), (r"(a)\1", 4), (r"\p{L}+", 1),
     ("*a", 0)],
)  # fmt: skip
def test_bad_regex_names_the_position(pattern, position):
    with pytest.raises(RegexError) as info:
        constrain.regex(pattern)
    assert info.value.position == position
    assert repr(pattern) in str(info.value)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_regex_means_what_python_means(smol_tokenizer, engine):
    """The mask takes a text exactly where Python's ``re.fullmatch`` does: xgrammar read ``\\A`` and ``\\Z``
    as the letters and its ``.`` took a newline; named groups and ``{,n}`` were refused. (``\\w``, ``\\d`` and
    ``\\s`` are ASCII under xgrammar: the regex guide says so, and they are left out here.)"""
    import re

    from constrain.testing import accepts

    cases = {
        r"\Aab\Z": ["ab", "Aab", "abZ"], "a.c": ["abc", "a\nc", "a.c"], "(?P<x>a)b": ["ab", "b"],
        "a{,2}b": ["b", "aab", "aaab"], "[]a.]+": ["]a.", "b"], "^(a|b)$": ["a", "ab"], "(^a|b)c": ["ac", "bc", "c"],
        "[.]x": [".x", "ax"], r"\.": [".", "a"],
    }  # fmt: skip
    for pattern, texts in cases.items():
        compiled = constrain.compile(constrain.regex(pattern), smol_tokenizer, engine=engine)
        for text in texts:
            assert accepts(compiled, smol_tokenizer, text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", ["a^b", "a$b", r"a\Ab", r"a\Zb", "x(a|^b)", "(a)*^"])
def test_an_anchor_where_python_matches_nothing_is_refused(pattern):
    """xgrammar dropped a ``^`` or ``$`` inside the pattern (``a^b`` took ``ab``, which Python never matches)."""
    with pytest.raises(RegexError, match="anchor"):
        constrain.regex(pattern)


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
    "options,message",
    [([], "at least one"), (["a", 1], "not str"), (["a", "a"], "twice"), ("ab", "sequence"), (None, "NoneType")],
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


DRAFT4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_draft4_boolean_exclusive_bounds_are_read_as_draft4_reads_them(smol_tokenizer, engine):
    """A draft 4 schema is checked against draft 4's metaschema, where ``exclusiveMinimum: true`` makes
    ``minimum`` exclusive (2020-12's refused it: "not of type 'number'"), and the mask enforces that reading."""
    schema = {
        "$schema": DRAFT4,
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3, "exclusiveMaximum": True},
            "x": {"type": "number", "minimum": 1.5, "exclusiveMinimum": False},
        },
        "required": ["n", "x"],
        "additionalProperties": False,
    }
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer, engine=engine)
    for n, x, valid in [(1, 1.5, True), (2, 9, True), (0, 2, False), (3, 2, False), (1, 1.25, False)]:
        text = json.dumps({"n": n, "x": x})
        ok, matcher = walk(compiled, token_ids(smol_tokenizer, text))
        assert (ok and matcher.is_completed()) is valid, text
    with pytest.raises(SchemaError, match="not of type 'number'"):
        constrain.json_schema({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"})


@pytest.mark.parametrize(
    "schema,pointer",
    [
        ({"$schema": DRAFT4, "minimum": 0, "exclusiveMinimum": 3}, "/exclusiveMinimum"),  # a boolean in draft 4
        ({"$schema": "http://json-schema.org/draft-07/schema#", "exclusiveMinimum": True}, "/exclusiveMinimum"),
    ],
)
def test_each_draft_is_checked_against_its_own_metaschema(schema, pointer):
    with pytest.raises(SchemaError) as caught:
        constrain.json_schema(schema)
    assert caught.value.pointer == pointer


def test_rules_2020_12_dropped_are_not_held_against_an_older_draft():
    """Draft 4's metaschema wants ``enum`` and ``required`` lists unique (2020-12's does not): a repeated
    value changes no instance's validity, so the schema is taken, as it was checked against 2020-12's."""
    enum = {"type": "string", "enum": ["AD", "AE", "AE"]}
    for schema in (enum, {"type": "array", "items": enum}, {"type": "object", "required": ["a", "a"]}):
        constrain.json_schema({"$schema": DRAFT4, **schema})
    with pytest.raises(SchemaError, match="not of type 'array'"):
        constrain.json_schema({"$schema": DRAFT4, "type": "array", "items": {"enum": "AD"}})


@pytest.mark.parametrize("ebnf,rule", [('root ::= "a" root', "root"), ('root ::= "a" | "b" y\ny ::= "c" y', "y")])
def test_a_grammar_that_can_never_end_is_refused_by_rule(ebnf, rule):
    """Such a rule matches no finite text: xgrammar's jump-forward inside it grew until memory ran out
    (``std::bad_alloc`` under a 4 GB limit), and decoding could never complete."""
    with pytest.raises(GrammarError, match=f"rule '{rule}' matches no finite text"):
        constrain.grammar(ebnf)


@pytest.mark.parametrize("draft", [DRAFT4, "http://json-schema.org/draft-07/schema#"])
@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_tuple_items_of_older_drafts_are_enforced(smol_tokenizer, engine, draft):
    """Before 2020-12 a tuple is an ``items`` list, with ``additionalItems`` for the rest: it was accepted
    by ``json_schema`` and then refused at compile ("a schema is an object or a boolean, got list")."""
    schema = {"$schema": draft, "type": "array", "items": [{"type": "integer"}, {"type": "string"}]}
    for rest, texts in [
        (False, {'[1, "a"]': True, "[1]": True, '[1, "a", 3]': False, '["a", 1]': False}),
        ({"type": "boolean"}, {'[1, "a", true]': True, '[1, "a", 3]': False}),
    ]:
        spec = constrain.json_schema({**schema, "additionalItems": rest}, mode="specification")
        compiled = constrain.compile(spec, smol_tokenizer, engine=engine)
        for text, valid in texts.items():
            ok, matcher = walk(compiled, token_ids(smol_tokenizer, text))
            assert (ok and matcher.is_completed()) is valid, (rest, text)


def test_a_decimal_written_as_a_string_is_a_number(smol_tokenizer):
    """pydantic's schema for ``Decimal`` took any string, which pydantic then refuses: greedy decoding wrote
    ``"Prices of milk"`` for a price. Its string form is now a number, within ``max_digits`` and
    ``decimal_places``."""
    import decimal
    from typing import Annotated

    import pydantic

    from constrain.testing import accepts

    class Item(pydantic.BaseModel):
        price: decimal.Decimal
        cents: Annotated[decimal.Decimal, pydantic.Field(max_digits=5, decimal_places=2)] = decimal.Decimal(0)

    compiled = constrain.compile(constrain.json_schema(Item), smol_tokenizer)
    cases = [('{"price": 1.5}', True), ('{"price": "1.50"}', True), ('{"price": "cheap"}', False),
             ('{"price": "1", "cents": "123.45"}', True), ('{"price": "1", "cents": "1.234"}', False)]  # fmt: skip
    for text, valid in cases:
        assert accepts(compiled, smol_tokenizer, text) == valid, text
        if valid:
            Item.model_validate_json(text)


def test_a_bounded_decimal_is_a_number_within_its_bounds(smol_tokenizer):
    """pydantic's string branch of a bounded ``Decimal`` took any number's spelling, ``"-5"`` for ``ge=0`` (which
    pydantic then refuses): a bounded decimal is now a JSON number, held to its bounds, and with ``max_digits``
    and ``decimal_places`` to the magnitude they allow."""
    import decimal
    from typing import Annotated

    import pydantic

    from constrain.testing import accepts

    class Order(pydantic.BaseModel):
        price: Annotated[decimal.Decimal, pydantic.Field(ge=0)]
        share: Annotated[decimal.Decimal, pydantic.Field(max_digits=4, decimal_places=1, lt=500)] = decimal.Decimal(1)

    compiled = constrain.compile(constrain.json_schema(Order), smol_tokenizer)
    cases = [('{"price": 2.5}', True), ('{"price": "2.5"}', False), ('{"price": "-5"}', False),
             ('{"price": -5}', False), ('{"price": 0, "share": 499.5}', True), ('{"price": 0, "share": 500}', False),
             ('{"price": 0, "share": -999.5}', True), ('{"price": 0, "share": -1000}', False)]  # fmt: skip
    for text, valid in cases:
        assert accepts(compiled, smol_tokenizer, text) == valid, text
        if valid:
            Order.model_validate_json(text)
    with pytest.raises(pydantic.ValidationError):
        Order.model_validate_json('{"price": 0, "share": -1000}')  # 5 digits: what the magnitude bound keeps out
