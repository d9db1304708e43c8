"""``maxLength`` as the string is written (:mod:`constrain.match.lengths`): the count is the characters
JSON Schema counts, never more than any continuation has, and adds up with the vocabulary's per-token
counts; where llguidance serves a bounded string, the mask refuses exactly the tokens that make it too
long, and nothing else."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import constrain
from constrain.jsonscan import IN_KEY
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids
from constrain.match.checks import ValueChecks
from constrain.match.lengths import token_lengths, written_length
from constrain.match.validate import schema_validator
from constrain.testing import token_ids

# characters whose JSON spelling is several bytes, an escape, or (escaped) a surrogate pair
TEXTS = st.text(alphabet=st.sampled_from(["a", " ", "é", "€", "😀", "\n", '"', "\\", "\x01", "\ud83d", "\ude00"]))


def _raw(text: str, ascii_only: bool) -> bytes:
    """``text`` as a JSON string's raw content (between its quotes)."""
    return json.dumps(text, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")[1:-1]


@settings(derandomize=True, database=None, max_examples=300)
@seed(41)
@given(text=TEXTS, ascii_only=st.booleans())
def test_the_count_is_what_json_schema_counts_and_never_more_as_it_is_written(text, ascii_only):
    raw = _raw(text, ascii_only)
    count, _ = written_length(raw)
    assert count == len(json.loads(b'"' + raw + b'"'))  # (an escaped surrogate pair decodes to one character)
    before = 0
    for cut in range(len(raw) + 1):
        so_far, _ = written_length(raw[:cut])
        assert before <= so_far <= count  # grows byte by byte; no continuation is shorter
        before = so_far


@settings(derandomize=True, database=None, max_examples=200)
@seed(43)
@given(text=TEXTS, ascii_only=st.booleans(), cuts=st.tuples(st.floats(0, 1), st.floats(0, 1)), closed=st.booleans())
def test_a_text_and_a_tokens_count_add_up_from_any_split(text, ascii_only, cuts, closed):
    """After any prefix (its unsettled tail passed along), a token's count up to a closing quote is what
    it adds to the string: the mask clears tokens by these counts at once."""
    raw = _raw(text, ascii_only)
    start, end = sorted(int(c * len(raw)) for c in cuts)
    prefix, piece = raw[:start], raw[start:end]
    count, settled = written_length(prefix)
    whole, whole_settled = written_length(raw[:end])
    token = piece + (b'"}' if closed and whole_settled == end else b"")  # a quote that closes the string
    assert count + int(token_lengths([token], prefix[settled:])[0]) == whole


@settings(derandomize=True, database=None, max_examples=100)
@seed(47)
@given(
    text=st.text(alphabet=st.sampled_from(["a", " ", "é", "€", "😀"])),
    cuts=st.lists(st.floats(0, 1), max_size=8),
    closed=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_a_vocabulary_is_counted_at_once_as_each_token_alone(text, cuts, closed):
    """Tokens cut anywhere from a text (characters begun or ended by a cut), some closing the string: counted
    together, each token's count is :func:`written_length` of its text up to the quote."""
    raw = text.encode()
    at = sorted({0, len(raw), *(int(c * len(raw)) for c in cuts)})
    ends = [*at[1:], len(raw)]  # (the last token empty)
    tokens = [raw[a:b] + b'"x' * c for a, b, c in zip(at, ends, closed[: len(at)], strict=True)]
    assert list(token_lengths(tokens)) == [written_length(token.split(b'"')[0])[0] for token in tokens]


def test_lengths_count_escapes_and_wide_characters_once():
    assert written_length(b"ab") == (2, 2)
    assert written_length("é€".encode()) == (2, 5)
    assert written_length("é".encode()[:1]) == (1, 0)  # a character begun counts, unsettled
    assert written_length(b"a\\u00") == (2, 1)  # so does an escape begun
    assert written_length(b"\\ud83d") == (1, 0)  # a high surrogate last: a low one may join it
    assert written_length(b"\\ud83d\\ude00x") == (2, 13)  # an escaped pair is one character
    assert list(token_lengths([b"abc", b'ab"', b'\\"a', b"", "é".encode()[1:]], b"")) == [3, 2, 2, 0, 0]
    assert list(token_lengths([b"\\ude00", b"x"], b"\\ud83d")) == [0, 1]  # the pair counted with the high


BOUNDED = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 7}, "tags": {"type": "array", "items": {
        "type": "string", "minLength": 1, "maxLength": 3}, "maxItems": 3, "uniqueItems": True}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}  # fmt: skip
"""Bounded strings beside a keyword the value checks enforce anyway (``uniqueItems``)."""


def _dropped(compiled) -> list:
    return [e for e in compiled.coverage if e.pointer == "" and e.keyword == "maxLength"]


