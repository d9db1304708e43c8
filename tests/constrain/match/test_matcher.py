"""The matcher's contract with the decode loop: filling a mask changes nothing (its look-ahead included), so
a mask filled on a fork (a draft's slot) agrees with the matcher's own; a terminated matcher allows EOS only,
until a rollback undoes the EOS."""

from __future__ import annotations

import constrain
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids
from constrain.match.matcher import Matcher, fill_next_token_bitmasks
from constrain.testing import token_ids

# two values and three distinct items: after [1, 2, 1 every token ends an invalid item (a dead end of the value checks)
DEAD_END = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3}
PREFIX = "[1, 2, 1"


def _at_dead_end(smol_tokenizer):
    compiled = constrain.compile(constrain.json_schema(DEAD_END, mode="specification"), smol_tokenizer)
    matcher = compiled.matcher()
    ids = token_ids(smol_tokenizer, PREFIX)
    assert matcher.accept_tokens(ids) == len(ids)
    return compiled, matcher


def test_filling_a_mask_changes_no_state(smol_tokenizer):
    compiled, matcher = _at_dead_end(smol_tokenizer)
    bitmask = allocate_token_bitmask(2, compiled.vocab_size)  # [2, ceil(V / 32)]
    assert matcher.fill_next_token_bitmask(bitmask, 0)
    assert fill_next_token_bitmasks([matcher], bitmask, [1]) == [True]  # a dead end: the row is the grammar's
    assert matcher.dead_ends == [] and matcher.at_dead_end()
    assert (
        set(allowed_ids(bitmask[0]).tolist())
        == set(allowed_ids(bitmask[1]).tolist())
        >= {token_ids(smol_tokenizer, "]")[0]}
    )


def test_a_dead_end_met_on_a_fork_is_met_again_by_the_matcher(smol_tokenizer):
    """A draft's slot fills its mask on a fork; the matcher itself, never filled there, must still take the
    token the sampler drew from that mask (it works the dead end out again), and record the step."""
    compiled, matcher = _at_dead_end(smol_tokenizer)
    fork = matcher.fork()
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    fork.fill_next_token_bitmask(bitmask)
    close = token_ids(smol_tokenizer, "]")[0]
    assert close in allowed_ids(bitmask[0]).tolist()
    steps = matcher.num_accepted
    assert matcher.accept_token(close)
    assert matcher.dead_ends == [steps]
    matcher.rollback(1)
    assert matcher.dead_ends == []
    searching = compiled.matcher().fork(search=True)  # a search's fork backs out instead: nothing allowed
    searching.accept_tokens(token_ids(smol_tokenizer, PREFIX))
    searching.fill_next_token_bitmask(bitmask)
    assert not bitmask.any() and not searching.accept_token(close)


def test_a_terminated_matcher_allows_eos_only(smol_tokenizer):
    compiled = constrain.compile(constrain.choice(["yes", "no"]), smol_tokenizer)
    matcher = compiled.matcher()
    eos = compiled.tokenizer.eos_token_ids
    ids = [*token_ids(smol_tokenizer, "yes"), eos[0]]
    assert matcher.accept_tokens(ids) == len(ids)
    assert matcher.is_terminated()
    bitmask = allocate_token_bitmask(2, compiled.vocab_size)  # [2, ceil(V / 32)]
    matcher.fill_next_token_bitmask(bitmask, 0)  # the engine itself would raise here
    fill_next_token_bitmasks([matcher, compiled.matcher()], bitmask)
    assert set(allowed_ids(bitmask[0]).tolist()) == set(eos)
    assert set(allowed_ids(bitmask[1]).tolist()) != set(eos)  # the other row is its own


def test_a_terminated_matcher_is_undone_by_a_rollback_on_both_engines(smol_tokenizer):
    for engine in ("xgrammar", "llguidance"):
        compiled = constrain.compile(constrain.json_schema({"enum": ["yes"]}), smol_tokenizer, engine=engine)
        matcher = compiled.matcher()
        ids = token_ids(smol_tokenizer, '"yes"')
        assert matcher.accept_tokens(ids) == len(ids) and not matcher.is_terminated()
        assert matcher.accept_token(compiled.tokenizer.eos_token_ids[0]) and matcher.is_terminated(), engine
        assert matcher.fork().is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated() and matcher.is_completed(), engine
        matcher.accept_token(compiled.tokenizer.eos_token_ids[0])
        matcher.reset()
        assert not matcher.is_terminated() and matcher.num_accepted == 0, engine


def test_the_look_ahead_leaves_the_matcher_as_it_was(smol_tokenizer, monkeypatch):
    """The look-ahead takes each probed token on the matcher and rolls it back: after every probe, the
    matcher's scanners, count and grammar state are those it had before (the grammar's next mask and its
    forced text alike), along a walk that probes at every item of the array."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True, "maxItems": 3}
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer)
    matcher = compiled.matcher()
    probe, probes = Matcher._viable, []

    def grammar_view(m: Matcher) -> tuple:
        row = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
        m._grammar_state.fill_next_token_bitmask(row, 0)
        return tuple(allowed_ids(row[0]).tolist()), str(m._grammar_state.find_jump_forward_string())

    def checked(m: Matcher, token: int, depth: int) -> bool:
        before = (m.num_accepted, m._keys, m._values, m.searching, m.is_terminated(), grammar_view(m))
        verdict = probe(m, token, depth)
        assert (m.num_accepted, m._keys, m._values, m.searching, m.is_terminated(), grammar_view(m)) == before
        probes.append(verdict)
        return verdict

    monkeypatch.setattr(Matcher, "_viable", checked)
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
    for token in token_ids(smol_tokenizer, '["red", "green", "blue"]'):
        matcher.fill_next_token_bitmask(bitmask)
        assert (int(bitmask[0, token >> 5]) >> (token & 31)) & 1
        assert matcher.accept_token(token)
    assert True in probes and False in probes  # probes ran, and refused some (a repeated colour's prefix)
