"""Proofs that a JSON Schema node admits no value, for :mod:`constrain.constraints.schema` to refuse the
schema (:class:`~constrain.errors.UnsatisfiableSchemaError`) rather than let a request search in vain.

:func:`contradiction` looks at one node, its ``allOf`` branches already merged in, and at what the walk
proved of its subschemas (``dead``: those that admit no value). It finds, where the node allows them:

- per type: bounds that leave no number (or integer, or multiple of an integer ``multipleOf``), string,
  array or object (``minLength`` above ``maxLength``, more required keys than ``maxProperties``, a
  required key whose subschema admits no value, or that ``additionalProperties`` forbids, an array that
  needs an item ``items`` forbids...). A node without ``type`` allows every type, so bounds alone never
  make it empty (``{"minimum": 5, "maximum": 1}`` still takes every string);
- ``const``/``enum``: no listed value of an allowed type within the node's bounds, or none at all;
- ``oneOf``: two or more branches that every value of the node matches (:func:`implies`: a branch of
  ``required`` keys the node requires too, a ``type`` that covers the node's, an empty branch...);
- ``not``: a schema that every value of the node matches.

Only proofs: a keyword is read only where the draft the output is validated under (the schema's
``$schema``, :func:`draft_of`) reads it the same way, and anything not understood means "maybe
satisfiable". A schema some value satisfies is never refused; an empty one may go undetected (a
``pattern`` no string of the allowed lengths matches, a ``$ref`` to an empty definition...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import jsonschema

from constrain.constraints.schema_refs import pointer_token, resolve_local
from constrain.constraints.schema_rewrites import ANNOTATIONS
from constrain.errors import UnsatisfiableSchemaError

__all__ = ["contradiction", "draft_of", "implies", "json_kind", "vocabulary"]

_KINDS = ("null", "boolean", "object", "array", "string", "number")
"""JSON's value kinds (``integer`` is a ``number`` with no fraction)."""

_FAMILY = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("minLength", "maxLength"), "string"),
    **dict.fromkeys(("minItems", "maxItems"), "array"),
    **dict.fromkeys(("minProperties", "maxProperties", "required", "properties"), "object"),
}
"""The keywords :func:`implies` reads that bind values of one kind only (others pass them)."""

_BASE = frozenset(
    {
        "type", "enum", "minimum", "maximum", "multipleOf", "minLength", "maxLength", "minItems", "maxItems",
        "minProperties", "maxProperties", "required", "properties", "additionalProperties", "patternProperties",
        "items", "allOf", "anyOf", "oneOf", "not", "$ref",
    }
)  # fmt: skip
_DRAFT6 = _BASE | {"exclusiveMinimum", "exclusiveMaximum", "const", "contains", "propertyNames"}
_DRAFT2019 = _DRAFT6 | {"minContains", "maxContains"}
_VOCABULARY = {
    3: frozenset[str](),
    4: _BASE,
    6: _DRAFT6,
    7: _DRAFT6,
    2019: _DRAFT2019,
    2020: _DRAFT2019 | {"prefixItems"},
}
"""Per draft, the keywords the proofs read (draft 4's ``exclusiveMinimum`` is a boolean modifier, and
draft 3 is too unlike the others to read at all)."""

_DRAFTS: dict[Any, int] = {
    jsonschema.Draft3Validator: 3, jsonschema.Draft4Validator: 4, jsonschema.Draft6Validator: 6,
    jsonschema.Draft7Validator: 7, jsonschema.Draft201909Validator: 2019, jsonschema.Draft202012Validator: 2020,
}  # fmt: skip

MAX_DEPTH = 8
"""How many references and nested subschemas deep :func:`implies` follows before it gives up (answers False)."""

MAX_STEPS = 1_000
"""How many subschemas one :func:`implies` question visits at most (through references, ``allOf`` and
``anyOf`` branches, properties) before it gives up (answers False): branching references cannot make
it search long."""


def draft_of(root: Any) -> int:
    """The draft (3, 4, 6, 7, 2019 or 2020) the output of ``root`` is validated under: its ``$schema``'s,
    2020-12 when it names none or one ``jsonschema`` does not know (as :mod:`constrain.match.validate`)."""
    found = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return _DRAFTS.get(found, 2020)


