"""Guaranteed termination: the closing search against brute force, the budget in the loop, the repetition guard."""

from __future__ import annotations

import json
from collections import deque

import jsonschema
import pytest

import constrain
from constrain import closing
from constrain.closing import RepetitionGuard, completion
from constrain.generate import generate
from constrain.testing import TERMINATION_WORKLOADS, allowed_ids

ALPHABET = '{}[]",:0123ab-.tn '


def brute_force(matcher: constrain.Matcher, alphabet: str = ALPHABET, limit: int = 14) -> int | None:
    """The fewest characters (from ``alphabet``) that complete ``matcher``'s match: BFS over valid prefixes."""
    queue: deque[str] = deque([""])
    seen = 0
    while queue:
        text = queue.popleft()
        probe = matcher.fork()
        if text and not probe.accept_string(text):
            continue
        seen += 1
        if probe.is_completed():
            return len(text)
        if len(text) < limit:
            queue.extend(text + ch for ch in alphabet)
    return None


def by_character(tokenizer):
    """An ``encode`` that spells text one single-character token at a time (so tokens == characters)."""
    vocab = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    return lambda text: [vocab[ch] for ch in text]


CLOSED = {"additionalProperties": False}
SCHEMAS = {
    "nested required": {"type": "object", "required": ["a"], **CLOSED, "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"], **CLOSED}}},
    "minItems": {"type": "array", "items": {"type": "integer", "minimum": 2}, "minItems": 2},
    "minLength": {"type": "object", "properties": {"a": {"type": "string", "minLength": 3}}, "required": ["a"],
                  **CLOSED},
    "enum": {"type": "object", "properties": {"b": {"enum": ["tab", "ta", 12]}}, "required": ["b"], **CLOSED},
    "recursive $ref": {"anyOf": [{"$ref": "#/$defs/t"}, {"type": "null"}], "$defs": {"t": {"type": "object",
        "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 1}}}}},
    "optional keys": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, **CLOSED},
}  # fmt: skip
PREFIXES = {  # compact JSON, as the constraints below are
    "nested required": ["", '{"a":{', '{"a":{"b":1'],
    "minItems": ["", "[2", "[3,2"],
    "minLength": ["", '{"a":"a', '{"a":"abb'],
    "enum": ["", '{"b":"t', '{"b":1'],
    "recursive $ref": ["", '{"a":[{"a":[', '{"a":[{"a":[{}]},{'],
    "optional keys": ["", '{"b":1', '{"a":"x'],
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_closing_search_matches_brute_force_on_schemas(smol_tokenizer, name):
    compiled = constrain.compile(constrain.json_schema(SCHEMAS[name], whitespace="compact"), smol_tokenizer)
    encode = by_character(smol_tokenizer)
    for prefix in PREFIXES[name]:
        matcher = compiled.matcher()
        assert matcher.accept_string(prefix) or not prefix
        found = completion(matcher, encode, max_nodes=5000, fanout=0)
        assert found is not None
        expected = brute_force(matcher)
        assert len(found) == expected, (prefix, smol_tokenizer.decode(found))
        # the completion really completes, and leaves the matcher untouched
        probe = matcher.fork()
        assert probe.accept_tokens(found) == len(found) and probe.is_completed()
        assert matcher.num_accepted == 0


@pytest.mark.parametrize(
    ("constraint", "prefix"),
    [
        (constrain.regex(r"a(bb)+3?-[0-3]{2}"), "ab"),
        (constrain.grammar("arithmetic"), "(1+(2"),
        (constrain.choice(["tab", "tn", "ab-ab-ab"]), "a"),
    ],
)
def test_closing_search_matches_brute_force_on_grammars(smol_tokenizer, constraint, prefix):
    matcher = constrain.compile(constraint, smol_tokenizer).matcher()
    assert matcher.accept_string(prefix)
    found = completion(matcher, by_character(smol_tokenizer), max_nodes=5000, fanout=0)
    alphabet = ALPHABET + "()+*"
    assert found is not None and len(found) == brute_force(matcher, alphabet)


def test_real_tokenization_is_no_longer_than_characters(smol_tokenizer):
    compiled = constrain.compile(constrain.json_schema(SCHEMAS["nested required"]), smol_tokenizer)
    m = compiled.matcher()
    encode = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)
    found = completion(m, encode)
    assert found is not None and len(found) <= len(smol_tokenizer.decode(found))
    probe = m.fork()
    assert probe.accept_tokens(found) == len(found) and probe.is_completed()


UNBOUNDED = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
              "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"],
              "additionalProperties": False}},
    "$ref": "#/$defs/node",
}  # fmt: skip
DEEP = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
    "c": {"type": "array", "items": {"type": "object", "properties": {"d": {"type": "string", "minLength": 5}},
    "required": ["d"]}, "minItems": 2}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]}  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "max_tokens"),
    [(UNBOUNDED, 24), (UNBOUNDED, 120), (TREE, 24), (TREE, 120), (DEEP, 50), (DEEP, 120)],
    ids=["unbounded-24", "unbounded-120", "tree-24", "tree-120", "deep-50", "deep-120"],
)
def test_random_model_always_ends_valid_within_budget(tiny, schema, max_tokens):
    """A random-weight model wanders; with high temperature it never closes on its own. Every result
    must still parse, validate and fit in ``max_tokens``."""
    for seed in range(6):
        r = generate(tiny, "JSON:", schema=schema, max_tokens=max_tokens, seed=seed, temperature=1.5)
        assert r.valid, (r.text, r.violations)
        assert len(r.token_ids) <= max_tokens
        json.loads(r.text)
        if r.closed_early:
            assert r.finish_reason == "length" and r.forced_tokens > 0


