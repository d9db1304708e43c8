"""The key guard: its memo of the states after a token (the same verdicts, asked once or twice; bounded),
and where an object's keys are known, keys that can no longer become one it lacks refused as they are
written (keys in any order then never dead-end)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

import constrain
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids, is_allowed
from constrain.match.checks import ValueChecks
from constrain.match.keys import AFTER_KEPT, KeyState
from constrain.match.validate import schema_validator
from constrain.testing import token_ids


def test_the_state_after_a_token_is_kept_and_stays_right(smol_tokenizer):
    info = constrain.tokenizer_info(smol_tokenizer)
    (quote,) = token_ids(smol_tokenizer, '"')
    again = KeyState.initial(info).advance_bytes(b'{"a": 1, "a')
    other = KeyState.initial(info).advance_bytes(b'{"a": 1, "b')
    assert again is not None and other is not None
    for _ in range(2):  # asked twice (a drawn token's check, then its acceptance): the same answers
        assert again.advance(quote) is None  # completes the key the object has
        assert other.advance(quote) == other.advance_bytes(b'"') is not None
    assert again._after == {quote: None}
    for token in range(1000, 1000 + 3 * AFTER_KEPT):
        other.advance(token)
    assert 0 < len(other._after) <= AFTER_KEPT


CLOSED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 3},
        "nick": {"type": "string", "maxLength": 2},
        "n": {"type": "boolean"},
    },
    "additionalProperties": False,
}  # keys in any order (specification mode), each at most once: the grammar cannot say the second part
NESTED = {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"ab": {"type": "boolean"},
          "abc": {"type": "boolean"}}, "additionalProperties": False}}  # fmt: skip


def _row(compiled, matcher, *, checks: bool = True):
    row = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)] int32
    matcher.fill_next_token_bitmask(row, checks=checks)
    return row


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(
    "schema", [CLOSED, {**CLOSED, "required": ["name"]}, NESTED], ids=["optional", "required", "nested"]
)
def test_random_walks_through_closed_objects_in_any_order_never_dead_end(smol_tokenizer, engine, schema):
    """Keys in any order, each at most once: a key begun that only a key written already could complete,
    or a ``,`` after the last key the object may take, is refused as it is written. Before, 19 of 48 such
    walks (8 per schema and engine, on schemas like these) emptied the mask."""
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine=engine)
    eos = compiled.tokenizer.eos_token_ids
    for walk_seed in range(6):
        rng, matcher, ids = random.Random(walk_seed), compiled.matcher(), []
        for step in range(150):
            allowed = allowed_ids(_row(compiled, matcher)[0], compiled.vocab_size).tolist()
            assert allowed and not matcher.dead_ends, (walk_seed, smol_tokenizer.decode(ids))
            ending = [token for token in allowed if token in eos]
            token = ending[0] if ending and step > 60 else rng.choice(allowed)
            assert matcher.accept_token(token)
            if token in eos:
                break
            ids.append(token)
        assert matcher.is_completed(), smol_tokenizer.decode(ids)
        jsonschema.validate(json.loads(smol_tokenizer.decode(ids)), schema)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_key_that_only_a_written_one_could_complete_is_refused_on_both_paths(smol_tokenizer, engine):
    compiled = constrain.compile(constrain.json_schema(CLOSED, mode="specification"), smol_tokenizer, engine=engine)
    cases = [
        ('{"name": "ab", "', {"na": False, "nam": False, "ni": True, "nic": True, "n": True}),  # "na": "name" again
        ('{"name": "ab", "nick": "c", "', {"n": True, "ni": False, "na": False}),  # only "n" is left
        ('{"name": "ab", "nick": "c", "n": true', {",": False, "}": True, " }": True}),  # no key is left
        ('{"n": false, "nick": "c", "name": "ab"', {",": False, "}": True}),
    ]
    for prefix, verdicts in cases:
        matcher = compiled.matcher()
        assert matcher.accept_tokens(token_ids(smol_tokenizer, prefix)) == len(token_ids(smol_tokenizer, prefix))
        grammar, eager = _row(compiled, matcher, checks=False), _row(compiled, matcher)
        for text, expected in verdicts.items():
            (token,) = token_ids(smol_tokenizer, text)
            # xgrammar's grammar writes each key of this object once (keys_in_any_order); llguidance's admits
            # them all, and the key guard refuses
            assert is_allowed(grammar[0], token) == (expected or engine == "llguidance"), (prefix, text)
            assert is_allowed(eager[0], token) == expected, (prefix, text)
            assert not is_allowed(grammar[0], token) or matcher.allows(token, grammar[0]) == expected, (prefix, text)


def test_the_keys_an_object_may_hold(smol_tokenizer):
    def names(schema, closed=False, path=()):
        checks = ValueChecks(schema, schema_validator(json.dumps(schema)), (), closed=closed)
        location = checks.root_location
        for key in path:
            location = checks.child(location, key)
        found = checks.key_names(location)
        return None if found is None else sorted(found)

    closed = {"properties": {"a": {}, "é": {}}, "additionalProperties": False}
    assert names(closed) == sorted([b"a", "é".encode(), b"\\u00e9"])  # as JSON may write them
    assert names({"properties": {"a": {}}}) is None  # open
    assert names({"properties": {"a": {}}, "required": ["b"]}, closed=True) == [b"a", b"b"]  # closed mode
    assert names({"required": ["b"]}, closed=True) is None  # no properties: closed mode leaves it open
    assert names({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, closed=True) is None
    assert names({**closed, "patternProperties": {"^x": {}}}) is None
    assert names({"anyOf": [closed, {"type": "string"}]}) == names(closed)  # a string branch holds no key
    assert names({"anyOf": [closed, {"properties": {"b": {}}, "additionalProperties": False}]}) == sorted(
        [b"a", b"b", "é".encode(), b"\\u00e9"]
    )
    assert names({"allOf": [closed, {"properties": {"a": {}, "c": {}}, "additionalProperties": False}]}) == [b"a"]
    assert names({"anyOf": [closed, {}]}) is None
    assert names({"type": "array", "items": closed}, path=(0,)) == names(closed)