def vocabulary(draft: int) -> frozenset[str]:
    """The keywords the proofs read under ``draft`` (:func:`draft_of`); the others are never relied on."""
    return _VOCABULARY.get(draft, _VOCABULARY[2020])


_TOGETHER = ("contains", "minContains", "maxContains")
"""Keywords read together, only as one schema object holds them: an ``allOf`` branch's ``maxContains``
means nothing beside another branch's ``contains`` (a merge may have put them side by side)."""


_INERT = ANNOTATIONS | {"type", "properties", "items", "additionalProperties", "$ref", "$defs", "definitions"}
"""Keywords that rule out no value beside one another, where none of their subschemas was proven to admit
none (the most common nodes of large schemas: ``{"type": "string", "description": ...}``)."""


def contradiction(
    node: dict[str, Any],
    pointer: str,
    dead: Mapping[str, UnsatisfiableSchemaError],
    root: Any,
    draft: int,
    written: dict[str, Any] | None = None,
) -> UnsatisfiableSchemaError | None:
    """Why ``node`` (at ``pointer``) admits no value, or None where that is not proven.

    ``node`` may be the node with its ``allOf`` branches merged in (a superset of it, as
    :func:`~constrain.constraints.schema_rewrites.merge_into` merges), ``written`` (default: ``node``)
    the node as the schema has it, whose :data:`_TOGETHER` keywords are read instead of ``node``'s.
    ``dead``: the subschemas of ``node`` proven to admit no value, by JSON pointer (``pointer`` +
    ``/properties/a``, ``/items``, ``/prefixItems/0``, ``/additionalProperties``), each with its own proof;
    ``root`` resolves the local references of ``oneOf`` and ``not`` branches (None: they are not
    followed, as where an ``$id`` inside the schema moves their base); ``draft`` is
    :func:`draft_of` the root. Returns the refusal unraised. Changes nothing.
    """
    known = vocabulary(draft)
    if not known or (not dead and node.keys() <= _INERT):
        return None
    if written is not None and written is not node:
        node = {k: v for k, v in node.items() if k not in _TOGETHER} | {
            k: written[k] for k in _TOGETHER if k in written
        }
    kinds, integral = _kinds(node)
    found = _literal(node, pointer, known, kinds, integral)
    if found is not None:
        return found
    killed = {
        kind: why
        for kind in sorted(kinds)
        if (why := _KIND_CHECKS[kind](node, pointer, dead, known, integral)) is not None
    }
    if kinds and len(killed) == len(kinds):
        if len(killed) == 1:
            return next(iter(killed.values()))
        every = "; ".join(f"{kind}: {why.reason} (at '{why.pointer or '/'}')" for kind, why in killed.items())
        return UnsatisfiableSchemaError(f"no type it allows has a value ({every})", f"{pointer}/type")
    if "oneOf" in known and isinstance(node.get("oneOf"), list):
        parent = {k: v for k, v in node.items() if k != "oneOf"}
        hits = [i for i, branch in enumerate(node["oneOf"]) if implies(parent, branch, root, draft)]
        if len(hits) >= 2:
            branches = ", ".join(map(str, hits[:-1])) + f" and {hits[-1]}"
            return UnsatisfiableSchemaError(
                f"{_every(parent)} matches branches {branches}, and oneOf takes only values that match exactly one",
                f"{pointer}/oneOf",
            )
    if "not" in known and "not" in node:
        parent = {k: v for k, v in node.items() if k != "not"}
        if node["not"] is True or node["not"] == {}:
            return UnsatisfiableSchemaError("the schema under `not` takes every value", f"{pointer}/not")
        if implies(parent, node["not"], root, draft):
            return UnsatisfiableSchemaError(f"{_every(parent)} matches the schema under `not`", f"{pointer}/not")
    return None


def implies(parent: dict[str, Any], branch: Any, root: Any, draft: int) -> bool:
    """Whether every value that satisfies ``parent`` satisfies ``branch`` too, as far as is proven (False
    where in doubt). Reads ``parent``'s ``type``, ``required``, ``properties``, ``const``/``enum`` and
    bounds; ``branch`` may hold those, annotations, local ``$ref``s (resolved in ``root``; None: not
    followed), ``allOf`` and ``anyOf``; any other keyword in ``branch`` answers False. At most
    :data:`MAX_DEPTH` deep and :data:`MAX_STEPS` subschemas."""
    return _implies(parent, branch, root, draft, 0, [MAX_STEPS])


