"""Keywords beyond a grammar, enforced by the mask at value boundaries (constrain.match.values).

Every table row is walked token by token with the mask alone (``accepts``: each token must be allowed by
the filled mask, and the matcher must be able to end); post-validation plays no part.
"""

from __future__ import annotations

import json

import hypothesis
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import constrain
from constrain.compiler import compiler
from constrain.compiler.json_schema import AT_BOUNDARIES
from constrain.match.validate import parse_json
from constrain.testing import accepts


def spec(schema):
    return constrain.json_schema(schema, mode="specification")


TABLE = [
    # keyword, schema, accepted, refused
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        ["[1, 2, 3]", "[]", "[1, 10]"],
        ["[1, 2, 1]", "[3, 3]"],
    ),
    (
        "uniqueItems (objects)",
        {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
        ['[{"a": 1}, {"a": 2}]'],
        ['[{"a": 1}, {"a": 1}]'],
    ),
    (
        "maxContains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1},
        ["[1, 2, 3]", "[2, 1]"],
        ["[1, 2, 1]", "[1, 1]"],
    ),
    (
        "minContains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2},
        ["[1, 2, 1]"],
        ["[1, 2]", "[]"],
    ),
    (
        "multipleOf",
        {"type": "number", "multipleOf": 0.25},
        ["1.25", "3", "0.5"],
        ["1.3", "0.1"],
    ),
    (
        "not",
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        ['{"a": 1}', '{"a": null}'],
        ['{"a": "x"}'],
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "dependentRequired": {"card": ["billing"]},
        },
        ['{"card": "x", "billing": "y"}', '{"billing": "y"}', "{}"],
        ['{"card": "x"}'],
    ),
    (
        "dependentSchemas",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        ['{"a": 1, "b": 2}', '{"b": 2}'],
        ['{"a": 1}'],
    ),
    (
        "minProperties beside optional keys",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "minProperties": 1},
        ['{"a": 1}', '{"b": 2}'],
        ["{}"],
    ),
    (
        "maxProperties beside optional keys",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
            "maxProperties": 2,
        },
        ['{"a": 1, "b": 2}', "{}"],
        ['{"a": 1, "b": 2, "c": 3}'],
    ),
    (
        "if/then/else",
        {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
            "required": ["kind", "n"],
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"properties": {"n": {"minimum": 10}}},
            "else": {"properties": {"n": {"maximum": 0}}},
        },
        ['{"kind": "a", "n": 12}', '{"kind": "b", "n": -3}'],
        ['{"kind": "a", "n": 3}', '{"kind": "b", "n": 3}'],
    ),
    (
        "format (email)",
        {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}, "required": ["to"]},
        ['{"to": "ana@example.org"}'],
        ['{"to": "not an address"}'],
    ),
    (
        "format (uri)",
        {"type": "object", "properties": {"home": {"type": "string", "format": "uri"}}, "required": ["home"]},
        ['{"home": "https://example.org/a"}'],
        ['{"home": "example"}'],
    ),
    (
        "oneOf exclusive",
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        ["-2", "0.5"],
        ["3"],
    ),
    (
        "propertyNames",
        {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": 3}},
        ['{"ab": 1}'],
        ['{"abcd": 1}'],
    ),
]


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("keyword", "schema", "good", "bad"), TABLE, ids=[row[0] for row in TABLE])
def test_the_mask_alone_enforces(smol_tokenizer, engine, keyword, schema, good, bad):
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine=engine)
    assert compiled.value_checks is not None, keyword
    for text in good:
        assert accepts(compiled, smol_tokenizer, text), f"{keyword}: a valid {text} was refused"
    for text in bad:
        assert compiled.validate(text), f"table error: {text} is valid"
        assert not accepts(compiled, smol_tokenizer, text), f"{keyword}: the mask let {text} through"


def test_coverage_says_enforced_at_boundaries(smol_tokenizer):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}, "required": ["tags"]}
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    entry = next(e for e in compiled.coverage if e.keyword == "uniqueItems")
    assert entry.status == "enforced" and AT_BOUNDARIES in entry.note
    assert compiled.fully_enforced
    exact = constrain.compile(spec({"type": "array", "items": {"type": "integer"}}), smol_tokenizer)
    assert exact.value_checks is None  # nothing beyond the grammar: no scanner at all