def test_without_the_budget_output_is_cut_off(tiny):
    """The control: the same requests with the closing turned off end truncated."""
    results = [
        generate(tiny, "JSON:", schema=TREE, max_tokens=24, seed=seed, temperature=1.5, close_in_budget=False)
        for seed in range(6)
    ]
    assert not any(r.closed_early for r in results)
    assert sum(not r.valid and r.finish_reason == "length" for r in results) >= 3


def test_a_budget_nothing_fits_in_fails_up_front(tiny):
    schema = {"type": "object", "properties": {k: {"type": "string", "minLength": 20} for k in "abcde"},
              "required": list("abcde")}  # fmt: skip
    with pytest.raises(constrain.BudgetError, match="max_tokens=10"):
        generate(tiny, "JSON:", schema=schema, max_tokens=10)


def test_the_initial_closing_is_searched_once_per_constraint(smol_tokenizer, monkeypatch):
    compiled = constrain.compile(constrain.grammar("sql_select"), smol_tokenizer)
    calls = []
    search = closing.completion
    monkeypatch.setattr(closing, "completion", lambda *a, **k: calls.append(1) or search(*a, **k))

    def encode(text):
        return smol_tokenizer.encode(text, add_special_tokens=False)

    first = closing.Budget(compiled.matcher(), encode, 64, initial=True)
    searched = len(calls)
    second = closing.Budget(compiled.matcher(), encode, 64, initial=True)
    assert searched >= 1 and len(calls) == searched and first.estimate == second.estimate
    closing.Budget(compiled.matcher(), encode, 64)  # not known to be initial: searched again
    assert len(calls) > searched


def test_repetition_guard_detects_repeated_items(smol_tokenizer):
    info = constrain.tokenizer_info(smol_tokenizer)
    guard = RepetitionGuard(info)
    assert guard.repeating('{"tags": ["John Doe", "John Doe", "John Doe"')
    assert guard.repeating('{"tags": ["John Doe","John Doe","John Doe" ')
    assert not guard.repeating('{"tags": ["John Doe", "John Doe"')
    assert not guard.repeating('{"tags": ["John Doe", "Jane Doe", "John Doe"')
    assert not guard.repeating("[0, 0, 0")  # too short to be a loop
    assert guard.repeating("[" + ", ".join(["0"] * 12))
    compiled = constrain.compile(constrain.json_schema({"type": "array", "items": {"type": "string"}}), smol_tokenizer)
    m = compiled.matcher()
    text = '["John Doe", "John Doe", "John Doe"'
    assert m.accept_string(text)
    row = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    m.fill_next_token_bitmask(row)
    close = smol_tokenizer.convert_tokens_to_ids("]")
    assert guard.apply(text, row[0]) and guard.steps == 1
    allowed = allowed_ids(row[0], compiled.vocab_size)
    assert close in allowed and not any("," in smol_tokenizer.decode([t]) for t in allowed)
    # the separator fused with the closing quote (",) is forbidden too; the quote alone is not
    m = compiled.matcher()
    assert m.accept_string(text[:-1])
    m.fill_next_token_bitmask(row)
    fused, quote = smol_tokenizer.convert_tokens_to_ids(['",', '"'])
    assert fused in allowed_ids(row[0], compiled.vocab_size)
    assert guard.apply(text[:-1], row[0])
    allowed = allowed_ids(row[0], compiled.vocab_size)
    assert quote in allowed and fused not in allowed


@pytest.mark.parametrize("workload", TERMINATION_WORKLOADS)
def test_default_model_ends_every_workload_valid(workload):
    """The issue's workloads on the real model, greedy and sampled, small and large budgets: all valid."""
    handle = constrain.load_model()
    prompt, schema = TERMINATION_WORKLOADS[workload]
    messages = [{"role": "user", "content": prompt}]
    for max_tokens, sampling in ((40, {"temperature": 0}), (160, {"temperature": 1.0, "seed": 0})):
        r = generate(handle, messages, schema=schema, max_tokens=max_tokens, **sampling)
        assert r.valid and len(r.token_ids) <= max_tokens, (max_tokens, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_default_model_does_not_loop_on_an_unbounded_array():
    """The issue's case: SmolLM2 greedy repeats "John Doe" in ``tags`` until the limit without the guard."""
    handle = constrain.load_model()
    prompt = [{"role": "user", "content": "Describe a person named John Doe as JSON with a name and tags."}]
    r = generate(handle, prompt, schema=UNBOUNDED, max_tokens=120, temperature=0)
    assert r.valid and r.finish_reason == "stop" and r.guard_steps > 0, r.text
    assert len(r.token_ids) < 120
    plain = generate(handle, prompt, schema=UNBOUNDED, max_tokens=120, temperature=0, repetition_guard=False)
    assert plain.valid and plain.closed_early and len(plain.token_ids) == 120  # the budget alone closes it
    control = generate(handle, prompt, schema=UNBOUNDED, max_tokens=120, temperature=0, repetition_guard=False,
                       close_in_budget=False)  # fmt: skip
    assert not control.valid and control.finish_reason == "length"  # what every peer returns
