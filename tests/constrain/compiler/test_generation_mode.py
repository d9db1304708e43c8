"""Generation decodes under exactly the schema the user wrote (issue 13): objects closed unless the schema
says what else may appear, keys in the schema's order, never a duplicate key, formatting fixed; the same
language on both engines; ``mode="specification"`` keeps JSON Schema's own semantics."""

from __future__ import annotations

import json

import pydantic
import pytest

import constrain
from constrain.generation import generate
from constrain.match.bitmask import is_allowed
from constrain.serving.protocol import ChatCompletionRequest, chat_requests
from constrain.testing import allowed_ids, token_ids, walk

ENGINES = ("xgrammar", "llguidance")

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]},
    },
    "required": ["name", "tags"],
}
"""No ``additionalProperties`` anywhere: the way most clients send a schema."""


def _accepts(compiled: constrain.CompiledConstraint, tokenizer, text: str) -> bool:
    """``text`` passes every mask (the mask alone, as decoding sees it) and the grammar can end there."""
    ok, matcher = walk(compiled, token_ids(tokenizer, text))
    return ok and matcher.is_completed()


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _duplicates(text: str) -> list[str]:
    found: list[str] = []

    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        found.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return found


@pytest.mark.parametrize("engine", ENGINES)
def test_objects_closed_in_generation_open_in_specification(smol_tokenizer, engine):
    """Finding 1: a schema without additionalProperties takes no invented keys while generating."""
    gen = constrain.compile(constrain.json_schema(PROFILE), smol_tokenizer, engine=engine)
    spec = constrain.compile(constrain.json_schema(PROFILE, mode="specification"), smol_tokenizer, engine=engine)
    extra_root = {"name": "Ann", "tags": [], "description": "x"}
    extra_nested = {"name": "Ann", "tags": [], "address": {"street": "Main", "zip": "1"}}
    fine = {"name": "Ann", "city": "Rome", "tags": ["a"], "address": {"street": "Main"}}
    assert _accepts(gen, smol_tokenizer, json.dumps(fine))
    assert not _accepts(gen, smol_tokenizer, json.dumps(extra_root))
    assert not _accepts(gen, smol_tokenizer, json.dumps(extra_nested))
    for value in (extra_root, extra_nested):
        assert _accepts(spec, smol_tokenizer, json.dumps(value)) and _accepts(spec, smol_tokenizer, _compact(value))
    assert gen.fully_enforced


@pytest.mark.parametrize("engine", ENGINES)
def test_schema_that_says_what_else_stays_open(smol_tokenizer, engine):
    """Closing never overrides the schema: declared additional keys keep their value schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer, engine=engine)
    assert _accepts(compiled, smol_tokenizer, '{"a": 1, "b": "x"}')
    assert not _accepts(compiled, smol_tokenizer, '{"a": 1, "b": 2}')
    for whitespace in ("dumps", "compact"):
        bare = constrain.json_schema({"type": "object"}, whitespace=whitespace)
        free = constrain.compile(bare, smol_tokenizer, engine=engine)
        value = {"any": [1, {"x": None, "y": [2, 3]}], "z": {}}  # a bare object is any object
        text = json.dumps(value) if whitespace == "dumps" else _compact(value)
        assert _accepts(free, smol_tokenizer, text), text


def test_required_key_without_a_property_is_kept(smol_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer)
    assert _accepts(compiled, smol_tokenizer, '{"a": 1, "b": [true]}')
    assert not _accepts(compiled, smol_tokenizer, '{"a": 1, "b": [true], "c": 1}')


class Address(pydantic.BaseModel):
    street: str
    postcode: str = pydantic.Field(pattern=r"^[0-9]{5,25}$")  # a long bounded repeat: "auto" picks llguidance


class Customer(pydantic.BaseModel):
    name: str
    address: Address


def test_closed_holds_on_the_llguidance_path(smol_tokenizer):
    """Finding 2: a Pydantic model that "auto" sends to llguidance is closed at the root and nested."""
    constraint = constrain.json_schema(Customer)
    compiled = constrain.compile(constraint, smol_tokenizer)
    forced = constrain.compile(constraint, smol_tokenizer, engine="llguidance")
    assert compiled.engine == "llguidance"
    fine = {"name": "A", "address": {"street": "B", "postcode": "12345"}}
    for c in (compiled, forced):
        assert _accepts(c, smol_tokenizer, json.dumps(fine))
        nested = {**fine, "address": {**fine["address"], "x": 1}}
        assert not _accepts(c, smol_tokenizer, json.dumps(nested))
        assert not _accepts(c, smol_tokenizer, json.dumps({**fine, "x": 1}))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["generation", "specification"])
@pytest.mark.parametrize("checked", [False, True], ids=["grammar only", "values checked"])
def test_duplicate_keys_masked(smol_tokenizer, engine, mode, checked):
    """Finding 3: wherever another key may be any string, the mask refuses a key written before; where
    values are checked too, the value checks' scan is the key guard (one scan a token): the same verdicts."""
    extra = {"type": "integer", "not": {"const": 5}} if checked else {"type": "integer"}  # ``not``: checked
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": extra}
    compiled = constrain.compile(constrain.json_schema(schema, mode=mode), smol_tokenizer, engine=engine)
    assert compiled.unique_keys and (compiled.value_checks is not None) == checked
    for text in ('{"a": 1, "a": 2}', '{"a": 1, "b": 2, "b": 3}', '{"b": 2, "a": 1, "b": 3}'):
        assert not _accepts(compiled, smol_tokenizer, text), text
    for text in ('{"a": 1, "b": 2, "bb": 3}', '{"a": 1, "ab": 2}'):
        assert _accepts(compiled, smol_tokenizer, text), text
    # the mask itself, not only accept_token: inside `"b` after a key "b", the closing quote is out
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"a": 1, "b": 2, "b'))
    assert ok
    bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = allowed_ids(bitmask[0], compiled.vocab_size)
    closing = [t for t in allowed if smol_tokenizer.decode([t]).startswith('"')]
    assert not closing
    assert any(smol_tokenizer.decode([t]) == "b" for t in allowed)  # "bb" is still a new key
    quote = smol_tokenizer.convert_tokens_to_ids('":')
    matcher.fill_next_token_bitmask(bitmask, checks=False)  # the grammar's row, and the drawn token's check
    assert is_allowed(bitmask[0], quote) and not matcher.allows(quote, bitmask[0])
    assert not matcher.accept_token(quote)
    assert matcher.allows(smol_tokenizer.convert_tokens_to_ids("b"), bitmask[0])