def test_a_declared_key_written_as_an_extra_key_keeps_its_schema(smol_tokenizer):
    """Past 16 declared names, an open object's extra keys are any string: a declared key taking that
    path must still get its own value schema (issue 14's example: an array of strings took 12345)."""
    names = [f"field_{i}" for i in range(12)]
    schema = {"type": "object", "properties": {n: {"type": "array", "items": {"type": "string"}} for n in names}}
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine="xgrammar")
    assert any("any string" in e.note for e in compiled.coverage)
    assert accepts(compiled, smol_tokenizer, '{"field_3": ["a"], "other": 12345}')
    assert not accepts(compiled, smol_tokenizer, '{"other": 1, "field_3": [12345]}')


def test_the_lookahead_refuses_what_leads_only_to_invalid_values(smol_tokenizer):
    """The engines' date regexes know no month lengths: after "2023-02-3 they allow 0 and 1, and each
    forces the closing quote of an invalid date. Looking two steps ahead, the mask refuses the 3."""
    from constrain.testing import token_ids, walk

    compiled = constrain.compile(spec({"type": "string", "format": "date"}), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, '"2024-02-29"') and accepts(compiled, smol_tokenizer, '"2023-03-31"')
    through, matcher = walk(compiled, token_ids(smol_tokenizer, '"2023-02-30"'))
    assert not through and matcher.num_accepted == len(token_ids(smol_tokenizer, '"2023-02-'))
    assert not matcher.dead_ends


def test_matcher_state_follows_rollback_and_fork(smol_tokenizer):
    from constrain.testing import token_ids

    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    ids = token_ids(smol_tokenizer, "[1, 2, 1")
    matcher = compiled.matcher()
    assert matcher.accept_tokens(ids) == len(ids)
    close = token_ids(smol_tokenizer, "]")[0]
    twin = matcher.fork()
    assert not matcher.accept_token(close)  # [1, 2, 1] would repeat an item
    matcher.rollback(1)  # back to "[1, 2, "
    assert matcher.accept_tokens(token_ids(smol_tokenizer, "3]")) == 2 and matcher.is_completed()
    assert not twin.accept_token(close) and twin.accept_tokens(token_ids(smol_tokenizer, "0]")) == 2


def test_a_string_nothing_checks_is_not_kept(smol_tokenizer):
    """Inside a string that neither it nor its containers check, a run of text returns the very state (its
    text is never read): O(1) per token. The verdicts after it equal those of a state that kept every byte."""
    from constrain.testing import token_ids

    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "tags": tags}, "required": ["note", "tags"]}
    compiled = constrain.compile(constrain.json_schema(schema, mode="generation"), smol_tokenizer)
    matcher = compiled.matcher()
    assert matcher.accept_string('{"note": "')
    state = matcher._values.state
    run = token_ids(smol_tokenizer, "a long note, written over many tokens with no quote in them")
    for token in run:
        assert matcher.accept_token(token)
        assert matcher._values.state is state  # unchanged: nothing kept
    rest = '", "tags": ["a", "b", "a'
    assert matcher.accept_tokens(token_ids(smol_tokenizer, rest)) == len(token_ids(smol_tokenizer, rest))
    kept = state.advance_bytes(smol_tokenizer.decode(run).encode() + rest.encode())
    skipped = matcher._values.state
    assert kept is not None and kept.scan.text == skipped.scan.text == b'"a'
    tokens = list(range(len(skipped.vocab.texts)))
    refused = skipped._violations(tokens)
    assert refused == kept._violations(tokens) and token_ids(smol_tokenizer, '"')[0] in refused  # "a" again


@pytest.mark.parametrize("reads", [False, True])
def test_an_object_checked_by_its_keys_alone_keeps_no_member_value(smol_tokenizer, reads):
    """On llguidance with keys in any order, ``required`` is checked as each object closes: it reads the
    keys alone, so a member's string text is not kept (O(1) per token) and the member is held as None.
    Where a check reads the values (``not`` here), the text is kept. The verdicts hold either way."""
    from constrain.testing import token_ids

    schema = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["note", "n"],
        **({"not": {"required": ["spam"]}} if reads else {}),
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer, engine="llguidance")
    matcher = compiled.matcher()
    assert matcher.accept_string('{"n": 3, "note": "')
    state = matcher._values.state
    assert state.stack[-1].items == (("n", 3 if reads else None),)
    for token in token_ids(smol_tokenizer, "a long note, written over many tokens"):
        assert matcher.accept_token(token)
        assert (matcher._values.state is state) is not reads
    assert matcher.accept_string('"}') and matcher.is_completed()
    assert accepts(compiled, smol_tokenizer, '{"note": "x", "n": 1}')
    assert not accepts(compiled, smol_tokenizer, '{"note": "a long note"}')  # "n" is required


