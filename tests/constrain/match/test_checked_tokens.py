"""The check of one token (``Matcher.allows``) against the eager mask (``Matcher.check_row``): for random
schemas holding keywords beyond the grammar and random texts through them, the two give the same verdict on
every token the grammar allows; at a step where the eager row is not ``VIABLE``, ``allows`` refuses them all
(and the decode loop takes the eager row)."""

from __future__ import annotations

import dataclasses
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import constrain
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids, count_allowed
from constrain.match.keys import KeyState
from constrain.match.values import VIABLE, ValueState
from constrain.match.vocab import ValueVocab
from constrain.testing import token_ids

NAMES = st.text(alphabet="abcd", min_size=1, max_size=3)
SCALARS = st.one_of(
    st.builds(lambda step: {"type": "number", "multipleOf": step, "minimum": 0, "maximum": 5},
              st.sampled_from([0.5, 0.25, 1.5])),
    st.builds(lambda values: {"enum": values}, st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)),
    st.builds(lambda low: {"type": "integer", "minimum": low, "maximum": low + 20}, st.integers(-5, 5)),
    st.just({"type": "string", "format": "date"}),
    st.just({"type": "string", "not": {"const": "a"}, "maxLength": 3}),
    st.just({"type": "boolean"}),
)  # fmt: skip


def _containers(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    arrays = st.builds(
        lambda items, unique, most: {"type": "array", "items": items, "uniqueItems": unique, "maxItems": most},
        children, st.booleans(), st.integers(1, 4),
    )  # fmt: skip
    objects = st.builds(
        lambda properties, extra, most: {
            "type": "object", "properties": properties, "required": sorted(properties)[:1],
            "additionalProperties": extra, "maxProperties": most,
        },
        st.dictionaries(NAMES, children, min_size=1, max_size=3), st.sampled_from([False, {"type": "integer"}]),
        st.integers(1, 4),
    )  # fmt: skip
    return st.one_of(arrays, objects)


SCHEMAS = st.recursive(SCALARS, _containers, max_leaves=6)
SAMPLED = 48  # per step: allowed tokens of the eager row whose verdict is asked (every refused one is)


def _compare_along_a_walk(tokenizer, schema: dict, walk_seed: int, steps: int = 40) -> int:
    """Walk ``steps`` random tokens through ``schema``'s eager masks; at each step compare the verdicts.
    Returns how many verdicts were compared."""
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), tokenizer)
    matcher, rng, compared = compiled.matcher(), random.Random(walk_seed), 0
    for _ in range(steps):
        if matcher.is_terminated():
            break
        grammar = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
        matcher.fill_next_token_bitmask(grammar, checks=False)
        eager = grammar.clone()
        status = matcher.check_row(eager[0])
        granted = set(allowed_ids(grammar[0], compiled.vocab_size).tolist())
        kept = set(allowed_ids(eager[0], compiled.vocab_size).tolist())
        asked = sorted(granted - kept) + rng.sample(sorted(kept), min(SAMPLED, len(kept)))
        for token in asked:
            expected = status == VIABLE and token in kept
            assert matcher.allows(token, grammar[0]) == expected, (schema, matcher.num_accepted, token)
            compared += 1
        if not kept:
            break
        assert matcher.accept_token(rng.choice(sorted(kept)))
    return compared


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@seed(27)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_one_token_checks_agree_with_the_eager_mask(smol_tokenizer, schema, walk_seed):
    _compare_along_a_walk(smol_tokenizer, schema, walk_seed)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True, "maxItems": 2},
        {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3},  # reaches a dead end
        {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}, "required": ["a"]},
    ],
)
def test_refusals_and_dead_ends_are_compared(smol_tokenizer, schema):
    """Fixed schemas whose walks are known to meet refused tokens (and a dead end): the comparison is not
    vacuous."""
    assert sum(_compare_along_a_walk(smol_tokenizer, schema, walk_seed) for walk_seed in range(4)) > 100


