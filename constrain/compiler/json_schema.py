"""What each engine is given for a JSON schema: the prepared schema, xgrammar's EBNF, llguidance's schema,
and the value checks for the keywords beyond the grammar, with the coverage that says so.

All pure and memoized per constraint (bounded, see :mod:`constrain.caches`). A JSON schema is compiled in
these passes, in this order:

1. :func:`constrain.json_schema` checks the schema against its draft's metaschema.
2. :func:`prepared` (:func:`constrain.constraints.schema.prepare`) rewrites it for the engines in one walk,
   and says per keyword whether the grammar enforces it (the coverage). Per node, innermost first, five
   steps in order (listed in :mod:`constrain.constraints.schema`): references, ``allOf`` merged, each
   keyword, the proof that the node admits no value, the result rewritten for the engines.
3. :func:`~constrain.compiler.routing.auto_engine` picks the engine, from the prepared schema and
   :func:`json_schema_ebnf`.
4. The engine's input: :func:`json_schema_ebnf` (xgrammar; objects with keys in any order rewritten to
   follow their keys, :func:`~constrain.backends.xgrammar.keys_in_any_order`) or :func:`llguidance_schema`,
   each adding to the coverage what that engine leaves looser.
5. The engine compiles it (:mod:`constrain.backends`).
6. :func:`value_checks`: the subschemas under which a keyword is beyond the grammar, checked per value
   while decoding (:class:`~constrain.match.checks.ValueChecks`); their coverage becomes ``enforced``.
   :func:`unique_keys` says whether matchers must mask out a repeated key.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import regex

from constrain.backends import xgrammar
from constrain.backends.llguidance import UNKNOWN_FORMATS
from constrain.caches import bounded
from constrain.constraints.constraint import MAX_WHITESPACE, SEPARATORS, EmbeddedJson, JsonSchema
from constrain.constraints.schema import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SINGLE_SCHEMAS,
    SUBSCHEMA_KEYS,
    Coverage,
    CoverageEntry,
    prepared_schema,
    subschemas,
)
from constrain.constraints.schema_rewrites import says_what_else
from constrain.errors import CompileError, UnsatisfiableSchemaError
from constrain.match.checks import CallChecks, ValueChecks
from constrain.match.keys import may_repeat_keys
from constrain.match.validate import schema_validator

__all__ = [
    "AT_BOUNDARIES",
    "embedded_checks",
    "json_schema_ebnf",
    "llguidance_schema",
    "prepared",
    "unique_keys",
    "value_checks",
]

AT_BOUNDARIES = "enforced by the mask at value boundaries (a dead end, where no valid value is left, is reported)"
"""The coverage note of a keyword beyond the grammar that :mod:`constrain.match.values` enforces."""

_OPEN_KEYS_NOTE = (
    "extra keys of open objects are any string (a declared key may take that path with another value); "
    "values are validated afterwards"
)
_ANY_ORDER_REQUIRED_NOTE = (
    "with properties in any order, the grammar can skip a required key beside optional or extra keys; "
    "validated afterwards"
)
_LENGTH_NOTE = (
    "llguidance serves this schema, whose masks take hundreds of microseconds inside a string of bounded "
    "length: checked as each string is written instead (exact in the mask)"
)
_SCHEMA_WIDE = {"properties": _OPEN_KEYS_NOTE, "required": _ANY_ORDER_REQUIRED_NOTE, "maxLength": _LENGTH_NOTE}
"""Schema-wide looseness: the keyword checked wherever it appears, when coverage has the note."""


def prepared(constraint: JsonSchema) -> tuple[Any, Coverage]:
    """The schema rewritten for the engines, and its coverage (both engines start from it; do not mutate):
    memoized (:func:`~constrain.constraints.schema.prepared_schema`)."""
    return prepared_schema(constraint.schema, constraint.lenient, constraint.closed)


@bounded("compile.json_schema_ebnf", maxsize=64)
def json_schema_ebnf(constraint: JsonSchema) -> tuple[str, Coverage, frozenset[frozenset[str]]]:
    """xgrammar's EBNF for a JSON schema constraint, its coverage, and the objects (their declared keys)
    whose every key that grammar writes at most once (:func:`~constrain.backends.xgrammar.keys_in_any_order`:
    no key guard needed there). Pure, memoized."""
    engine_schema, coverage = prepared(constraint)
    ebnf = xgrammar.json_schema_ebnf(
        json.dumps(engine_schema, ensure_ascii=False),
        separators=SEPARATORS.get(constraint.whitespace),
        max_whitespace=MAX_WHITESPACE[constraint.whitespace],
        any_order=constraint.property_order == "any",
    )
    opened = None if constraint.closed else xgrammar.open_extra_keys(ebnf)  # closed: extra keys declared, kept exact
    exact, tracked = False, frozenset[frozenset[str]]()
    if constraint.property_order == "any" and opened is None:  # (opened: a key could be written as an extra one)
        ebnf, exact, tracked = xgrammar.keys_in_any_order(ebnf, _required_by_keys(engine_schema))
    if constraint.property_order == "any" and not exact and '"required"' in json.dumps(engine_schema):
        coverage += (CoverageEntry("", "required", "checked", _ANY_ORDER_REQUIRED_NOTE),)
    if opened is not None:
        ebnf = opened
        coverage += (CoverageEntry("", "additionalProperties", "checked", _OPEN_KEYS_NOTE),)
    if '"$ref"' in json.dumps(engine_schema):  # only a reference left in can make the grammar loop
        _refuse_endless(ebnf)
    return ebnf, coverage, tracked


def _refuse_endless(ebnf: str) -> None:
    """Refuse a schema whose values (or some branch's) all hold another value of the same subschema: no
    such value is finite, and the engines would decode into it without end (xgrammar's jump-forward runs
    out of memory there; llguidance stops at its own limit, failing the request)."""
    endless = xgrammar.never_ending_rules(ebnf)
    why = "each value holds another of the same schema, through a required property or item"
    if "root" in endless:
        raise UnsatisfiableSchemaError(f"no value is finite: {why}")
    if endless:
        rules = ", ".join(map(repr, endless[:3]))
        raise CompileError(
            f"a subschema admits no finite value ({why}; the grammar's rules {rules}), and decoding could enter "
            "it without end: make that reference optional, or remove the branch"
        )


def _required_by_keys(schema: Any) -> dict[frozenset[str], frozenset[str] | None]:
    """Per set of declared keys of the objects in ``schema``, the keys they require (None where two objects
    with those declared keys require different ones): how
    :func:`~constrain.backends.xgrammar.keys_in_any_order` tells xgrammar's objects apart."""
    found: dict[frozenset[str], frozenset[str] | None] = {}

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        declared, required = node.get("properties"), node.get("required")
        if isinstance(declared, dict) or isinstance(required, list):
            keys = frozenset(declared if isinstance(declared, dict) else ())
            needed = (
                frozenset(key for key in required if isinstance(key, str))
                if isinstance(required, list)
                else frozenset()
            )
            found[keys] = needed if found.get(keys, needed) == needed else None
        for sub in subschemas(node):
            walk(sub)

    walk(schema)
    return found


def llguidance_schema(schema: Any, *, any_order: bool, checked: bool = False) -> tuple[Any, tuple[CoverageEntry, ...]]:
    """The prepared ``schema`` as llguidance is given it, and coverage entries saying what changed.

    Dropped (the grammar then accepts a superset; ``validate`` checks the finished output):
    formats in :data:`~constrain.backends.llguidance.UNKNOWN_FORMATS`, and
    ``minProperties``/``maxProperties`` of objects with optional keys.

    A ``maxLength`` of at most :data:`SLOW_LENGTH` is dropped too where the value checks run on the
    schema anyway (``checked``: the coverage has keywords beyond the grammar, or this function leaves
    some), and checked as each string is written (:mod:`constrain.match.lengths`: exact in the mask).
    Where nothing else is checked it stays with llguidance: the value checks would read every token of
    the output for it. (Where that is known only once the schema is walked, it is walked again: the
    keys of an object in any order are grouped by their subschemas as given.)

    ``any_order``: llguidance writes ``properties`` in the schema's order only, but the keys of
    ``patternProperties`` in any order. An object's declared keys (two or more, none of them matched by a
    pattern of its own: such a key must satisfy both schemas) are given as patterns matching exactly those
    names (escaped by ``re.escape``, which llguidance reads alike), one per distinct subschema (at most
    :data:`MAX_KEY_PATTERNS`, else the object keeps the schema's order), beside its own patterns, and its
    ``required`` goes to the value checks, as on xgrammar with properties in any order.

    Returns ``schema`` itself when nothing changes; never mutates it.
    """
    dropped: dict[str, set[str]] = {}
    reordered: list[bool] = []  # per object given in any order: whether it had ``required``
    lengths: list[bool] = []  # per string bound at most SLOW_LENGTH: whether it was dropped

    def walk(node: Any, drop: bool) -> Any:
        if not isinstance(node, dict) or node.keys().isdisjoint(_ADAPTED):
            return node
        out = dict(node)
        limit = out.get("maxLength")
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit <= SLOW_LENGTH:
            lengths.append(drop)
            if drop:
                del out["maxLength"]
        if out.get("format") in UNKNOWN_FORMATS:
            dropped.setdefault("format", set()).add(out.pop("format"))
        if not set(out.get("properties", ())) <= set(out.get("required", ())):
            for key in ("minProperties", "maxProperties"):
                if out.pop(key, None) is not None:
                    dropped.setdefault(key, set()).add("beside optional keys")
        for key in SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: walk(sub, drop) for name, sub in out[key].items()}
        for key in SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [walk(sub, drop) for sub in out[key]]
        for key in SINGLE_SCHEMAS:
            if key in out:
                out[key] = walk(out[key], drop)
        declared, own = out.get("properties"), out.get("patternProperties", {})
        if any_order and isinstance(declared, dict) and len(declared) > 1 and isinstance(own, dict):
            patterns = _key_patterns(declared, own)
            if patterns is not None:
                out["patternProperties"] = {**own, **patterns}
                del out["properties"]
                reordered.append(out.pop("required", None) is not None)
        return out

    adapted = walk(schema, checked)
    if lengths and not checked and (dropped or any(reordered)):  # the checks run after all: walked again
        dropped.clear()
        reordered.clear()
        lengths.clear()
        adapted = walk(schema, True)
    if not dropped and not reordered and not any(lengths):
        return schema, ()
    note = "llguidance serves this schema and refuses {} ({}): validated afterwards"
    entries = tuple(
        CoverageEntry("", key, "checked", note.format(key, ", ".join(sorted(what))))
        for key, what in sorted(dropped.items())
    )
    if any(reordered):
        entries += (CoverageEntry("", "required", "checked", _ANY_ORDER_REQUIRED_NOTE),)
    if any(lengths):
        entries += (CoverageEntry("", "maxLength", "checked", _LENGTH_NOTE),)
    return adapted, entries