_NOTE_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string"},
        "b": {"type": "string"},
        "c": {"type": "array", "items": {"type": "string"}},
        "d": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
    },
    "required": ["a", "d"],
    "minProperties": 3,
}
"""Objects checked by their keys alone (on llguidance with keys in any order), whose members hold strings."""


@st.composite
def _keyed_objects(draw: st.DrawFn) -> str:
    """A JSON text near :data:`_NOTE_SCHEMA`: its keys in any order, some left out, repeated or undeclared;
    strings with quotes, backslashes and other scripts, written escaped or not."""
    strings = st.text(alphabet=st.sampled_from('ab "\\\u00e9\u4e2d/\n'), max_size=6)

    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=draw(st.booleans()))

    members = []
    keys = draw(st.permutations("abcd"))[: draw(st.integers(1, 4))]  # often valid: a, d and one more
    for key in [*keys, *draw(st.lists(st.sampled_from("abcdx"), max_size=1))]:  # maybe one repeated or undeclared
        if key == "c":
            value = dumps(draw(st.lists(strings, max_size=2)))
        elif key == "d":
            inner = draw(st.sampled_from(["e", "e", "", "ex"]))
            value = "{" + ", ".join(f'"{k}": {dumps(draw(strings))}' for k in inner) + "}"
        else:
            value = dumps(draw(strings))
        members.append(f'"{key}": {value}')
    return "{" + ", ".join(members) + "}"


@settings(derandomize=True, database=None, deadline=None, max_examples=80)
@hypothesis.seed(61)
@given(text=_keyed_objects())
def test_objects_checked_by_their_keys_alone_take_exactly_the_valid_texts(smol_tokenizer, text):
    """Their string members' text is not kept (see above): the mask still takes exactly the texts a JSON
    parser reads as valid with no key written twice."""

    try:
        valid = jsonschema.Draft202012Validator(_NOTE_SCHEMA).is_valid(parse_json(text))
    except ValueError:  # a key twice
        valid = False
    compiled = constrain.compile(spec(_NOTE_SCHEMA), smol_tokenizer, engine="llguidance")
    assert accepts(compiled, smol_tokenizer, text) == valid, text


def test_a_compile_builds_the_first_validators(smol_tokenizer):
    """The validators of the subschemas with keywords beyond the grammar are built by the compile (within
    WARM_SECONDS), not by the first token that completes such a value."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True}, "n": {"not": {"const": 3}}},
        "required": ["tags"],
    }
    checks = constrain.compile(spec(schema), smol_tokenizer).value_checks
    assert checks._own and all((index, True) in checks._validators for index in checks._own)
    assert checks.warm(0) == 0  # out of time before the first


ENUM_SET = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue", "black"]},
    "uniqueItems": True,
    "minItems": 3,
    "maxItems": 4,  # a fifth item has no valid value: the lookahead (two steps) would meet that dead end late
}


def test_generation_never_completes_a_forbidden_value(tiny, monkeypatch):
    """A random model picks colours at random: without the checks it repeats one in most samples; with
    them, no sample does, and none hits a dead end."""

    def run(constraint):
        return [
            constrain.generate(tiny, "colours:", constraint=constraint, temperature=1.0, seed=seed, max_tokens=60)
            for seed in range(12)
        ]

    checked = run(spec(ENUM_SET))
    assert all(r.valid for r in checked), [(r.text, r.violations) for r in checked]
    assert all(len(set(r.value)) == len(r.value) >= 3 for r in checked)
    # the test can fail: the grammar alone repeats (another cache key, compiled without the checks)
    monkeypatch.setattr(compiler, "value_checks", lambda constraint, coverage, *tracked: (None, coverage))
    unchecked = run(constrain.json_schema(ENUM_SET, mode="specification", whitespace="compact"))
    assert sum(not r.valid for r in unchecked) >= 3, [r.text for r in unchecked]


GENERATED = {
    "multipleOf": {"type": "array", "items": {"type": "number", "multipleOf": 3}, "minItems": 3, "maxItems": 3},
    "not": {"type": "array", "items": {"type": "integer", "not": {"enum": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}},
            "minItems": 3, "maxItems": 3},
    "maxContains": {"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 1}, "maxContains": 1,
                    "minItems": 4, "maxItems": 4},
}  # fmt: skip


@pytest.mark.parametrize("keyword", list(GENERATED))
def test_sampled_outputs_keep_the_keyword(tiny, keyword, monkeypatch):
    """Sampled on a random model, every output keeps the keyword; the grammar alone breaks it."""

    def run(constraint):
        return [
            constrain.generate(tiny, "x", constraint=constraint, temperature=1.0, seed=s, max_tokens=40)
            for s in range(8)
        ]

    assert all(r.valid for r in run(spec(GENERATED[keyword]))), keyword
    monkeypatch.setattr(compiler, "value_checks", lambda constraint, coverage, *tracked: (None, coverage))
    unchecked = run(constrain.json_schema(GENERATED[keyword], mode="specification", whitespace="compact"))
    assert any(not r.valid for r in unchecked), [r.text for r in unchecked]


def test_a_dead_end_is_reported(tiny):
    """Two values and three distinct items: no valid continuation exists, and the result says so."""
    schema = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3}
    result = constrain.generate(tiny, "x", constraint=spec(schema), temperature=0, max_tokens=40, close_in_budget=False)
    assert not result.valid
    assert any("no valid continuation" in v for v in result.violations), result.violations


def test_the_closing_path_respects_the_checks(tiny):
    """A budget too small for the model's own ending: the closing path writes distinct items."""
    schema = {"type": "array", "items": {"enum": ["a", "b", "c", "d", "e"]}, "uniqueItems": True, "minItems": 4}
    closed = 0
    for seed in range(8):
        result = constrain.generate(tiny, "x", constraint=spec(schema), temperature=1.0, seed=seed, max_tokens=24)
        assert result.valid, (result.text, result.violations)
        closed += result.finish_reason == "length"
    assert closed  # the closing path wrote some of them


