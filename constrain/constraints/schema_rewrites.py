"""Rewrites of prepared JSON Schema nodes for the grammar engine: pure functions on schema dicts.

Each one spells out, in keywords the engine reads exactly, what a node means: ``allOf`` branches merged
(:func:`merge_into`), ``anyOf`` distributed over the keywords beside it, composite literals as schemas,
a type's keywords bound to values of that type, ``pattern`` anchored as a search, integer bounds
rounded inward. Where a rewrite can only give a superset it says so (a ``False`` result or a note), and
:mod:`constrain.constraints.schema` records the keyword as ``checked``. Arguments named ``out`` or
``merged`` are changed in place; nothing else is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import interegular

from constrain.errors import UnsatisfiableSchemaError

__all__ = [
    "ANNOTATIONS",
    "absorb_branches",
    "combine",
    "declare_required",
    "disjoint_searches",
    "distribute_any_of",
    "literal_schema",
    "merge_into",
    "round_integer_bounds",
    "says_what_else",
    "search_pattern",
    "split_by_type",
]

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "$vocabulary",
        "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "contentSchema",
        "$anchor", "$dynamicAnchor", "discriminator", "nullable",
    }
)  # fmt: skip
"""Keywords that never change whether an instance is valid (``$anchor`` is resolved, not enforced):
:func:`merge_into` skips them, and preparation reports them ``ignored``."""

_SAYS_WHAT_ELSE = frozenset({
    "additionalProperties", "patternProperties", "unevaluatedProperties", "dependentSchemas", "dependencies",
    "if", "items", "unevaluatedItems",
})  # fmt: skip
"""Keywords by which a schema says what else an object or array may hold: closed mode leaves such a
node as the schema has it."""


def says_what_else(node: dict[str, Any]) -> bool:
    """Whether ``node`` or one of its inline ``allOf`` branches has a keyword of :data:`_SAYS_WHAT_ELSE`, but
    for a ``dependentSchemas`` or ``dependencies`` that only requires declared keys (:func:`_adds_keys`)."""
    branches: Any = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    for n in [node, *branches]:
        if not isinstance(n, dict):
            continue
        says = n.keys() & _SAYS_WHAT_ELSE
        declared: dict[str, Any] = n["properties"] if isinstance(n.get("properties"), dict) else {}
        if any(key not in _DEPENDENT or _adds_keys(n[key], declared) for key in says):
            return True
    return False


_DEPENDENT = ("dependentSchemas", "dependencies")
"""Keywords of :data:`_SAYS_WHAT_ELSE` that often only require keys (draft 7's ``dependencies`` lists are
2019-09's ``dependentRequired``): those say nothing of what else an object holds."""


def _adds_keys(value: Any, declared: dict[str, Any]) -> bool:
    """Whether a ``dependentSchemas`` or ``dependencies`` map may let its object hold a key that is not among
    the ``declared`` properties: some entry is more than a list of declared names, a boolean, or a schema
    of a ``required`` list of declared names (and annotations)."""
    if not isinstance(value, dict):
        return True
    for entry in value.values():
        names = entry if isinstance(entry, list) else entry.get("required", []) if isinstance(entry, dict) else []
        if isinstance(entry, dict) and not entry.keys() <= {"required"} | ANNOTATIONS:
            return True
        if not isinstance(entry, bool) and not (isinstance(names, list) and all(name in declared for name in names)):
            return True
    return False


def search_pattern(pattern: str) -> str | None:
    """JSON Schema ``pattern`` is a search: pad unanchored ends and anchor, so both engines read it alike.

    Where an alternative at the top level carries its own anchor, each is padded on its own (``^a|b$``
    is ``^(?:a.*|.*b)$``: a string that starts with ``a`` or ends with ``b``). None when the engine would
    misread it: an anchor inside an alternative (xgrammar ignores those).
    """
    branches = _top_level_branches(pattern)
    ends = [_anchors(branch) for branch in branches]
    if not any(start or end for start, end in ends):  # no anchor at a branch's edge: padded as a whole
        branches, ends = [pattern], [_anchors(pattern)]
    bodies = [branch[start : len(branch) - end] for branch, (start, end) in zip(branches, ends, strict=True)]
    if any(map(_has_anchor, bodies)):
        return None
    # anchored explicitly: xgrammar reads a pattern as a full match, llguidance as a search
    if len(bodies) == 1:
        (start, end), body = ends[0], bodies[0]
        return "^" + ("" if start else ".*") + f"(?:{body})" + ("" if end else ".*") + "$"
    pairs = zip(bodies, ends, strict=True)
    padded = [("" if start else ".*") + body + ("" if end else ".*") for body, (start, end) in pairs]
    return "^(?:" + "|".join(padded) + ")$"


def _anchors(pattern: str) -> tuple[int, int]:
    """Whether ``pattern`` starts with ``^`` and ends with an unescaped ``$`` (1 or 0 each)."""
    return int(pattern.startswith("^")), int(pattern.endswith("$") and not pattern.endswith("\\$"))


def _regex_characters(pattern: str) -> Iterator[tuple[int, str, int]]:
    """Per character of ``pattern`` outside classes that is no escape, nor escaped: its index, itself and the
    depth of groups around it (counting the group it opens or closes)."""
    depth, in_class, escaped = 0, False, False
    for at, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        else:
            depth += (ch == "(") - (ch == ")")
            yield at, ch, depth


def _top_level_branches(pattern: str) -> list[str]:
    """``pattern``'s alternatives at the top level (outside groups and classes), as written."""
    cuts = [at for at, ch, depth in _regex_characters(pattern) if ch == "|" and depth == 0]
    bounds = [-1, *cuts, len(pattern)]
    return [pattern[a + 1 : b] for a, b in itertools.pairwise(bounds)]


def _has_anchor(body: str) -> bool:
    """Whether ``body`` holds a ``^`` or ``$`` anchor outside classes and escapes."""
    return any(ch in "^$" for _, ch, _ in _regex_characters(body))


def disjoint_searches(searches: list[str]) -> bool:
    """Whether no string matches two of ``searches`` (:func:`search_pattern`'s anchored forms): llguidance
    refuses ``patternProperties`` whose regexes overlap. False where interegular cannot read one."""
    try:
        machines = [interegular.parse_pattern(search[1:-1]).to_fsm() for search in searches]  # the ^...$ dropped
        return all(a.intersection(b).empty() for a, b in itertools.combinations(machines, 2))  # type: ignore[no-untyped-call]
    except Exception:  # syntax interegular lacks: not shown disjoint
        return False


_FAMILIES = {
    "object": ("properties", "patternProperties", "required", "additionalProperties", "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
_ALL_TYPES = ("null", "boolean", "object", "array", "string", "number")


def split_by_type(out: dict[str, Any]) -> dict[str, Any]:
    """Without ``type``, a type's keywords bind only values of that type: spell that out for the engine.

    ``{"properties": ...}`` also accepts ``12``; xgrammar would assume an object.
    """
    if "type" in out or any(k in out for k in ("$ref", "anyOf", "enum", "const")):
        return out
    present = [family for family, keys in _FAMILIES.items() if any(k in out for k in keys)]
    if not present:
        return out
    rest = {k: v for k, v in out.items() if not any(k in keys for keys in _FAMILIES.values())}
    branches = [{"type": f, **{k: out[k] for k in _FAMILIES[f] if k in out}} for f in present]
    others = [t for t in _ALL_TYPES if t not in present]
    branches.append({"type": others})
    return {**rest, "anyOf": branches}


def literal_schema(value: Any) -> dict[str, Any]:
    """A schema that accepts exactly the JSON value ``value`` (objects in any key order)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: literal_schema(v) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list):
        return {
            "type": "array",
            "prefixItems": [literal_schema(v) for v in value],
            "items": False,
            "minItems": len(value),
        }
    return {"const": value}


def combine(target: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``target`` with ``rest`` merged in (:func:`merge_into`); neither argument changes."""
    merged = dict(target)
    merge_into(merged, rest)
    return merged


_COUNTS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})
_TAKE_MAX = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_TAKE_MIN = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


def merge_into(merged: dict[str, Any], branch: dict[str, Any]) -> bool:
    """Intersect ``branch`` into ``merged``; return False where the result had to be a superset.

    Raises ``UnsatisfiableSchemaError`` (its pointer empty: the caller knows where) when the two share no
    value: their types never meet, or their enums share no value."""
    exact = True
    for key, value in branch.items():
        if key in ANNOTATIONS:
            continue
        if key not in merged:
            merged[key] = value
        elif merged[key] == value:
            continue
        elif key in _TAKE_MAX:
            merged[key] = max(merged[key], value)
        elif key in _TAKE_MIN:
            merged[key] = min(merged[key], value)
        elif key == "required":
            merged[key] = list(dict.fromkeys([*merged[key], *value]))
        elif key == "properties" and isinstance(value, dict):
            props = dict(merged[key])
            for name, sub in value.items():
                if name in props and props[name] != sub:
                    if props[name] is False or sub is False:
                        props[name] = False
                    elif (
                        isinstance(props[name], dict)
                        and isinstance(sub, dict)
                        and "$ref" not in props[name]
                        and "$ref" not in sub
                    ):
                        combined = dict(props[name])
                        try:
                            exact &= merge_into(combined, sub)
                            props[name] = combined
                        except UnsatisfiableSchemaError:
                            props[name] = False  # no value of the key satisfies both: the key must be absent
                    else:
                        exact = False  # keep the first: a superset of the intersection
                else:
                    props[name] = sub
            merged[key] = props
        elif key == "type":
            a = {merged[key]} if isinstance(merged[key], str) else set(merged[key])
            b = {value} if isinstance(value, str) else set(value)
            if "number" in a and "integer" in b:
                a.add("integer")
            if "number" in b and "integer" in a:
                b.add("integer")
            common = sorted(a & b)
            if not common:
                raise UnsatisfiableSchemaError(f"types {sorted(a)} and {sorted(b)} never meet")
            merged[key] = common[0] if len(common) == 1 else common
        elif key == "enum":
            common_values = [v for v in merged[key] if v in value]
            if not common_values:
                raise UnsatisfiableSchemaError("enums share no value")
            merged[key] = common_values
        elif key == "additionalProperties":
            exact = False  # its meaning depends on the branch's own properties: drop it (superset)
            merged.pop(key)
        else:
            exact = False  # two different values of a keyword we do not intersect: keep the first
    return exact


def absorb_branches(branches: list[Any]) -> list[Any]:
    """Prepared ``anyOf`` branches without those that another admits every value of: a branch of ``type``
    alone (or of no keyword: any value) stands for each branch whose values all have one of its types (by
    that branch's ``type``, else its ``enum`` or ``const`` values). The union is the same language; the
    engines read it in fewer alternatives. An extensible enum, ``anyOf: [{enum: [...]}, {type: string}]``,
    becomes a string: llguidance took 320 to 740 µs a mask inside such a string, where it follows every
    alternative, against 1 to 20 for the string alone (SmolLM2's tokenizer, Intel Xeon family 6 model 167).
    Returns ``branches`` itself where none is absorbed."""
    broad = [_types_alone(b) for b in branches]  # per branch: the types it admits every value of, or None
    kept = [
        branch
        for index, branch in enumerate(branches)
        if not any(
            other is not None
            and (other is _ANY or _within(_value_types(branch), other))
            and (broad[index] != other or index > at)  # of equal branches, the first stays
            for at, other in enumerate(broad)
            if at != index
        )
    ]
    return branches if len(kept) == len(branches) else kept


_ANY = frozenset({"null", "boolean", "object", "array", "string", "number", "integer"})
"""What :func:`_types_alone` says of a branch with no keyword: any value."""


def _types_alone(branch: Any) -> frozenset[str] | None:
    """The JSON types a prepared branch of ``type`` alone admits every value of (:data:`_ANY` for a branch of
    no keyword); None for any other branch."""
    if not isinstance(branch, dict) or not branch.keys() <= {"type"}:
        return None
    if not branch:
        return _ANY
    types = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
    return frozenset(types) | ({"integer"} if "number" in types else set())


def _value_types(branch: Any) -> frozenset[str] | None:
    """The JSON types a prepared branch's values may have (by ``type``, else ``enum`` or ``const``); None where
    its keywords do not say."""
    if not isinstance(branch, dict):
        return None
    if "type" in branch:
        types = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
        return frozenset(t for t in types if isinstance(t, str))
    if isinstance(branch.get("enum"), list):
        return frozenset(map(_json_type, branch["enum"]))
    return frozenset({_json_type(branch["const"])}) if "const" in branch else None


def _json_type(value: Any) -> str:
    """The JSON Schema type of a JSON value, ``"integer"`` for ints only: ``1.0`` is a number here (draft 4
    reads it so, and the grammar of an integer does not write it)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) else "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"


def _within(types: frozenset[str] | None, broad: frozenset[str]) -> bool:
    """Whether every type of ``types`` is one of ``broad`` (an integer is a number too)."""
    return types is not None and all(t in broad for t in types)


def distribute_any_of(out: dict[str, Any], pointer: str, notes: list[str]) -> dict[str, Any]:
    """``{S, anyOf: [A, B]}`` means ``anyOf: [S and A, S and B]``: spell it out for the engine.

    Returns the rewritten node (``out`` itself when there is nothing to distribute); appends to ``notes``
    why the result is only a superset, if it is. Raises ``UnsatisfiableSchemaError`` when no branch is
    compatible with the keywords beside it.
    """
    branches = out.get("anyOf")
    siblings = {k: v for k, v in out.items() if k not in ("anyOf", "$defs", "definitions")}
    if not branches or not siblings:
        return out
    if "$ref" in siblings or any("$ref" in b for b in branches):
        notes.append("beside other keywords and references: validated afterwards")
        return out
    merged, exact = [], True
    for branch in branches:
        both = dict(siblings)
        try:
            exact &= merge_into(both, branch)
            if "anyOf" in both and "anyOf" not in siblings:  # the branch is a union itself: distribute again
                nested = distribute_any_of(both, pointer, notes)
                if set(nested) <= {"anyOf", "$defs", "definitions"}:
                    merged += nested["anyOf"]
                    continue
                both = nested
        except UnsatisfiableSchemaError:
            continue  # this branch contradicts its siblings: no value takes it
        merged.append(both)
    if not merged:
        raise UnsatisfiableSchemaError(
            "no branch of anyOf is compatible with the keywords beside it", f"{pointer}/anyOf"
        )
    if not exact:
        notes.append("merged with the keywords beside it into a superset")
    return {**{k: v for k, v in out.items() if k in ("$defs", "definitions")}, "anyOf": merged}


def declare_required(node: dict[str, Any], out: dict[str, Any]) -> None:
    """A required key that ``properties`` does not describe becomes a property with the value schema of
    other keys (xgrammar enforces only described required keys; closing must not make them impossible).
    Only beside ``properties``: a branch that lists required keys alone is described by its siblings.
    ``node`` is the schema as written, ``out`` its prepared form (changed in place)."""
    extra = out.get("additionalProperties", {})
    typed = "properties" in out or out.get("type") == "object"
    if not typed or extra is False or not isinstance(out.get("required"), list):
        return
    described: Any = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in out["required"]:
        if isinstance(name, str) and name not in described:
            out.setdefault("properties", {}).setdefault(name, extra)


def round_integer_bounds(out: dict[str, Any]) -> None:
    """The engine wants whole numbers: counts written ``2.0`` become ``2``; integer bounds round inward
    (``minimum: 1.5`` of an integer becomes ``minimum: 2``). Changes ``out`` in place."""
    for key in out.keys() & _COUNTS:
        if isinstance(out[key], float) and out[key].is_integer():
            out[key] = int(out[key])
    if out.get("type") != "integer":
        return
    for key, up in (("minimum", True), ("exclusiveMinimum", True), ("maximum", False), ("exclusiveMaximum", False)):
        value = out.get(key)
        if isinstance(value, float) and not value.is_integer():
            out.pop(key)
            rounded = math.ceil(value) if up else math.floor(value)
            out["minimum" if up else "maximum"] = rounded
        elif isinstance(value, float):
            out[key] = int(value)
