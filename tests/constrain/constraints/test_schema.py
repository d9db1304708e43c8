"""JSON Schema strictness: what the grammar accepts, what validate() flags, and what is refused."""

from __future__ import annotations

import json

import pytest

import constrain
from constrain.constraints.formats import FORMATS
from constrain.errors import UnsatisfiableSchemaError
from constrain.match.budget import Budget
from constrain.testing import accepts, token_ids


def spec(schema, **options):
    """JSON Schema's own semantics (open objects, any key order, single whitespace): what these tests check."""
    return constrain.json_schema(schema, mode="specification", **options)


# (schema, instances the mask must accept, instances it must reject or validate() must flag)
schema__valid__invalid = [
    (  # allOf: xgrammar alone keeps only the first branch
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["b"]}]},
        [{"a": 1, "b": 2}, {"b": "x"}],
        [{"a": 1}, {"a": "s", "b": 1}],
    ),
    (  # patternProperties: xgrammar alone rejects every key
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        [{"x1": 1}, {}, {"x": 2, "xy": 3}],
        [{"x1": "s"}, {"y": 1}],
    ),
    ({"const": {"a": [1, 2]}}, [{"a": [1, 2]}], [{"a": [1]}, {"a": [1, 2], "b": 0}, [1, 2]]),
    ({"enum": [1, "x", None, {"k": True}, [0]]}, [1, "x", None, {"k": True}, [0]], [2, {"k": False}, [0, 0]]),
    ({"type": "string", "pattern": "a+"}, ["xaay", "a"], ["b", ""]),  # search, not full match
    ({"type": "string", "pattern": "^a+$"}, ["aa"], ["ab"]),
    ({"type": "string", "pattern": "^ab|cd$"}, ["abx", "xcd"], ["xab", "cdx"]),  # outer anchors bind one branch
    (  # each top-level alternative anchored: in the grammar, whose prefixes are then exact
        {"type": "string", "pattern": "^[0-9a-f]{4}-[0-9a-f]{2}$|^[0-9a-f]{8}$", "maxLength": 8},
        ["1234-ab", "1234abcd"],
        ["1234abcd9", "1234-abc", "x1234-ab"],
    ),
    ({"type": "string", "pattern": "(^a|b)c"}, ["ac", "xbc"], ["xac"]),  # an anchor inside
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 4}, ["abc"], ["ab", "abcde", "AB1"]),
    ({"type": "string", "format": "email", "maxLength": 8}, ["a@b.co"], ["abcdef@b.co"]),
    ({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 3.5}, [1, 3], [0, 4]),
    ({"type": "integer", "maximum": 10**20}, [5, 10**19], [10**21]),
    ({"type": "number", "multipleOf": 0.5}, [1.5, 2], [1.2]),
    ({"type": "array", "uniqueItems": True}, [[1, 2]], [[1, 1]]),
    ({"not": {"type": "string"}}, [1, None], ["s"]),
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, [1, 2.5, "s"], [3]),
    (
        {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
        [{"a": 1, "b": 0}, {"a": 2, "c": 0}],
        [{"a": 1}, {"a": 2}],
    ),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {}], [{"a": 1}]),
    (
        {
            "$defs": {
                "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
            },
            "$ref": "#/$defs/node",
        },
        [{"kids": [{"kids": []}, {}]}],
        [{"kids": [1]}],
    ),
    ({"$defs": {"n": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}, [3], ["3"]),
    ({"properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}, [{"a": 1, "b": 2}], [{"b": "x"}]),
    ({"type": "object", "properties": {"a": False}}, [{"b": 1}], [{"a": 1}]),
    ({"type": "string", "format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"]),
    ({"type": "string", "format": "ipv4"}, ["10.0.0.1"], ["10.0.0.256"]),
    ({"type": "object", "minProperties": 1, "maxProperties": 2}, [{"a": 1}], [{}, {"a": 1, "b": 2, "c": 3}]),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"]}, [{"b": 1, "a": 2}], [{"a": 1}]),
    (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [[1, "a"], [1]],
        [[1, 2], [1, "a", 3]],
    ),
    ({"type": "array", "contains": {"type": "string"}, "minContains": 2}, [["a", 1, "b"]], [["a", 1]]),
    ({"anyOf": [{"enum": ["Go", "Rust"]}, {"type": "string"}]}, ["Go", "Zig", ""], [1, None]),  # extensible enum
    ({"anyOf": [{"enum": ["a", 2]}, {"type": "string"}]}, ["a", 2, "b"], [3, None]),  # 2 is no string: kept
    ({"oneOf": [{"enum": ["Go"]}, {"type": "string"}]}, ["Zig"], ["Go"]),  # exclusive: not absorbed
    ({"anyOf": [{"type": "integer", "minimum": 5}, {"type": "number"}, {"const": "x"}]}, [1, 2.5, 7, "x"], ["y"]),
]


@pytest.mark.parametrize("schema,valid,invalid", schema__valid__invalid)
def test_valid_accepted_and_invalid_rejected_or_flagged(schema, valid, invalid, smol_tokenizer):
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    for instance in valid:
        for text in (json.dumps(instance), json.dumps(instance, separators=(",", ":"))):
            assert accepts(compiled, smol_tokenizer, text), f"valid instance rejected: {text}"
            assert compiled.validate(text) == [], text
    for instance in invalid:
        text = json.dumps(instance)
        assert not accepts(compiled, smol_tokenizer, text) or compiled.validate(text), f"invalid accepted: {text}"


def test_coverage_reports_each_keyword(smol_tokenizer):
    schema = {
        "title": "T",
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True}, "n": {"type": "number", "multipleOf": 0.1}},
        "x-vendor": 1,
    }
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    status = {(e.pointer, e.keyword): e.status for e in compiled.coverage}
    assert status[("", "type")] == "enforced"
    assert status[("", "title")] == "ignored"
    assert status[("", "x-vendor")] == "ignored"
    assert status[("/properties/tags", "uniqueItems")] == "enforced"  # by the mask at value boundaries
    assert status[("/properties/n", "multipleOf")] == "enforced"
    notes = {(e.pointer, e.keyword): e.note for e in compiled.coverage}
    assert "value boundaries" in notes[("/properties/n", "multipleOf")]
    assert compiled.fully_enforced and compiled.value_checks is not None
    exact = constrain.compile(spec({"type": "integer"}), smol_tokenizer)
    assert exact.fully_enforced and exact.value_checks is None