@pytest.mark.parametrize("mode", ["specification", "generation"])
def test_llguidance_gets_no_string_bound_where_the_checks_run_and_they_say_so(smol_tokenizer, mode):
    compiled = constrain.compile(constrain.json_schema(BOUNDED, mode=mode), smol_tokenizer, engine="llguidance")
    assert '"maxLength"' not in json.dumps(compiled.engine_schema)
    said = _dropped(compiled)
    assert len(said) == 1 and said[0].status == "enforced" and "as each string is written" in said[0].note
    served = constrain.compile(constrain.json_schema(BOUNDED, mode=mode), smol_tokenizer, engine="xgrammar")
    assert not _dropped(served)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 7}}, "required": ["a"],
         "additionalProperties": False},  # nothing else checked: the checks would read every token for it
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 300}, "b": {"type": "array",
         "uniqueItems": True}}, "required": ["a"], "additionalProperties": False},  # a bound llguidance is fast at
    ],
)  # fmt: skip
def test_llguidance_keeps_the_bounds_it_is_fast_at_or_where_nothing_else_is_checked(smol_tokenizer, schema):
    compiled = constrain.compile(constrain.json_schema(schema, mode="generation"), smol_tokenizer, engine="llguidance")
    assert '"maxLength"' in json.dumps(compiled.engine_schema) and not _dropped(compiled)


@pytest.mark.parametrize("mode", ["specification", "generation"])
def test_random_walks_never_write_a_string_too_long_and_never_meet_a_dead_end(smol_tokenizer, mode):
    """In specification mode keys come in any order, and the key guard refuses a repeated key only as it
    completes: a walk that writes one's start stops there (a dead end of the key guard's, not of the
    lengths'; as before strings were checked here), so there only the verdicts are counted."""
    compiled = constrain.compile(constrain.json_schema(BOUNDED, mode=mode), smol_tokenizer, engine="llguidance")
    rng, compared, ended = random.Random(5), 0, 0
    for _ in range(8):
        matcher = compiled.matcher()
        tokens = []
        for _ in range(80):
            grammar = allocate_token_bitmask(1, compiled.vocab_size)  # [1, ceil(V / 32)]
            matcher.fill_next_token_bitmask(grammar, checks=False)
            eager = grammar.clone()
            matcher.check_row(eager[0])
            granted = allowed_ids(grammar[0], compiled.vocab_size).tolist()
            kept = set(allowed_ids(eager[0], compiled.vocab_size).tolist())
            for token in rng.sample(granted, min(48, len(granted))) + sorted(set(granted) - kept)[:48]:
                assert matcher.allows(token, grammar[0]) == (token in kept), (tokens, token)
                compared += 1
            if not kept and matcher._values.state.scan.mode == IN_KEY:  # a repeated key (specification)
                break
            assert kept, ("no token left: a dead end", smol_tokenizer.decode(tokens))
            ends = [t for t in kept if t in matcher._eos]
            closing = [t for t in sorted(kept) if set(smol_tokenizer.decode([t])) & set('"]}')]
            token = ends[0] if ends else rng.choice(closing if closing and rng.random() < 0.3 else sorted(kept))
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
            tokens.append(token)
        if matcher.is_terminated():
            ended += 1
            value = json.loads(smol_tokenizer.decode(tokens))
            jsonschema.validate(value, BOUNDED)
    assert compared > 1000 and (ended >= 3 or mode == "specification"), (ended, compared)


@pytest.mark.parametrize("name", ["abcdefg", 'é€😀\n"ab', "\\u00e9abcdef", "\\ud83d\\ude00abcdef"])
def test_a_string_of_exactly_its_bound_is_taken_and_one_more_character_refused(smol_tokenizer, name):
    compiled = constrain.compile(constrain.json_schema(BOUNDED, mode="generation"), smol_tokenizer, engine="llguidance")
    raw = name if name.startswith("\\") else json.dumps(name, ensure_ascii=False)[1:-1]
    for text, fits in ((raw, True), (raw + "x", False)):
        matcher = compiled.matcher()
        ids = token_ids(smol_tokenizer, f'{{"name": "{text}", "tags": ["a"]}}')
        taken = matcher.accept_tokens(ids)
        assert (taken == len(ids)) == fits, (text, taken)
        if not fits:  # refused where the eighth character is written, not later at the closing quote
            assert '"' not in smol_tokenizer.decode([ids[taken]]), smol_tokenizer.decode(ids[: taken + 1])


def test_each_subschema_keeps_its_own_keywords_beyond_the_grammar():
    """Coverage entries that mark another keyword checked in a subschema add to what the walk found there
    (each node's own, never the node checked before it)."""
    properties = {
        f"p{i}": {"type": "array", "uniqueItems": True, "maxLength": 4} if i % 2 else {"not": {"const": 1}}
        for i in range(12)
    }
    schema = {"type": "object", "properties": properties}
    coverage = [
        constrain.CoverageEntry(f"/properties/p{i}", "maxLength" if i % 2 else "not", "checked") for i in range(12)
    ]
    checks = ValueChecks(schema, schema_validator(json.dumps(schema)), coverage)
    for i, node in enumerate(properties.values()):
        loose = checks._loose[checks._index[id(node)]]
        assert loose == ({"uniqueItems", "maxLength"} if i % 2 else {"not"}), (i, loose)