@settings(derandomize=True, database=None, deadline=None, max_examples=25)
@seed(31)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_the_look_aheads_short_answer_is_forbid_violations_verdict(smol_tokenizer, schema, walk_seed):
    """``leaves_viable`` (the depth-2 probe's question, stopping at the first viable token) answers exactly
    whether ``forbid_violations`` returns ``VIABLE`` (which probes every token): compared on every probe
    the walks make, with the same ``viable``, the real one and two made up."""
    asked = []
    short = ValueState.leaves_viable

    def both(state, row, eos, viable):
        # the real look-ahead, and two made up (the equivalence holds for any): none viable, every other one
        for ahead in (viable, lambda token: False, lambda token: token % 2 == 0):
            expected = state.forbid_violations(row.clone(), eos, ahead) == VIABLE
            assert short(state, row, eos, ahead) == expected, (schema, state.scan.mode)
        asked.append(short(state, row, eos, viable))
        return asked[-1]

    with mock.patch.object(ValueState, "leaves_viable", both):
        _compare_along_a_walk(smol_tokenizer, schema, walk_seed, steps=25)


@settings(derandomize=True, database=None, deadline=None, max_examples=25)
@seed(37)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_shared_candidates_and_the_guards_bound_hold_along_walks(smol_tokenizer, schema, walk_seed):
    """A state after a token shares its predecessor's candidates where its stack and scan mode are the
    same: along walks, every state's candidates equal those a fresh state works out; and the key guard's
    bound on what it clears (which lets ``allows`` skip the guard's count) is never below what it clears."""
    states, bounds = [], []
    advance, forbid = ValueState.advance_value, KeyState.forbid_duplicates

    def advance_and_compare(state, *args, **kwargs):
        after, read = advance(state, *args, **kwargs)
        if after is not None and after.vocab is not None:  # (a completion's probe reads bytes only)
            fresh = ValueState(after.checks, after.vocab, after.scan, after.stack)
            got, expected = after._candidates(), fresh._candidates()
            assert got[1] == expected[1] and (got[0] is expected[0]), (schema, after.scan)
            states.append(after._memo is state._memo)
        return after, read

    def forbid_and_bound(state, row):
        bound, before = state.most_forbidden(row), count_allowed(row)
        forbid(state, row)
        assert before - count_allowed(row) <= bound, (schema, state.scan)
        bounds.append(bound)

    with (
        mock.patch.object(ValueState, "advance_value", advance_and_compare),
        mock.patch.object(KeyState, "forbid_duplicates", forbid_and_bound),
    ):
        _compare_along_a_walk(smol_tokenizer, schema, walk_seed, steps=25)


def test_candidates_are_shared_and_compared(smol_tokenizer):
    """On a fixed schema, some states share their predecessor's candidates and some do not, and the key
    guard's bound is asked: the test above is not vacuous."""
    shared = []
    advance = ValueState.advance_value

    def record(state, *args, **kwargs):
        after, read = advance(state, *args, **kwargs)
        if after is not None:
            shared.append(after._memo is state._memo)
        return after, read

    schema = {"type": "object", "properties": {"ab": {"type": "string", "format": "date"}, "c": {"multipleOf": 0.5}}}
    with mock.patch.object(ValueState, "advance_value", record):
        for walk_seed in range(3):
            _compare_along_a_walk(smol_tokenizer, schema, walk_seed, steps=25)
    assert True in shared and False in shared


def test_the_look_aheads_short_answer_is_compared_both_ways(smol_tokenizer, monkeypatch):
    """On fixed schemas whose walks meet dead ends ahead, the short answer is asked, and is False at times."""
    answers = []
    short = ValueState.leaves_viable

    def both(state, row, eos, viable):
        for ahead in (lambda token: False, lambda token: token % 2 == 0):
            answers.append(short(state, row, eos, ahead))
            assert answers[-1] == (state.forbid_violations(row.clone(), eos, ahead) == VIABLE)
        return short(state, row, eos, viable)

    monkeypatch.setattr(ValueState, "leaves_viable", both)
    for schema in (
        {"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True, "maxItems": 2},
        {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3},
    ):
        for walk_seed in range(4):
            _compare_along_a_walk(smol_tokenizer, schema, walk_seed)
    assert True in answers and False in answers


def _closing_agrees(tokenizer, schema: dict, walk_seed: int, engine: str = "auto") -> int:
    """Walk to a complete match (random tokens of the eager masks, then EOS where allowed); from every
    step, ``completes`` of the rest of the walk, and of the rest with one token swapped, equals taking the
    tokens one by one on a search's fork. Returns how many paths completed."""
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), tokenizer, engine=engine)
    matcher, rng, walk, states = compiled.matcher(), random.Random(walk_seed), [], []
    eos = set(compiled.tokenizer.eos_token_ids)
    for _ in range(60):
        bitmask = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
        matcher.fill_next_token_bitmask(bitmask)
        kept = [t for t in allowed_ids(bitmask[0], compiled.vocab_size).tolist() if t not in eos]
        if not kept or (matcher.is_completed() and rng.random() < 0.3):
            break
        states.append(matcher.fork())
        walk.append(rng.choice(kept))
        assert matcher.accept_token(walk[-1])
    completed = 0
    for start, state in enumerate(states):
        rest = walk[start:]
        swapped = list(rest)
        swapped[rng.randrange(len(swapped))] = rng.choice(walk)
        for path in (rest, swapped, rest[:-1]):
            probe = state.fork(search=True)
            one_by_one = probe.accept_tokens(path) == len(path) and probe.is_completed()
            assert state.completes(path) == one_by_one, (schema, start, path)
            completed += one_by_one
    return completed