_ADAPTED = SUBSCHEMA_KEYS | {"format", "minProperties", "maxProperties", "maxLength"}
"""The keywords :func:`llguidance_schema` reads: a node without any is given as it is."""

SLOW_LENGTH = 100
"""The largest ``maxLength`` that :func:`llguidance_schema` leaves to the value checks. Inside a string of
bounded length llguidance 1.9's mask took 250 to 850 µs a token (``maxLength: 30``) against 2 µs without a
bound; over a small object's tokens, its mean was 100, 76 and 53 µs at bounds of 30, 64 and 100, and 17
µs from 128 up, where the checks' 30 to 47 µs would cost more (SmolLM2's tokenizer, whose longest token
is 81 characters; Intel Xeon family 6 model 207, 2 cores)."""

MAX_KEY_PATTERNS = 32
"""Most patterns an object's declared keys become for llguidance (:func:`llguidance_schema`): it proves
every two of an object's patterns disjoint, so its compile grows with their square (16 patterns: about
2 ms; 32: 6 ms; 50: 33 ms; 200: 1.1 s, with SmolLM2's tokenizer; Intel Xeon family 6 model 207). Keys
whose schemas are the same share one: the objects of the MaskBench dev sample have up to 29 distinct."""


def _key_patterns(declared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any] | None:
    """``patternProperties`` that take exactly the ``declared`` properties, one pattern per distinct
    subschema (told apart by ``repr``: subschemas written alike, keys in the same order; 2.5 times as fast
    as a sorted ``json.dumps`` over a large schema's 1,614 properties); None past :data:`MAX_KEY_PATTERNS`,
    or where one of the object's ``own`` patterns (searches) may match a declared name."""
    try:
        if any(regex.search(pattern, name) for pattern in own for name in declared):
            return None
    except regex.error:  # a pattern Python's regex cannot read: not shown apart
        return None
    groups: dict[str, tuple[list[str], Any]] = {}
    for name, sub in declared.items():
        groups.setdefault(repr(sub), ([], sub))[0].append(name)
    if len(groups) > MAX_KEY_PATTERNS:
        return None
    return {f"^({'|'.join(map(re.escape, names))})$": sub for names, sub in groups.values()}