def _implies(parent: dict[str, Any], branch: Any, root: Any, draft: int, depth: int, left: list[int]) -> bool:
    """:func:`implies`, ``depth`` subschemas down, with ``left[0]`` subschemas left to visit (counted down)."""
    left[0] -= 1
    if branch is True:
        return True
    if not isinstance(branch, dict) or depth > MAX_DEPTH or left[0] < 0 or "$id" in branch:  # $id moves "#/..."
        return False
    known = vocabulary(draft)
    if "$ref" in branch and draft < 2019:  # before 2019-09, keywords beside $ref are ignored
        return _implies_ref(parent, branch["$ref"], root, draft, depth, left)
    kinds, integral = _kinds(parent)
    for key, value in branch.items():
        if key in ANNOTATIONS or key in ("$defs", "definitions"):
            continue
        if key not in known:
            return False
        family = _FAMILY.get(key)
        if family is not None and family not in kinds:
            continue  # binds a kind of value the parent never takes
        if key == "$ref":
            holds = _implies_ref(parent, value, root, draft, depth, left)
        elif key in ("allOf", "anyOf"):
            every = all if key == "allOf" else any
            holds = isinstance(value, list) and every(_implies(parent, b, root, draft, depth + 1, left) for b in value)
        else:
            holds = _implies_keyword(parent, key, value, kinds, integral, root, draft, depth, left)
        if not holds:
            return False
    return True


# -- per kind ---------------------------------------------------------------------------------
def _kinds(node: dict[str, Any]) -> tuple[set[str], bool]:
    """The kinds of value ``node``'s ``type`` allows (all without one, or with one not understood), and
    whether its numbers must be integers."""
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if names is None or not all(n in (*_KINDS, "integer") for n in names):
        return set(_KINDS), False
    kinds = {"number" if n == "integer" else n for n in names}
    return kinds, "integer" in names and "number" not in names


def _number(value: Any) -> Fraction | None:
    """``value`` as an exact fraction, if it is a finite JSON number (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return Fraction(value)


def _count(node: dict[str, Any], key: str) -> Fraction | None:
    found = _number(node.get(key))
    return found if found is not None and found >= 0 else None


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_Bound = tuple[Fraction, bool, str]
"""A bound of numbers: its value, whether it is exclusive, its keyword."""


def _bounds(node: dict[str, Any], known: frozenset[str]) -> tuple[_Bound | None, _Bound | None]:
    """The tightest lower and upper bound of ``node``'s numbers, or None where it has none."""
    lows: list[_Bound] = []
    highs: list[_Bound] = []
    for key, exclusive, into in (
        ("minimum", False, lows), ("exclusiveMinimum", True, lows),
        ("maximum", False, highs), ("exclusiveMaximum", True, highs),
    ):  # fmt: skip
        value = _number(node.get(key)) if key in known else None
        if value is not None:
            into.append((value, exclusive, key))
    low = max(lows, key=lambda b: (b[0], b[1]), default=None)
    high = min(highs, key=lambda b: (b[0], not b[1]), default=None)
    return low, high


def _step(node: dict[str, Any], known: frozenset[str]) -> int | None:
    """``multipleOf`` where it is a positive integer (its multiples are integers: exact arithmetic)."""
    step = node.get("multipleOf") if "multipleOf" in known else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else None