@settings(derandomize=True, database=None, deadline=None, max_examples=30)
@seed(27)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_a_paths_check_in_one_pass_agrees_with_token_by_token(smol_tokenizer, schema, walk_seed):
    _closing_agrees(smol_tokenizer, schema, walk_seed)


@settings(derandomize=True, database=None, deadline=None, max_examples=20)
@seed(28)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_a_paths_check_agrees_with_token_by_token_on_llguidance(smol_tokenizer, schema, walk_seed):
    """llguidance checks a path in one call that changes nothing (``validate_tokens``, an EOS after it)."""
    _closing_agrees(smol_tokenizer, schema, walk_seed, engine="llguidance")


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_paths_that_complete_are_compared(smol_tokenizer, engine):
    schema = {"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True, "maxItems": 2}
    assert sum(_closing_agrees(smol_tokenizer, schema, walk_seed, engine) for walk_seed in range(6)) > 5


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        ({"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True}, '["red","green"]',
         '["red","red"]'),  # a value check fails inside the path
        ({"type": "number", "multipleOf": 0.5}, "2.5", "2.3"),  # the grammar is complete, the value cannot end
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
         '{"a":1,"b":2}', '{"a":1,"a":2}'),  # the key guard refuses
    ],
)  # fmt: skip
def test_a_paths_check_refuses_what_tokens_would(smol_tokenizer, schema, valid, invalid):
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer)
    matcher = compiled.matcher()
    for text, expected in ((valid, True), (invalid, False)):
        path = token_ids(smol_tokenizer, text)
        probe = matcher.fork(search=True)
        assert (probe.accept_tokens(path) == len(path) and probe.is_completed()) is expected
        assert matcher.completes(path) is expected
    assert matcher.num_accepted == 0


OPEN_OBJECTS = st.builds(
    lambda properties, required: {"type": "object", "properties": properties, "required": required},
    st.dictionaries(NAMES, SCALARS | st.just({"type": "string"}), min_size=1, max_size=3),
    st.lists(NAMES, max_size=2, unique=True),
)  # open objects in any order: "required" and "properties" are checked schema-wide (MaskBench's commonest case)


def _scans_agree_along_a_walk(tokenizer, schema: dict, walk_seed: int, steps: int = 60) -> int:
    """At each step of a random walk, the candidates' verdicts (``ValueState._violations``: texts grouped,
    inert ones skipped) equal scanning each token's whole text: over the candidates the grammar allows, and
    48 other allowed tokens, those the key guard lets stand (it clears the others first: ``check_row``).
    Returns how many refusals were compared."""
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), tokenizer)
    matcher, rng, refused = compiled.matcher(), random.Random(walk_seed), 0
    for _ in range(steps):
        if matcher.is_terminated() or matcher._values is None:
            break
        state = matcher._values.state
        grammar = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
        matcher.fill_next_token_bitmask(grammar, checks=False)
        allowed = [t for t in allowed_ids(grammar[0], compiled.vocab_size).tolist() if state.vocab.texts[t]]
        candidates = state._candidates()[0]
        chosen = set() if candidates is None else set(allowed) & set(candidates.tolist())
        allowed = sorted(chosen | set(rng.sample(allowed, min(SAMPLED, len(allowed)))))
        if state.key_vocab is not None:
            guard = state.key_state()
            allowed = [t for t in allowed if guard.advance(t) is not None]
        whole = [t for t in allowed if state.advance_bytes(state.vocab.texts[t]) is None]
        assert state._violations(allowed) == whole, (schema, matcher.num_accepted)
        refused += len(whole)
        eager = grammar.clone()
        matcher.check_row(eager[0])
        kept = allowed_ids(eager[0], compiled.vocab_size).tolist()
        if not kept:
            break
        matcher.accept_token(rng.choice(kept))
    return refused


