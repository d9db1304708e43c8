"""xgrammar's objects with keys in any order, rewritten to follow which keys came
(:func:`constrain.backends.xgrammar.keys_in_any_order`): the mask takes exactly the objects a JSON parser
reads as valid with no key written twice, and the per-token checks go where the grammar says it all."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import constrain
from constrain.backends.xgrammar import KEYS_MAX, inline_optional_whitespace, keys_in_any_order, never_ending_rules
from constrain.compiler.json_schema import json_schema_ebnf
from constrain.match.validate import parse_json
from constrain.testing import accepts

NAMES = "abcdef"


@st.composite
def objects(draw: st.DrawFn) -> tuple[dict, list[str]]:
    """An object schema (integer members, some required, closed or open, maybe one nested object) and the
    texts of objects drawn beside it: keys declared or not, in any order, some repeated."""
    declared = NAMES[: draw(st.integers(1, len(NAMES)))]
    required = draw(st.lists(st.sampled_from(declared), unique=True, max_size=KEYS_MAX))
    closed = draw(st.booleans())
    schema: dict = {"type": "object", "properties": {name: {"type": "integer"} for name in declared}}
    schema |= {"required": required} if required else {}
    schema |= {"additionalProperties": False} if closed else {}
    nested = draw(st.booleans())
    if nested:  # "a" holds the same kind of object
        inner = {"p": {"type": "integer"}, "q": {"type": "integer"}}
        schema["properties"]["a"] = {
            "type": "object",
            "properties": inner,
            "required": ["q"],
            "additionalProperties": False,
        }
    texts = []
    for _ in range(6):
        keys = draw(st.lists(st.sampled_from([*declared, "x"]), max_size=len(declared) + 2))
        inner = draw(st.lists(st.sampled_from("pqq"), max_size=3))
        members = [
            f'"{key}": ' + ("{" + ", ".join(f'"{k}": 1' for k in inner) + "}" if key == "a" and nested else "1")
            for key in keys
        ]
        texts.append("{" + ", ".join(members) + "}")
    return schema, texts


def _valid(schema: dict, text: str) -> bool:
    """Valid as a JSON parser reads it, with no object holding a key twice."""

    try:
        value = parse_json(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@seed(53)
@given(drawn=objects())
@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_the_mask_takes_exactly_the_valid_objects_in_any_order(smol_tokenizer, engine, drawn):
    schema, texts = drawn
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine=engine)
    for text in texts:
        assert accepts(compiled, smol_tokenizer, text) == _valid(schema, text), (schema, text)


def test_the_grammar_alone_follows_the_keys(smol_tokenizer):
    """No value checks and no key guard where every object is followed; both where one is not."""
    small = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
             "required": ["b"], "additionalProperties": False}  # fmt: skip
    large = {"type": "object", "properties": {name: {"type": "integer"} for name in NAMES},
             "required": list(NAMES), "additionalProperties": False}  # fmt: skip
    for schema, checked in ((small, False), (large, True)):
        compiled = constrain.compile(
            constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine="xgrammar"
        )
        assert compiled.matcher().checks_tokens == checked, schema


def test_objects_it_cannot_tell_apart_are_left_as_they_are():
    """Two objects declaring the same keys but requiring different ones: xgrammar's rules cannot be told
    apart by their keys, so neither is changed, and the result says required is not enforced."""
    ebnf = (
        'root ::= (("{" root_item root_properties{0, -1} "}"))\n'
        'root_item ::= (("\\"a\\"" ":" basic_integer) | ("\\"b\\"" ":" basic_integer))\n'
        'root_properties ::= (("," root_item))'
    )
    keys = frozenset("ab")
    assert keys_in_any_order(ebnf, {keys: None}) == (ebnf, False, frozenset())
    rewritten, complete, tracked = keys_in_any_order(ebnf, {keys: frozenset("a")})
    assert complete and tracked == {keys} and "root_keys_3" in rewritten and "root_item" not in rewritten


@pytest.mark.parametrize(
    "ebnf,endless",
    [
        ('root ::= "a" root', ["root"]),
        ('root ::= "a" | "b" y\ny ::= "c" y', ["y"]),
        ('root ::= x\nx ::= "b" x | "c" x', ["root", "x"]),
        ('root ::= z{1,3}\nz ::= "q" z', ["root", "z"]),
        ('root ::= z{0,3}\nz ::= "q" z', ["z"]),  # root ends without z, but may enter it
        ('root ::= ("ab" root)*', []),
        ('root ::= ([a-z] "b"){3,}', []),
        ('root ::= "[" (root ("," root)*)? "]"', []),
        ('root ::= "a" (=("b"))', []),
        ('root ::= "a"\nunused ::= "b" unused', []),  # root never reaches it
        ('root ::= "a" x\nx ::= [^\\x00-\\U0010FFFF] | "b" x', ["root", "x"]),  # x's way out matches nothing
        ('root ::= "a" x\nx ::= [^\\x00-\\x60b-\\U0010FFFF] | "b" x', []),  # ("a" is left)
        ('root ::= [^a] | "b" root', []),
    ],
)
def test_never_ending_rules_reads_xgrammars_parsed_grammar(ebnf, endless):
    """The rules that match no finite text, read from xgrammar's serialized grammar (whose format this
    pins: a new xgrammar that numbers its expressions otherwise fails here)."""
    assert never_ending_rules(ebnf) == endless


def test_shipped_grammars_all_end():
    from constrain import grammars

    for name in grammars.available():
        assert never_ending_rules(grammars.load(name)) == [], name


def test_optional_whitespace_rules_are_written_in_place_for_the_same_language():
    """Each one-whitespace-character rule becomes ``[ \\n\\r\\t]?`` where it is used, and nowhere else (a
    key named like such a rule keeps its literal); the grammar takes exactly the texts it took."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"root_1": {"type": "string"}, "n": {"type": "array", "items": {}}},
              "required": ["root_1"]}  # fmt: skip
    ebnf = json_schema_ebnf(constrain.json_schema(schema, mode="specification"))[0]
    inlined = inline_optional_whitespace(ebnf)
    assert len(inlined.splitlines()) < len(ebnf.splitlines()) - 10
    assert '"\\"root_1\\""' in inlined and "root_1 ::=" in ebnf and "root_1 ::=" not in inlined
    texts = ['{"root_1": "x"}', '{ "root_1":"x" }', '{"root_1"  : "x"}', '{"n": [1, {"a" :[ ]}], "root_1": ""}',
             '{"n":[ 1,2 ], "root_1":"a\\"b" , "z": null}', '{\n"root_1":\t"x"\r}', '{"n": []}',
             '{"root_1": "x",}']  # fmt: skip
    verdicts = [xgr.testing._is_grammar_accept_string(ebnf, text) for text in texts]
    assert verdicts == [xgr.testing._is_grammar_accept_string(inlined, text) for text in texts]
    assert verdicts == [True, True, False, True, True, True, False, False]
    assert inline_optional_whitespace('root ::= "a"\n') == 'root ::= "a"\n'