def test_strict_refuses_what_cannot_be_checked_and_lenient_reports_it(smol_tokenizer):
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(constrain.UnsupportedSchemaError) as info:
        spec(schema)  # when the constraint is made, not only when it compiles
    assert info.value.keyword == "$ref" and info.value.pointer == "/properties/a"
    compiled = constrain.compile(spec(schema, lenient=True), smol_tokenizer)
    status = {(e.pointer, e.keyword): e.status for e in compiled.coverage}
    assert status[("/properties/a", "$ref")] == "approximated"
    assert accepts(compiled, smol_tokenizer, '{"a": 1}')
    with pytest.raises(constrain.UnsupportedSchemaError, match="dynamic"):
        constrain.compile(spec({"$dynamicRef": "#x"}), smol_tokenizer)
    with pytest.raises(UnsatisfiableSchemaError, match="admits no value"):  # lenient too: nothing to approximate
        constrain.compile(spec(False, lenient=True), smol_tokenizer)


def test_a_format_is_checked_refused_or_an_annotation_as_the_coverage_says(smol_tokenizer, monkeypatch):
    """A format the draft defines is checked; one no checker here runs is refused in strict mode and
    approximated when lenient; a name no draft defines is an annotation: never a silent "enforced"."""
    custom = constrain.compile(spec({"type": "string", "format": "int32", "maxLength": 9}), smol_tokenizer)
    entry = next(e for e in custom.coverage if e.keyword == "format")
    assert entry.status == "ignored" and "annotation" in entry.note
    assert custom.value_checks is None and accepts(custom, smol_tokenizer, '"abc"')
    monkeypatch.delitem(FORMATS.checkers, "idn-hostname")  # as where its library (idna) is missing
    schema = {"type": "object", "properties": {"host": {"type": "string", "format": "idn-hostname", "maxLength": 7}}}
    with pytest.raises(constrain.UnsupportedSchemaError, match="idn-hostname") as info:
        constrain.compile(spec(schema), smol_tokenizer)
    assert info.value.keyword == "format" and info.value.pointer == "/properties/host"
    lenient = constrain.compile(spec(schema, lenient=True), smol_tokenizer)
    status = {(e.pointer, e.keyword): e.status for e in lenient.coverage}
    assert status["/properties/host", "format"] == "approximated"


