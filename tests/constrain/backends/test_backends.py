"""Both engines behind one protocol (constrain.backends.base): the same semantics, state by state."""

import json

import pytest
import torch

from constrain.backends import CompiledGrammar, GrammarState, tokenizer_info
from constrain.backends import llguidance as llg
from constrain.backends import xgrammar as xgr
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
TEXT = '{"n": 12}'


def _grammars(tokenizer, schema: str = SCHEMA) -> dict[str, CompiledGrammar]:
    info = tokenizer_info(tokenizer)
    backend = info.llguidance()
    assert backend is not None, "a fast tokenizer has llguidance"
    return {
        "xgrammar": info.xgrammar.compile_ebnf(
            xgr.json_schema_ebnf(schema, separators=(", ", ": "), max_whitespace=0, any_order=False)
        ),
        "llguidance": backend.compile(llg.json_schema_grammar(schema, separators=(", ", ": "), max_whitespace=0)),
    }


def _allowed(state: GrammarState, vocab_size: int) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
    state.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0].clone()


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_state_follows_the_protocol(smol_tokenizer, engine: str) -> None:
    grammar = _grammars(smol_tokenizer)[engine]
    info = tokenizer_info(smol_tokenizer)
    eos = info.eos_token_ids[0]
    assert grammar.engine == engine and grammar.memory_size_bytes > 0
    state = grammar.new_state()
    tokens = smol_tokenizer.encode(TEXT, add_special_tokens=False)
    start = _allowed(state, info.vocab_size)
    bad = smol_tokenizer.encode("x", add_special_tokens=False)[0]
    assert not state.accept_token(bad), "a rejected token returns False"
    assert torch.equal(_allowed(state, info.vocab_size), start), "and leaves the state unchanged"
    assert all(state.accept_token(t) for t in tokens)
    assert state.is_completed() and not state.is_terminated()
    twin = state.fork()
    state.rollback(len(tokens))
    assert torch.equal(_allowed(state, info.vocab_size), start), "rollback restores the start"
    assert twin.accept_token(eos) and twin.is_terminated(), "EOS ends the fork"
    assert not state.is_terminated(), "the fork is independent"
    assert state.accept_string(TEXT) and state.is_completed()
    state.reset()
    assert state.find_jump_forward_string() == '{"n": ', "the forced prefix"


@pytest.mark.parametrize(("schema", "text"), [(SCHEMA, TEXT), ('{"type": "integer"}', "1234")])  # ends; may go on
@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_rollback_across_the_end_restores_the_state_before_it(smol_tokenizer, engine: str, schema, text) -> None:
    grammar = _grammars(smol_tokenizer, schema)[engine]
    info = tokenizer_info(smol_tokenizer)
    eos = info.eos_token_ids[0]
    state = grammar.new_state()
    tokens = smol_tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) >= 2
    assert all(state.accept_token(t) for t in tokens)
    complete = _allowed(state, info.vocab_size)
    for undone in (1, 2):  # the EOS alone; the EOS and the token before it
        twin = state.fork()
        assert twin.accept_token(eos) and twin.is_terminated()
        assert not twin.accept_token(tokens[-1]), "nothing is taken after the end"
        twin.rollback(undone)
        assert not twin.is_terminated()
        assert all(twin.accept_token(t) for t in tokens[len(tokens) + 1 - undone :])
        assert torch.equal(_allowed(twin, info.vocab_size), complete) and twin.accept_token(eos)
    assert not state.is_terminated(), "forks are independent"