# an object is never valid (it needs "a": three distinct items of two values), which only the value checks
# see (an object that needs "a" and must not have it is proven empty at compile time, and its branch dropped:
# tests/constrain/constraints/test_unsatisfiable.py); any string is
NO_OBJECT = {"anyOf": [{"type": "string", "maxLength": 8},
                       {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]},
                        "uniqueItems": True, "minItems": 3}}, "required": ["a"]}]}  # fmt: skip


@pytest.mark.parametrize("close_in_budget", [True, False])
def test_the_budget_steers_away_from_values_that_cannot_finish(tiny, close_in_budget):
    """A model pushed to write an object, which the checks refuse at every end: the budget refuses the
    ``{`` (no completion exists after it) and the output is a valid string; without it, a dead end."""
    brace = tiny.tokenizer.encode("{", add_special_tokens=False)[0]
    result = constrain.generate(
        tiny, "x", constraint=spec(NO_OBJECT), temperature=0, max_tokens=40, logit_bias={brace: 100.0},
        close_in_budget=close_in_budget,
    )  # fmt: skip
    if close_in_budget:
        assert result.valid and isinstance(result.value, str), (result.text, result.violations)
        assert result.forced_tokens >= 1 and not result.closed_early  # steered at the start, not closed at the end
    else:
        assert not result.valid and result.text.startswith("{"), result.text


TAGS = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
                                              "minItems": 2, "maxItems": 3}},
    "required": ["tags"]}}}  # fmt: skip