def test_a_lenient_remote_reference_is_true_in_the_value_checks(smol_tokenizer):
    """``oneOf`` is checked whole; its remote branch stands for ``true`` (approximated), so the check runs
    without an error and refuses what matches both branches."""
    schema = {"oneOf": [{"$ref": "https://example.com/a.json"}, {"type": "integer"}]}
    compiled = constrain.compile(spec(schema, lenient=True), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, '"a"') and not accepts(compiled, smol_tokenizer, "3")
    assert compiled.value_checks is not None and compiled.value_checks.errors == 0


def test_all_of_branches_referring_to_boolean_schemas(smol_tokenizer):
    """``allOf`` through a ``$ref`` to ``true`` adds nothing; to ``false`` nothing satisfies it (MaskBench's
    ffizer schema used to crash the preparation with an AttributeError)."""
    defs = {"yes": True, "no": False}
    schema = {"$defs": defs, "allOf": [{"$ref": "#/$defs/yes"}, {"type": "integer"}]}
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, "12") and not accepts(compiled, smol_tokenizer, '"a"')
    with pytest.raises(UnsatisfiableSchemaError, match="false") as info:
        constrain.compile(spec({"$defs": defs, "allOf": [{"$ref": "#/$defs/no"}]}), smol_tokenizer)
    assert info.value.pointer == "/allOf/0"


def test_dangling_ref_is_a_schema_error(smol_tokenizer):
    with pytest.raises(constrain.SchemaError) as info:
        constrain.compile(spec({"properties": {"a": {"$ref": "#/$defs/missing"}}}), smol_tokenizer)
    assert info.value.pointer == "/properties/a"


def test_whitespace_policies(smol_tokenizer):
    single = constrain.compile(spec({"type": "object"}), smol_tokenizer)
    pretty = constrain.compile(spec({"type": "object"}, whitespace="pretty"), smol_tokenizer)
    indented = json.dumps({"a": [1, {"b": None}]}, indent=2)
    assert accepts(single, smol_tokenizer, '{"a": [1, {"b": null}]}')
    assert accepts(single, smol_tokenizer, '{"a" : 1}')
    assert not accepts(single, smol_tokenizer, indented)
    assert accepts(pretty, smol_tokenizer, indented)
    assert not accepts(pretty, smol_tokenizer, "{" + " " * 17 + "}")  # bounded runs
    # compact in free-form values too (xgrammar 0.2.8 wrote ", " there; constrain rewrites it)
    for schema in ({"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer"}}}, {}):
        compact = constrain.compile(spec(schema, whitespace="compact"), smol_tokenizer)
        assert accepts(compact, smol_tokenizer, '{"a":[1,2,{"b":[3,4]}],"c":5}' if not schema else '{"a":[1,2]}')
        assert not accepts(compact, smol_tokenizer, '{"a": [1]}')


def test_schema_property_order_forces_keys(smol_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "required": ["a", "b"]}
    ordered = constrain.compile(spec(schema, property_order="schema"), smol_tokenizer)
    assert accepts(ordered, smol_tokenizer, '{"a": 1, "b": 2}')
    assert not accepts(ordered, smol_tokenizer, '{"b": 2, "a": 1}')


def test_validate_reports_pointer_and_json_errors(smol_tokenizer):
    compiled = constrain.compile(spec({"type": "array", "items": {"type": "integer"}}), smol_tokenizer)
    assert compiled.validate("[1, 2]") == []
    assert compiled.validate('[1, "x"]') == ["/1: 'x' is not of type 'integer'"]
    assert compiled.validate("[1, NaN]")[0].startswith("not valid JSON")
    assert compiled.validate("[1] [2]")[0].startswith("not valid JSON")
    regex = constrain.compile(constrain.regex(r"\d+"), smol_tokenizer)
    assert regex.validate("12") == [] and regex.validate("12a")
    choice = constrain.compile(constrain.choice(["yes", "no"]), smol_tokenizer)
    assert choice.validate("no") == [] and choice.validate("nope")
    grammar = constrain.compile(constrain.grammar("arithmetic"), smol_tokenizer)
    assert grammar.validate("1 + 2 * (3 - 4)") == [] and grammar.validate("1 +")