def test_both_engines_allow_the_text_and_fill_in_one_call(smol_tokenizer) -> None:
    grammars = _grammars(smol_tokenizer)
    info = tokenizer_info(smol_tokenizer)
    tokens = smol_tokenizer.encode(TEXT, add_special_tokens=False)
    bad = smol_tokenizer.encode("x", add_special_tokens=False)[0]
    for step in range(len(tokens)):
        for grammar in grammars.values():
            states = [grammar.new_state(), grammar.new_state()]
            for state in states:
                assert all(state.accept_token(t) for t in tokens[:step])
            batched = allocate_token_bitmask(3, info.vocab_size)  # [3, ceil(V / 32)] int32
            grammar.backend.fill_next_token_bitmasks(states, batched, [2, 0])
            assert torch.equal(batched[2], _allowed(states[0], info.vocab_size)), "a batched row is the state's"
            assert torch.equal(batched[0], batched[2]) and bool((batched[1] == -1).all()), "only the rows named"
            allowed = set(allowed_ids(batched[2]))
            assert tokens[step] in allowed and bad not in allowed, (grammar.engine, step)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_state_fills_the_row_named_of_whichever_bitmask_it_is_given(smol_tokenizer, engine: str) -> None:
    state = _grammars(smol_tokenizer)[engine].new_state()
    vocab_size = tokenizer_info(smol_tokenizer).vocab_size
    expected = _allowed(state, vocab_size)  # [ceil(V / 32)] int32
    for bitmask in (allocate_token_bitmask(3, vocab_size), allocate_token_bitmask(2, vocab_size)):
        for index in (1, 0):  # the same state, rows and tensors in turn
            bitmask.fill_(-1)
            state.fill_next_token_bitmask(bitmask, index)
            assert torch.equal(bitmask[index], expected), (bitmask.shape, index)
            others = [row for row in range(bitmask.shape[0]) if row != index]
            assert bool((bitmask[others] == -1).all()), "no other row is written"
    for index in (2, -1):  # rows are named from 0, by both engines
        with pytest.raises((IndexError, RuntimeError), match=r"out of bounds|rows"):
            state.fill_next_token_bitmask(allocate_token_bitmask(2, vocab_size), index)
    with pytest.raises((ValueError, RuntimeError), match="int32"):  # llguidance writes through the pointer
        state.fill_next_token_bitmask(allocate_token_bitmask(2, vocab_size).to(torch.int16), 0)
    if engine == "llguidance":  # (xgrammar 0.2.8 fills a column slice's rows at the wrong places)
        with pytest.raises(ValueError, match="contiguous"):
            state.fill_next_token_bitmask(allocate_token_bitmask(2, vocab_size + 64)[:, :-2], 0)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_special_tokens_are_never_output_text(smol_tokenizer, engine):
    """SmolLM2 names its special tokens as text (``<|im_start|>``), and xgrammar took them for text: a JSON
    string allowed them, and a detokenizer that skips special tokens then printed something else than
    the grammar read. Only the EOS ids stay allowed, and only where the output can end."""
    import constrain
    from constrain.backends.tokenizer import special_token_ids

    special = special_token_ids(smol_tokenizer)
    assert {0, 1, 2, 3, 16} <= special
    compiled = constrain.compile(constrain.json_schema({"type": "string"}), smol_tokenizer, engine=engine)
    matcher = compiled.matcher()
    assert matcher.accept_string('"abc')
    row = allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(row, 0)
    allowed = set(allowed_ids(row[0].numpy()).tolist())
    assert len(allowed) > 1000 and not allowed & special
    assert not matcher.accept_token(1) and not matcher.accept_token(0)
    assert matcher.accept_string('"') and matcher.accept_token(2) and matcher.is_terminated()


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_forced_text_inside_a_character_is_whole_characters(smol_tokenizer, engine: str) -> None:
    """Two Cyrillic words sharing their first byte, written a byte at a time: where the forced bytes end
    inside a character, they are cut before it; where they begin inside one (a token ended on its first
    byte), no text can say them: "". The forced text never raises."""
    schema = json.dumps({"enum": ["ключ", "дом"]})
    state = _grammars(smol_tokenizer, schema)[engine].new_state()
    tokens = smol_tokenizer.convert_tokens_to_ids(['"', "Ð", "\u00b4", "Ð¾Ð¼", '"'])  # '"', 0xd0, 0xb4, "ом", '"'
    forced = []
    for token in tokens:
        forced.append(state.find_jump_forward_string())
        assert state.accept_token(token)
    assert state.is_completed()
    assert forced == ['"', "", "", 'ом"', '"'], forced


def test_llguidance_tokenizer_build_is_waited_for_at_exit(smol_tokenizer):
    """Its thread is no daemon, so Python's exit waits for the build: a daemon thread still inside llguidance
    when the interpreter finalized was ended by unwinding through llguidance's frames, a segfault (the CLI
    with a schema refused at once exited with status 139 in 3 of 8 runs)."""
    import threading

    from constrain.backends.tokenizer import _llg_tokenizer

    future = _llg_tokenizer(smol_tokenizer, len(smol_tokenizer), [smol_tokenizer.eos_token_id])
    building = [t for t in threading.enumerate() if t.name == "constrain-llg-tokenizer"]
    assert building and not any(t.daemon for t in building)
    assert future.result(timeout=60) is not None


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_bounded_number_takes_the_decimals_within_its_bounds(smol_tokenizer, engine):
    """Every decimal of up to two fraction digits between -4 and 4 is taken exactly when it lies within the
    bounds, but for llguidance 1.9's gap (the schemas guide): a decimal whose fraction is a strict
    prefix of the bound's (``3.2`` under ``maximum: 3.25``) is refused, written ``3.20`` it is taken."""
    import constrain
    from constrain.testing import accepts

    schema = {"type": "number", "minimum": -2.25, "maximum": 3.25}
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer, engine=engine)
    gap = {"-2.2", "3.2"} if engine == "llguidance" else set()
    for hundredths in range(-400, 401, 5):
        text = f"{hundredths / 100:g}"
        assert accepts(compiled, smol_tokenizer, text) == (-225 <= hundredths <= 325 and text not in gap), text
    assert accepts(compiled, smol_tokenizer, "3.20")