@settings(derandomize=True, database=None, deadline=None, max_examples=40)
@seed(27)
@given(
    schema=st.one_of(SCHEMAS, st.recursive(OPEN_OBJECTS, _containers, max_leaves=4)), walk_seed=st.integers(0, 2**16)
)
def test_grouped_scans_agree_with_whole_texts(smol_tokenizer, schema, walk_seed):
    _scans_agree_along_a_walk(smol_tokenizer, schema, walk_seed)


def test_grouped_scans_meet_refusals(smol_tokenizer):
    """Not vacuous: walks through schemas known to refuse tokens inside strings, keys and scalars."""
    schemas = [
        {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}, "required": [*"bcdef"]},
        {"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True},
        {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}, "maxProperties": 1},
    ]
    assert sum(_scans_agree_along_a_walk(smol_tokenizer, s, seed_) for s in schemas for seed_ in range(4)) > 20


def test_grouped_scans_agree_on_hand_written_texts(smol_tokenizer):
    """Texts the walks seldom meet, against a hand-written vocabulary: an escape before the closing quote
    (``\\\\"}`` closes the string, then the object; ``\\"y"}`` closes it after an escaped quote), whitespace
    runs, and texts that open a string."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer)
    matcher = compiled.matcher()
    assert matcher.accept_string('{"a": "x')
    texts = [b'"', b'"}', b'\\\\"}', b'\\\\"', b'\\"}', b'\\"y"}', b'x"', b'"\\', b'",  "', b'"  }', b"a", b'y"}']
    empty = np.zeros(0, dtype=np.int64)  # [0]: tables _violations does not read
    vocab = ValueVocab(texts, *([empty] * 10))
    state = dataclasses.replace(matcher._values.state, vocab=vocab)
    tokens = list(range(len(texts)))
    refused = state._violations(tokens)
    assert refused == [t for t in tokens if state.advance_bytes(texts[t]) is None]
    # the object lacks "b"; a backslash after the string is not JSON (the grammar refuses it too)
    assert {texts[t] for t in refused} == {b'"}', b'\\\\"}', b'\\"y"}', b'"  }', b'y"}', b'"\\'}


@settings(derandomize=True, database=None, deadline=None, max_examples=30)
@seed(27)
@given(schema=SCHEMAS, walk_seed=st.integers(0, 2**16))
def test_any_allowed_agrees_with_the_filled_mask(smol_tokenizer, schema, walk_seed):
    """``Matcher.any_allowed`` (the checks skipped where a token they cannot refuse is allowed) says what the
    eager mask says, on a search's fork (a dead end allows nothing) and off it, at every step of a walk."""
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer)
    matcher, rng = compiled.matcher(), random.Random(walk_seed)
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
    for _ in range(40):
        for probe in (matcher.fork(search=True), matcher.fork(search=False)):
            probe.fill_next_token_bitmask(bitmask)
            expected = bool(bitmask[0].any())
            assert probe.any_allowed(bitmask) == expected, (schema, matcher.num_accepted)
        matcher.fill_next_token_bitmask(bitmask)
        kept = allowed_ids(bitmask[0], compiled.vocab_size).tolist()
        if matcher.is_terminated() or not kept:
            break
        matcher.accept_token(rng.choice(kept))


def test_any_allowed_at_a_dead_end(smol_tokenizer):
    """``[1,2,1`` under unique items of 1 and 2: every token the grammar allows completes a duplicate, so a
    search's fork allows nothing, and the matcher itself keeps the grammar's row (see ``Matcher``)."""
    schema = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3}
    compiled = constrain.compile(constrain.json_schema(schema, whitespace="compact"), smol_tokenizer)
    matcher = compiled.matcher()
    ids = token_ids(smol_tokenizer, "[1,2,1")
    assert matcher.accept_tokens(ids) == len(ids)
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
    assert not matcher.fork(search=True).any_allowed(bitmask)
    assert matcher.fork(search=False).any_allowed(bitmask)