def test_closed_by_mode_and_open_where_a_model_allows_extras(smol_tokenizer):
    from pydantic import BaseModel, ConfigDict

    class Strict(BaseModel):
        a: int

    class Loose(BaseModel):
        model_config = ConfigDict(extra="allow")
        a: int

    extra = '{"a": 1, "b": 2}'
    assert constrain.json_schema(Strict).closed and not constrain.json_schema(Loose).closed
    assert not accepts(constrain.compile(constrain.json_schema(Strict), smol_tokenizer), smol_tokenizer, extra)
    assert accepts(constrain.compile(constrain.json_schema(Loose), smol_tokenizer), smol_tokenizer, extra)
    schema = Strict.model_json_schema()
    assert not accepts(constrain.compile(constrain.json_schema(schema), smol_tokenizer), smol_tokenizer, extra)
    assert accepts(constrain.compile(spec(schema), smol_tokenizer), smol_tokenizer, extra)
    closed = constrain.compile(spec(schema, closed=True), smol_tokenizer)
    assert not accepts(closed, smol_tokenizer, extra) and accepts(closed, smol_tokenizer, '{"a": 1}')


@pytest.mark.parametrize(
    "dependent",
    [
        {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}},
        {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": {"required": ["b"]}}},
        {"dependentSchemas": {"a": {"required": ["b"], "description": "b with a"}}},
        {"dependentRequired": {"a": ["b"]}},
    ],
)
def test_an_object_whose_keys_only_require_others_stays_closed(smol_tokenizer, dependent):
    """A ``dependentSchemas`` (or draft 7's ``dependencies``) that only requires declared keys says nothing of
    what else the object holds: generation mode closes it (it was left open: the model wrote keys of its
    own), and the budget finds the closing that writes the key required ("no valid output fits" before)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a"], **dependent}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(schema), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, '{"a": 1, "b": 2}')
    assert not accepts(compiled, smol_tokenizer, '{"a": 1, "b": 2, "c": 3}')
    assert not accepts(compiled, smol_tokenizer, '{"a": 1}')
    plan = Budget(compiled.matcher(), lambda text: smol_tokenizer.encode(text, add_special_tokens=False), 40).plan
    assert json.loads(smol_tokenizer.decode(plan)).keys() == {"a", "b"}
    adds = {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentSchemas": {"a": {"properties": {
        "c": {"type": "string"}}}}}  # fmt: skip
    assert accepts(constrain.compile(constrain.json_schema(adds), smol_tokenizer), smol_tokenizer, '{"a": 1, "x": 2}')


def test_subschemas_are_the_values_where_schemas_sit_in_the_nodes_own_order():
    from constrain.constraints.schema import prepare, subschemas

    a, b, c, d = {"type": "string"}, {"type": "integer"}, {"const": 1}, {"minimum": 2}
    node = {
        "description": "not a schema", "not": c, "properties": {"x": a, "y": b}, "anyOf": [c, d],
        "items": [a, b], "dependencies": {"x": ["y"]}, "oneOf": "malformed", "additionalProperties": False,
    }  # fmt: skip
    assert list(subschemas(node)) == [c, a, b, c, d, a, b, ["y"], False]
    assert list(subschemas({"type": "string", "title": "t"})) == []
    # a node of type and annotations alone is kept as its type, each keyword reported
    prepared, coverage = prepare(
        {"type": "object", "properties": {"x": {"type": "string", "title": "X"}}}, lenient=False
    )
    assert prepared["properties"]["x"] == {"type": "string"}
    assert {(e.pointer, e.keyword, e.status) for e in coverage if e.pointer == "/properties/x"} == {
        ("/properties/x", "type", "enforced"), ("/properties/x", "title", "ignored"),
    }  # fmt: skip


def test_coverage_is_a_sequence_of_entries_the_collector_stops_walking():
    """``compiled.coverage`` reads as a sequence of ``CoverageEntry``, and holds strings in tuples, which
    Python's cyclic collector stops walking (an object per entry was a quarter of what a process held for
    it to walk once MaskBench's sample was compiled)."""
    import gc

    from constrain.constraints.schema import Coverage, CoverageEntry, prepare

    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}, "title": "T"}
    _, coverage = prepare(schema, lenient=False)
    entries = list(coverage)
    assert isinstance(coverage, Coverage) and len(entries) == len(coverage) >= 3
    assert all(isinstance(e, CoverageEntry) for e in entries)
    assert coverage[0] == entries[0] and coverage[-1] == entries[-1] and list(coverage[1:]) == entries[1:]
    extra = CoverageEntry("/x", "not", "checked", "why")
    longer = coverage + (extra,)  # noqa: RUF005 - the operator under test
    assert list(longer) == [*entries, extra] and longer[-1].note == "why" and list(coverage) == entries
    assert longer == Coverage([*entries, extra]) and hash(longer) == hash(Coverage([*entries, extra]))
    gc.collect()
    gc.collect()
    assert not any(gc.is_tracked(held) for held in gc.get_referents(coverage) if not isinstance(held, type))