PLAIN = {"type": "function", "function": {"name": "plain", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "smollm2", "json_list"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_arguments_are_checked(smol_tokenizer, fmt, choice):
    """Each call's arguments are checked against their tool's schema, in every call of a reply; text
    before the calls that merely looks like one is not."""
    from constrain.tools.calling import tool_calling

    spec = tool_calling([TAGS, PLAIN], tool_choice=choice, format=fmt)
    compiled = compiler.compile(spec.constraint(), smol_tokenizer)
    assert compiled.value_checks is not None
    f, lead = spec.format, "Sure. " if choice == "auto" else ""
    good = [("tag", '{"tags": ["a", "b"]}'), ("plain", '{"n": 1}'), ("tag", '{"tags": ["c", "b", "a"]}')]
    assert accepts(compiled, smol_tokenizer, lead + f.render(good))
    for bad in ('{"tags": ["a", "a"]}', '{"tags": ["b", "c", "b"]}'):
        assert not accepts(compiled, smol_tokenizer, lead + f.render([("tag", bad)]))
        assert not accepts(compiled, smol_tokenizer, lead + f.render([("plain", '{"n": 2}'), ("tag", bad)]))
    if choice == "auto" and fmt != "json_list":
        look_alike = 'I could send {"name": "tag", "arguments": {"tags": ["a", "a"]}} as text.'
        assert accepts(compiled, smol_tokenizer, look_alike)


def test_exact_tool_grammars_run_no_checks(smol_tokenizer):
    from constrain.tools.calling import tool_calling

    assert compiler.compile(tool_calling([PLAIN]).constraint(), smol_tokenizer).value_checks is None


def test_sampled_tool_calls_keep_their_arguments_valid(tiny, monkeypatch):
    """A random model calling a tool with a unique-items argument: every call valid with the checks;
    the grammar alone repeats items."""

    def run():
        return [
            constrain.chat(tiny, [{"role": "user", "content": "x"}], tools=[TAGS], tool_choice="required",
                           temperature=1.0, seed=seed, max_tokens=60)
            for seed in range(10)
        ]  # fmt: skip

    checked = run()
    assert all(r.tool_calls and r.valid for r in checked), [(r.generation.text, r.violations) for r in checked]
    monkeypatch.setattr(compiler, "embedded_checks", lambda embedded: None)
    compiler.clear_cache()
    try:
        unchecked = run()
    finally:
        monkeypatch.undo()
        compiler.clear_cache()  # no grammar compiled without its checks stays for the next test
    assert any(not r.valid for r in unchecked), [r.generation.text for r in unchecked]


def test_a_check_that_raises_refuses(smol_tokenizer, monkeypatch, caplog):
    """No silent pass: a value check that cannot decide (it raises) refuses the value, and says so."""
    compiled = constrain.compile(spec({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
                                 smol_tokenizer)  # fmt: skip
    checks = compiled.value_checks
    assert checks is not None and accepts(compiled, smol_tokenizer, "[1, 2]")

    class Broken:
        def is_valid(self, value):
            raise RecursionError("too deep")

    monkeypatch.setattr(checks, "_validators", {key: Broken() for key in checks._validators})
    monkeypatch.setattr(checks, "_verdicts", {})
    assert not accepts(compiled, smol_tokenizer, "[3, 4]")
    assert checks.errors > 0 and "refused" in caplog.text


TREE = {
    "$defs": {"Node": {"type": "object", "required": ["s", "email", "dur", "parent"], "properties": {
        "s": {"type": "string"}, "email": {"type": "string", "format": "email"},
        "dur": {"type": "string", "format": "duration"},
        "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
    "$ref": "#/$defs/Node",
}  # fmt: skip
"""A Pydantic model with an ``Optional`` parent of its own type (what ``model_json_schema`` writes)."""


def test_a_value_of_a_type_its_place_refuses_is_refused_where_it_begins(smol_tokenizer):
    """In specification mode an open object's grammar lets a declared key's value be any JSON value: the value
    checks refused a wrong one only once complete, so a string begun for ``parent`` (an object or null) could
    never end, and the closing found no way out. A value whose JSON type no alternative admits is refused at
    its first token."""
    from constrain.match.bitmask import allocate_token_bitmask, allowed_ids

    compiled = constrain.compile(constrain.json_schema(TREE, mode="specification"), smol_tokenizer)
    matcher = compiled.matcher()
    assert matcher.accept_string('{"s":"","email":"a@b.cd","dur":"P1D","parent":')
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = {smol_tokenizer.decode([t]) for t in allowed_ids(bitmask[0], compiled.vocab_size)}
    assert {"n", "{", " n", " {"} <= allowed and not allowed & {'"', "0", "[", "t", " true", ' "'}, sorted(allowed)
    for text, valid in (('"x"', False), ("1", False), ("[]", False), ("true", False), ("null", True)):
        probe = compiled.matcher()
        assert (probe.accept_string('{"s":"","email":"a@b.cd","dur":"P1D","parent":' + text + "}")) == valid, text


def test_a_declared_keys_value_is_held_to_its_schema_in_an_open_object(smol_tokenizer):
    """Specification mode on xgrammar: an open object's grammar lets a declared key's value be any JSON
    value, which was checked only with the whole object (``{"isMember": ""`` was a dead end the mask let in).
    The value is now refused where it begins, and checked as it completes."""
    from constrain.match.bitmask import allocate_token_bitmask
    from constrain.testing import allowed_ids, token_ids, walk

    schema = {"type": "object", "properties": {"isMember": {"type": "boolean"}, "membershipNumber": {"type": "string"}},
              "required": ["isMember"]}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(schema, mode="specification"), smol_tokenizer, engine="xgrammar")
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, '{"isMember": '))
    row = allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(row)
    allowed = {smol_tokenizer.decode([t]) for t in allowed_ids(row[0], compiled.vocab_size)}
    assert ok and {"t", "f"} <= allowed and not {'"', "0", "[", "{", "n"} & allowed, allowed
    assert not walk(compiled, token_ids(smol_tokenizer, '{"isMember": "yes"'))[0]
    assert walk(compiled, token_ids(smol_tokenizer, '{"membershipNumber": "x", "isMember": false, "extra": [1]}'))[0]