def _numbers(
    node: dict[str, Any], pointer: str, dead: Mapping[str, Any], known: frozenset[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    low, high = _bounds(node, known)
    if low is None or high is None:
        return None
    (lo, lo_open, lo_key), (hi, hi_open, hi_key) = low, high
    step = _step(node, known)
    where = f"{lo_key} {_text(node[lo_key])} and {hi_key} {_text(node[hi_key])}"
    if step is None and not integral:
        if lo < hi or (lo == hi and not lo_open and not hi_open):
            return None
        return UnsatisfiableSchemaError(f"no number lies between {where}", f"{pointer}/{lo_key}")
    first = math.floor(lo) + 1 if lo_open else math.ceil(lo)
    last = math.ceil(hi) - 1 if hi_open else math.floor(hi)
    what = "integer"
    if step is not None:
        first = -(-first // step) * step
        what = f"multiple of {step}"
    if first <= last:
        return None
    return UnsatisfiableSchemaError(f"no {what} lies between {where}", f"{pointer}/{lo_key}")


def _strings(
    node: dict[str, Any], pointer: str, dead: Mapping[str, Any], known: frozenset[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    low, high = _count(node, "minLength"), _count(node, "maxLength")
    if low is not None and high is not None and low > high:
        why = f"minLength {_text(node['minLength'])} is above maxLength {_text(node['maxLength'])}"
        return UnsatisfiableSchemaError(why, f"{pointer}/minLength")
    return None


def _arrays(
    node: dict[str, Any], pointer: str, dead: Mapping[str, Any], known: frozenset[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    low, high = _count(node, "minItems") or Fraction(0), _count(node, "maxItems")
    if high is not None and low > high:
        why = f"minItems {_text(node['minItems'])} is above maxItems {_text(node['maxItems'])}"
        return UnsatisfiableSchemaError(why, f"{pointer}/minItems")
    need, needs = low, f"minItems {_text(node.get('minItems'))}"
    if "contains" in known and "contains" in node:
        least = _count(node, "minContains") if "minContains" in known and "minContains" in node else Fraction(1)
        most = _count(node, "maxContains") if "maxContains" in known else None
        if least is not None and most is not None and least > most:
            if "minContains" not in node:
                why = f"contains needs a match, and maxContains is {_text(node['maxContains'])}"
                return UnsatisfiableSchemaError(why, f"{pointer}/maxContains")
            why = f"minContains {_text(node['minContains'])} is above maxContains {_text(node['maxContains'])}"
            return UnsatisfiableSchemaError(why, f"{pointer}/minContains")
        if least is not None and least >= 1:
            if node["contains"] is False:
                return UnsatisfiableSchemaError(
                    "contains is `false`, and an array needs a match", f"{pointer}/contains"
                )
            if high is not None and least > high:
                why = f"contains needs {least} matching items, above maxItems {_text(node['maxItems'])}"
                return UnsatisfiableSchemaError(why, f"{pointer}/contains")
            if least > need:
                need, needs = least, f"contains (at least {least} items)"
    prefix = node.get("prefixItems") if "prefixItems" in known else None
    prefix = prefix if isinstance(prefix, list) else []
    for i, sub in enumerate(prefix):
        culprit = _dead(sub, f"{pointer}/prefixItems/{i}", dead)
        if culprit is not None and need > i:
            return _because(culprit, f"{needs} needs item {i}, which prefixItems/{i} forbids")
    items = node.get("items")
    culprit = _dead(items, f"{pointer}/items", dead) if isinstance(items, (dict, bool)) else None
    if culprit is not None and need > len(prefix):
        beyond = f"beyond the {len(prefix)} of prefixItems " if prefix else ""
        return _because(culprit, f"{needs} needs an item {beyond}and items forbids every one")
    return None


def _objects(
    node: dict[str, Any], pointer: str, dead: Mapping[str, Any], known: frozenset[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    low, high = _count(node, "minProperties") or Fraction(0), _count(node, "maxProperties")
    if high is not None and low > high:
        why = f"minProperties {_text(node['minProperties'])} is above maxProperties {_text(node['maxProperties'])}"
        return UnsatisfiableSchemaError(why, f"{pointer}/minProperties")
    raw = node.get("required")
    required = list(dict.fromkeys(k for k in raw if isinstance(k, str))) if isinstance(raw, list) else []
    if high is not None and len(required) > high:
        why = f"{len(required)} keys are required, above maxProperties {_text(node['maxProperties'])}"
        return UnsatisfiableSchemaError(why, f"{pointer}/required")
    props = _member(node, "properties", dict)
    extra = node.get("additionalProperties")
    closed = None  # why keys beyond `properties` are forbidden, if they are
    if "patternProperties" not in node and isinstance(extra, (dict, bool)):
        closed = _dead(extra, f"{pointer}/additionalProperties", dead)
    for name in required:
        if name in props:
            culprit = _dead(props[name], f"{pointer}/properties/{pointer_token(name)}", dead)
            if culprit is not None:
                return _because(culprit, f"{name!r} is required at '{pointer or '/'}'")
        elif closed is not None:
            why = f"{name!r} is required, and additionalProperties forbids every key beyond properties"
            return UnsatisfiableSchemaError(why, f"{pointer}/required")
    if "propertyNames" in known and node.get("propertyNames") is False and (required or low >= 1):
        why = "propertyNames is `false`, and an object needs a key"
        return UnsatisfiableSchemaError(why, f"{pointer}/propertyNames")
    if closed is not None:
        allowed = [
            n for n, sub in props.items() if _dead(sub, f"{pointer}/properties/{pointer_token(n)}", dead) is None
        ]
        if low > len(allowed):
            why = f"minProperties {_text(node['minProperties'])} is above the {len(allowed)} keys it allows"
            return UnsatisfiableSchemaError(why, f"{pointer}/minProperties")
    return None


def _anything(
    node: dict[str, Any], pointer: str, dead: Mapping[str, Any], known: frozenset[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    return None


_KIND_CHECKS = {
    "null": _anything, "boolean": _anything, "object": _objects, "array": _arrays, "string": _strings,
    "number": _numbers,
}  # fmt: skip


def _dead(sub: Any, pointer: str, dead: Mapping[str, UnsatisfiableSchemaError]) -> UnsatisfiableSchemaError | None:
    """Why the subschema ``sub`` at ``pointer`` admits no value (it is ``false``, or the walk proved it)."""
    if sub is False:
        return UnsatisfiableSchemaError("the schema is `false`", pointer)
    return dead.get(pointer)


def _because(culprit: UnsatisfiableSchemaError, consequence: str) -> UnsatisfiableSchemaError:
    """``culprit`` (a subschema's proof), with what it leaves the node without."""
    return UnsatisfiableSchemaError(f"{culprit.reason}; {consequence}", culprit.pointer)


# -- const and enum ---------------------------------------------------------------------------
def _literal(
    node: dict[str, Any], pointer: str, known: frozenset[str], kinds: set[str], integral: bool
) -> UnsatisfiableSchemaError | None:
    """Why no value ``const``/``enum`` lists is allowed beside them, or None (also without either)."""
    has_const = "const" in known and "const" in node
    if "enum" in node and isinstance(node["enum"], list):
        values = node["enum"]
        if has_const:
            values = [v for v in values if _same(v, node["const"])]
            if not values:
                return UnsatisfiableSchemaError("const is not one of the values of enum", f"{pointer}/const")
        key = "enum"
    elif has_const:
        values, key = [node["const"]], "const"
    else:
        return None
    if not values:
        return UnsatisfiableSchemaError("enum is empty", f"{pointer}/enum")
    failures = [_fails(v, node, known, kinds, integral) for v in values]
    if all(failures):
        which = "its value" if key == "const" or len(values) == 1 else f"any of its {len(values)} values"
        return UnsatisfiableSchemaError(
            f"the keywords beside {key} rule out {which} ({failures[0]})", f"{pointer}/{key}"
        )
    return None


def json_kind(value: Any) -> str:
    """The JSON type of a Python value as JSON Schema's ``type`` names it ("number" for an integer too)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0``, but ``true != 1``; objects by members, arrays by items."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if json_kind(a) != json_kind(b):
        return False
    return bool(a == b)


def _fails(value: Any, node: dict[str, Any], known: frozenset[str], kinds: set[str], integral: bool) -> str | None:
    """Why ``value`` breaks one of ``node``'s type, bounds and counts (None where it keeps them)."""
    kind = json_kind(value)
    if kind not in kinds:
        return f"{_text(value)} is not of type {_text(node.get('type'))}"
    if kind == "number":
        number = Fraction(value)
        if integral and number.denominator != 1:
            return f"{_text(value)} is not an integer"
        low, high = _bounds(node, known)
        for bound, below in ((low, True), (high, False)):
            if bound is not None:
                limit, exclusive, key = bound
                outside = (
                    (number < limit or (exclusive and number == limit))
                    if below
                    else (number > limit or (exclusive and number == limit))
                )
                if outside:
                    return f"{_text(value)} is beyond {key} {_text(node[key])}"
        step = _step(node, known)
        if step is not None and abs(number) <= 2**53 and number % step != 0:
            return f"{_text(value)} is not a multiple of {step}"
        return None
    counts = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
              "object": ("minProperties", "maxProperties")}  # fmt: skip
    if kind in counts:
        size = len(value)
        low_key, high_key = counts[kind]
        low_count, high_count = _count(node, low_key), _count(node, high_key)
        if low_count is not None and size < low_count:
            return f"{_text(value)} is shorter than {low_key} {_text(node[low_key])}"
        if high_count is not None and size > high_count:
            return f"{_text(value)} is longer than {high_key} {_text(node[high_key])}"
    if kind == "object" and isinstance(node.get("required"), list):
        missing = [k for k in node["required"] if isinstance(k, str) and k not in value]
        if missing:
            return f"{_text(value)} lacks the required key {missing[0]!r}"
    return None


# -- implication ------------------------------------------------------------------------------
def _implies_ref(parent: dict[str, Any], ref: Any, root: Any, draft: int, depth: int, left: list[int]) -> bool:
    if root is None or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return False
    try:
        target = resolve_local(root, ref)
    except LookupError:
        return False
    return _implies(parent, target, root, draft, depth + 1, left)


def _implies_keyword(
    parent: dict[str, Any],
    key: str,
    value: Any,
    kinds: set[str],
    integral: bool,
    root: Any,
    draft: int,
    depth: int,
    left: list[int],
) -> bool:
    """Whether every value of ``parent`` (of ``kinds``) keeps ``branch``'s keyword ``key: value``."""
    known = vocabulary(draft)
    if key == "type":
        theirs, their_integral = _kinds({"type": value})
        return kinds <= theirs and (integral or not their_integral or "number" not in kinds)
    if key == "required":
        mine = _member(parent, "required", list)
        return isinstance(value, list) and {k for k in value if isinstance(k, str)} <= {
            k for k in mine if isinstance(k, str)
        }
    if key == "properties":
        if not isinstance(value, dict):
            return False
        for name, sub in value.items():
            own = _member(parent, "properties", dict).get(name, True)
            if own is False:
                continue  # the parent never has this key
            if not _implies(own if isinstance(own, dict) else {}, sub, root, draft, depth + 1, left):
                return False
        return True
    if key in ("enum", "const"):
        listed = [value] if key == "const" else value if isinstance(value, list) else None
        values = _values(parent, known)
        return listed is not None and values is not None and all(any(_same(v, t) for t in listed) for v in values)
    if key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        limit = _number(value)
        low, high = _bounds(parent, known)
        if limit is None:
            return False
        if key in ("minimum", "exclusiveMinimum"):
            return low is not None and (low[0] > limit or (low[0] == limit and (key == "minimum" or low[1])))
        return high is not None and (high[0] < limit or (high[0] == limit and (key == "maximum" or high[1])))
    if key in ("minLength", "minItems", "minProperties"):
        limit, mine_low = _number(value), _count(parent, key)
        if key == "minProperties" and isinstance(parent.get("required"), list):
            named = len({k for k in parent["required"] if isinstance(k, str)})
            mine_low = max(mine_low or Fraction(0), Fraction(named))
        return limit is not None and (limit <= 0 or (mine_low is not None and mine_low >= limit))
    if key in ("maxLength", "maxItems", "maxProperties"):
        limit, mine_high = _number(value), _count(parent, key)
        return limit is not None and mine_high is not None and mine_high <= limit
    if key == "multipleOf":
        step, mine_step = _step({key: value}, known), _step(parent, known)
        return step is not None and mine_step is not None and mine_step % step == 0
    return False


def _member(node: dict[str, Any], key: str, kind: type[Any]) -> Any:
    """``node[key]`` where it is a ``kind`` (``dict`` or ``list``), else an empty one."""
    found = node.get(key)
    return found if isinstance(found, kind) else kind()


def _values(node: dict[str, Any], known: frozenset[str]) -> list[Any] | None:
    """The values ``node``'s ``const``/``enum`` allow (a superset: only one of them is read), or None."""
    if "const" in known and "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _every(parent: dict[str, Any]) -> str:
    """How a message names the values of ``parent``."""
    kinds, _ = _kinds(parent)
    required = parent.get("required")
    if isinstance(required, list) and required and kinds == {"object"}:
        return "every object with the required keys " + ", ".join(str(k) for k in required)
    return "every value the keywords beside it allow"