@pytest.mark.parametrize(
    "schema,prepared",
    [
        ({"anyOf": [{"enum": ["Go", "Rust"]}, {"type": "string", "description": "any other"}]}, {"type": "string"}),
        ({"type": "string", "anyOf": [{"const": "a"}, {"type": "string"}]}, {"type": "string"}),
        ({"anyOf": [{"type": "integer"}, {"type": ["number", "null"]}]}, {"type": ["number", "null"]}),
        ({"anyOf": [{"type": "object", "required": ["a"]}, {}]}, {}),
        ({"anyOf": [{"type": "string"}, {"type": "string"}]}, {"type": "string"}),
        ({"anyOf": [{"enum": ["a", 2]}, {"type": "string"}]}, {"anyOf": [{"enum": ["a", 2]}, {"type": "string"}]}),
        ({"anyOf": [{"const": 1.0}, {"type": "integer"}]}, {"anyOf": [{"const": 1.0}, {"type": "integer"}]}),
        (
            {"anyOf": [{"type": "string", "maxLength": 3}, {"enum": ["long one"]}]},
            {"anyOf": [{"type": "string", "maxLength": 3}, {"enum": ["long one"]}]},
        ),
        ({"oneOf": [{"enum": ["Go"]}, {"type": "string"}]}, {"anyOf": [{"enum": ["Go"]}, {"type": "string"}]}),
    ],
)
def test_a_branch_of_type_alone_absorbs_the_branches_it_admits_every_value_of(schema, prepared):
    """``anyOf`` branches whose values all have a type that another branch of ``type`` alone admits are that
    branch's already (the same language, fewer alternatives for the engine); a branch with other keywords
    absorbs nothing, and ``oneOf``'s branches stay (exclusive: the strings of an enum are not its values)."""
    from constrain.compiler.json_schema import prepared as prepare

    assert prepare(spec(schema))[0] == prepared


def test_alternatives_anchored_each_on_its_own_are_in_the_grammar(smol_tokenizer):
    """``^A$|^B$`` (a Snowplow user id: a UUID or 16 hex digits, with maxLength 36) goes into the grammar,
    each alternative padded on its own: the mask refuses the 17th hex digit, rather than let the string
    run to its length bound, where no value is left (a dead end that MaskBench's dev set met)."""
    user_id = "^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$|^[0-9a-f]{16}$"
    schema = {"type": "string", "maxLength": 36, "pattern": user_id}
    compiled = constrain.compile(spec(schema), smol_tokenizer)
    (pattern,) = [entry for entry in compiled.coverage if entry.keyword == "pattern"]
    assert pattern.status == "enforced" and pattern.note.startswith("search semantics")
    assert accepts(compiled, smol_tokenizer, '"1234567890abcdef"')
    assert accepts(compiled, smol_tokenizer, '"123e4567-e89b-12d3-a456-426614174000"')
    matcher = compiled.matcher()
    for token in token_ids(smol_tokenizer, '"1234567890abcdef1234567890abcdef1234"'):
        if not matcher.accept_token(token):
            break
    assert matcher.dead_ends == [] and not matcher.is_completed()
    assert not accepts(compiled, smol_tokenizer, '"1234567890abcdef1"')