def unique_keys(constraint: JsonSchema, engine_schema: Any, tracked: frozenset[frozenset[str]] = frozenset()) -> bool:
    """Whether the grammar of ``engine_schema`` may admit a key twice (matchers then mask that out); not in
    the objects ``tracked`` (their declared keys: :func:`json_schema_ebnf`'s third value, on xgrammar)."""
    return may_repeat_keys(engine_schema, any_order=constraint.property_order == "any", tracked=tracked)


def value_checks(
    constraint: JsonSchema, coverage: Coverage, tracked: frozenset[frozenset[str]] = frozenset()
) -> tuple[ValueChecks | None, Coverage]:
    """The value checks of a schema whose grammar is not exact somewhere (None where it is exact), and
    the coverage with what they enforce marked so.

    Where keys come in any order and some object takes a known set of keys, they are made even where
    the grammar is exact, checking nothing: their scanner follows the schema's locations for the key
    guard, which refuses a key that can no longer become one its object lacks (see
    :mod:`constrain.match.keys`); not for the objects whose grammar writes each key once, with a ``,``
    only where one is left (``tracked``: their declared keys, :func:`json_schema_ebnf`'s third value)."""
    validator = schema_validator(constraint.schema, approximate_remote=True)  # strict: refused at compile
    notes = {e.note for e in coverage if e.pointer == ""}
    everywhere = [key for key, note in _SCHEMA_WIDE.items() if note in notes]
    checks = ValueChecks(validator.schema, validator, coverage, everywhere, closed=constraint.closed)
    if not checks.needs(checks.root_location):
        guides = constraint.property_order == "any" and _takes_known_keys(validator.schema, constraint.closed, tracked)
        return (checks if guides else None), coverage
    checks.warm()
    enforced = Coverage(
        replace(e, status="enforced", note=f"{AT_BOUNDARIES} ({e.note})" if e.note else AT_BOUNDARIES)
        if e.status == "checked"
        else e
        for e in coverage
    )
    return checks, enforced