def test_duplicate_keys_masked_across_nesting_rollback_and_fork(smol_tokenizer):
    compiled = constrain.compile(constrain.json_schema({"type": "object"}, whitespace="compact"), smol_tokenizer)
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"a":{"a":1},"b":[{"a":1,"b":2}],"c":1}'))
    assert ok and matcher.is_completed()  # the same key in other objects is no duplicate
    assert not walk(compiled, token_ids(smol_tokenizer, '{"a":{"a":1},"a":2}'))[0]
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"a":1'))
    assert ok
    tail = token_ids(smol_tokenizer, ',"c":2')
    assert matcher.accept_tokens(tail) == len(tail)
    twin = matcher.fork()
    matcher.rollback(len(tail))  # "c" is written no more: it may come again, on this matcher only
    again = token_ids(smol_tokenizer, ',"c":3}')
    assert matcher.accept_tokens(again) == len(again) and matcher.is_completed()
    assert twin.accept_tokens(again) < len(again)


def test_closed_generation_admits_no_duplicates_without_a_guard(smol_tokenizer):
    """A closed schema in schema order cannot repeat a key: no scanner runs (no cost per token)."""
    assert not constrain.compile(constrain.json_schema(PROFILE), smol_tokenizer).unique_keys
    assert constrain.compile(constrain.json_schema(PROFILE, mode="specification"), smol_tokenizer).unique_keys


@pytest.mark.parametrize("engine", ENGINES)
def test_formatting_is_forced_text(smol_tokenizer, engine):
    """Finding 4: nothing between two values is sampled: keys, colons and commas come as forced text."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer, engine=engine)
    matcher = compiled.matcher()
    assert matcher.forced_text() == '{"name": "'
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"name": "Ann"'))
    assert ok and matcher.forced_text() == ', "age": '
    for text in ('{"name":"Ann","age":3}', '{"name": "Ann",\n"age": 3}', '{"name": "Ann",  "age": 3}'):
        assert not _accepts(compiled, smol_tokenizer, text), text
    assert _accepts(compiled, smol_tokenizer, '{"name": "Ann", "age": 3}')
    compact = constrain.compile(constrain.json_schema(schema, whitespace="compact"), smol_tokenizer, engine=engine)
    assert compact.matcher().forced_text() == '{"name":"'
    assert _accepts(compact, smol_tokenizer, '{"name":"Ann","age":3}')


def test_generation_defaults_everywhere(tiny):
    """Python API, server (json_schema without strict, json_object) and tools take generation mode."""
    from constrain.generation import resolve_constraint
    from constrain.tools.calling import tool_calling

    assert resolve_constraint(PROFILE, None, None, None, None) == constrain.json_schema(PROFILE)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE}}}
    )  # fmt: skip
    served = chat_requests(body, tiny)[0].schema
    assert (served.closed, served.property_order, served.whitespace) == (True, "schema", "dumps")
    tool = tool_calling([{"type": "function", "function": {"name": "f", "parameters": PROFILE}}]).tools[0]
    assert (tool.constraint.closed, tool.constraint.whitespace) == (True, "dumps")
    spec = constrain.json_schema(PROFILE, mode="specification")
    assert (spec.closed, spec.property_order, spec.whitespace) == (False, "any", "single")
    assert constrain.json_schema(PROFILE, mode="specification", closed=True).closed
    with pytest.raises(ValueError, match="mode"):
        constrain.json_schema(PROFILE, mode="strict")  # type: ignore[arg-type]


def test_generation_never_writes_a_duplicate_key(tiny):
    """On a tiny random model pushed toward writing key "a" again and again, no output repeats a key."""
    tokenizer = tiny.tokenizer
    bias = {tokenizer.convert_tokens_to_ids(t): 40.0 for t in ("a", '":', "1", ',"')}
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 4}
    constraint = constrain.json_schema(schema, whitespace="compact")  # the biased tokens are compact JSON
    seen_attempts = 0
    for seed in range(4):
        r = generate(tiny, "JSON:", schema=constraint, max_tokens=40, seed=seed, logit_bias=bias)
        assert r.valid and not _duplicates(r.text), r
        seen_attempts += r.text.count('"a')
    assert seen_attempts >= 4  # the bias did push toward "a": the guard had work to do