def _takes_known_keys(schema: Any, closed: bool, tracked: frozenset[frozenset[str]] = frozenset()) -> bool:
    """Whether some object of ``schema`` takes a known set of keys (``ValueChecks.key_names``): it has
    ``additionalProperties: false``, or (``closed`` mode) declares properties and says nothing of others;
    but where the grammar writes each of its keys once (its declared keys ``tracked``)."""
    if not isinstance(schema, dict):
        return False
    declared = schema.get("properties")
    if (
        isinstance(declared, dict)
        and (schema.get("additionalProperties") is False or (closed and not says_what_else(schema)))
        and frozenset(declared) not in tracked
    ):
        return True
    return any(_takes_known_keys(sub, closed, tracked) for sub in subschemas(schema))


def embedded_checks(embedded: EmbeddedJson | None) -> CallChecks | None:
    """The checks of a grammar's embedded JSON values (tool arguments), or None where every one of their
    grammars is exact (the others are followed only to see where they end)."""
    if embedded is None:
        return None
    found = {name: value_checks(schema, *json_schema_ebnf(schema)[1:])[0] for name, schema in embedded.schemas}
    if all(checks is None for checks in found.values()):
        return None
    plain = ValueChecks({}, schema_validator("{}"), ())
    return CallChecks(embedded, {name: checks or plain for name, checks in found.items()})
