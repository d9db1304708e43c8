"""JSON Schema preparation: rewrite a schema for the grammar engine and report, per keyword, what is enforced.

xgrammar's schema converter ignores or mishandles some keywords (it keeps only
the first branch of ``allOf``, rejects every key under ``patternProperties``,
cannot express object/array ``const``, treats ``pattern`` as anchored, fails on
fractional integer bounds...). :func:`prepare` rewrites the schema into one the
engine handles exactly, or into a *superset* of it where the engine cannot
express a keyword, and records for every keyword at every JSON pointer one of:

- ``enforced``: the grammar guarantees it;
- ``checked``: the grammar accepts a superset; the finished output is validated
  with ``jsonschema`` and a violation is reported (never silently passed);
- ``approximated``: refused in strict mode (neither enforceable nor fully
  checkable offline, e.g. a remote ``$ref``); with ``lenient=True`` the grammar
  accepts anything there and the result is reported as an approximation;
- ``ignored``: an annotation (``title``, ``description``, ``default``...) or an
  unknown keyword, which does not affect validity.

Because the prepared schema always accepts a superset, a valid output is never
blocked by a rewrite, and post-validation catches what the superset lets through.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal
from urllib.parse import unquote

import xgrammar as xgr

from constrain.errors import SchemaError, UnsupportedSchemaError

__all__ = ["SCHEMA_LISTS", "SCHEMA_MAPS", "SINGLE_SCHEMAS", "CoverageEntry", "Status", "prepare", "resolve_local"]

Status = Literal["enforced", "checked", "approximated", "ignored"]

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "$vocabulary",
        "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "contentSchema",
        "$anchor", "$dynamicAnchor", "discriminator", "nullable",
    }
)  # fmt: skip
"""Keywords that never change whether an instance is valid (``$anchor`` is resolved, not enforced)."""

ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
        "maxItems", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "minProperties", "maxProperties", "anyOf", "$defs", "definitions", "enum", "const",
    }
)  # fmt: skip
"""Keywords the engine enforces (after the rewrites below)."""

CHECKED = frozenset(
    {
        "uniqueItems", "not", "contains", "minContains", "maxContains", "dependentRequired",
        "dependentSchemas", "if", "then", "else", "patternProperties", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "dependencies",
    }
)  # fmt: skip
"""Keywords dropped from the grammar (a superset) and checked on the finished output."""

ENGINE_FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
"""``format`` values xgrammar enforces; others are checked by ``jsonschema``'s format checker, if it knows them."""

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SINGLE_SCHEMAS = (
    "items", "additionalProperties", "additionalItems", "not", "contains", "if", "then", "else",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
"""Where subschemas sit: maps of them, lists of them, single ones (``items`` may also be a draft-7 list)."""

INT64_AS_FLOAT = 2.0**53
"""Integer bounds beyond this are dropped from the grammar (the engine rejects them) and checked."""

FLOAT_BOUND = 1e15
"""Number bounds beyond this magnitude are dropped from the grammar and checked."""


@dataclass(frozen=True, slots=True)
class CoverageEntry:
    """What happens to one keyword at one place of the schema."""

    pointer: str  # JSON pointer of the subschema ("" is the root)
    keyword: str
    status: Status
    note: str = ""


class _Preparer:
    def __init__(self, root: Any, lenient: bool, closed: bool) -> None:
        self.root = root
        self.lenient = lenient
        self.closed = closed
        self.coverage: dict[tuple[str, str], CoverageEntry] = {}  # the last word on each keyword wins
        self.aliases: dict[str, str] = {}  # $ref -> name under the root's $defs
        self.alias_defs: dict[str, Any] = {}
        self._expanding: list[str] = []  # references inlined by the allOf merges enclosing the current node

    def mark(self, pointer: str, keyword: str, status: Status, note: str = "") -> None:
        self.coverage[pointer, keyword] = CoverageEntry(pointer, keyword, status, note)

    def refuse(self, pointer: str, keyword: str, reason: str) -> None:
        """Strict: raise; lenient: record an approximation."""
        if not self.lenient:
            raise UnsupportedSchemaError(keyword, pointer, reason)
        self.mark(pointer, keyword, "approximated", reason)

    # -- references -------------------------------------------------------------------------
    def resolve(self, ref: str, pointer: str) -> Any:
        """The subschema a local ``$ref`` (``#/...``) names."""
        try:
            return resolve_local(self.root, ref)
        except LookupError as err:
            raise SchemaError(f"$ref {ref!r} does not resolve", pointer) from err

    # -- the walk ---------------------------------------------------------------------------
    def schema(self, node: Any, pointer: str) -> Any:
        """Return the prepared form of ``node``: a dict, or False for an unsatisfiable subschema."""
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise SchemaError(f"a schema is an object or a boolean, got {type(node).__name__}", pointer)
        out: dict[str, Any] = {}
        node = dict(node)
        if "$ref" in node:
            self.reference(node, out, pointer)
        inlined: list[str] = []
        says_open = _says_what_else(node)  # before allOf merges, which drop additionalProperties
        if "allOf" in node:
            node, inlined = self.merge_all_of(node, pointer)
        self._expanding.extend(inlined)  # a recursive allOf must not inline these again below
        try:
            if "enum" in node or "const" in node:
                self.literal(node, out, pointer)
            for key, value in node.items():
                if key not in out and key not in ("$ref", "enum", "const", "allOf"):
                    self.keyword(key, value, node, out, pointer)
        finally:
            del self._expanding[len(self._expanding) - len(inlined) :]
        self.loosen_for_checked(node, out, pointer)
        self.declare_required(node, out)
        if self.closed and not says_open:
            self.close(node, out, pointer)
        self.integer_bounds(out, pointer)
        if ("pattern" in out or "format" in out) and ("minLength" in out or "maxLength" in out):
            for key in ("minLength", "maxLength"):  # the engine drops lengths beside a pattern or format
                if out.pop(key, None) is not None:
                    self.mark(pointer, key, "checked", "beside a pattern or format: validated afterwards")
        return _split_by_type(self.distribute_any_of(out, pointer))

    def distribute_any_of(self, out: dict[str, Any], pointer: str) -> dict[str, Any]:
        """``{S, anyOf: [A, B]}`` means ``anyOf: [S and A, S and B]``: spell it out for the engine."""
        branches = out.get("anyOf")
        siblings = {k: v for k, v in out.items() if k not in ("anyOf", "$defs", "definitions")}
        if not branches or not siblings:
            return out
        if "$ref" in siblings or any("$ref" in b for b in branches):
            self.mark(pointer, "anyOf", "checked", "beside other keywords and references: validated afterwards")
            return out
        merged, exact = [], True
        for branch in branches:
            both = dict(siblings)
            try:
                exact &= _merge_into(both, branch)
                if "anyOf" in both and "anyOf" not in siblings:  # the branch is a union itself: distribute again
                    nested = self.distribute_any_of(both, pointer)
                    if set(nested) <= {"anyOf", "$defs", "definitions"}:
                        merged += nested["anyOf"]
                        continue
                    both = nested
            except UnsupportedSchemaError:
                continue  # this branch contradicts its siblings: no value takes it
            merged.append(both)
        if not merged:
            raise UnsupportedSchemaError("anyOf", pointer, "no branch is compatible with the keywords beside it")
        if not exact:
            self.mark(pointer, "anyOf", "checked", "merged with the keywords beside it into a superset")
        return {**{k: v for k, v in out.items() if k in ("$defs", "definitions")}, "anyOf": merged}

    def keyword(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        handler = self._HANDLERS.get(key)
        if handler is not None:
            handler(self, key, value, node, out, f"{pointer}/{key}", pointer)
        elif key in ENFORCED:
            out[key] = value
            self.mark(pointer, key, "enforced")
        elif key in CHECKED:
            self.mark(pointer, key, "checked", "the grammar accepts a superset; validated afterwards")
        elif key in ANNOTATIONS:
            self.mark(pointer, key, "ignored", "annotation")
        elif key in ("$dynamicRef", "$recursiveRef"):
            self.refuse(pointer, key, "dynamic references are not supported")
        else:
            self.mark(pointer, key, "ignored", "unknown keyword")

    def reference(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise SchemaError("$ref must be a string", pointer)
        if ref.startswith("#") and not ref.startswith("#/") and ref != "#":
            anchor = self.find_anchor(ref[1:])
            if anchor is None:
                self.refuse(pointer, "$ref", f"anchor {ref!r} is not defined in this schema")
                return
            ref = anchor
        if not (ref.startswith("#/") or ref == "#"):
            self.refuse(pointer, "$ref", f"reference {ref!r} cannot be resolved offline")
            return
        self.resolve(ref, pointer)  # fails early on a dangling reference
        out["$ref"] = ref if _SIMPLE_REF.fullmatch(ref) else self.alias(ref, pointer)
        self.mark(pointer, "$ref", "enforced")
        if set(node) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
            # a $ref beside other keywords means allOf(ref, rest) in 2020-12
            siblings = {k: v for k, v in node.items() if k not in ("$ref", "$defs", "definitions")}
            for key in siblings:
                del node[key]
            node["allOf"] = [{"$ref": ref}, siblings]
            del out["$ref"]

    def alias(self, ref: str, pointer: str) -> str:
        """Give a reference the engine cannot follow (into arrays, escaped names, the root) a ``$defs`` name."""
        if ref not in self.aliases:
            name = f"constrain_ref{len(self.aliases)}"
            self.aliases[ref] = name
            self.alias_defs[name] = {}  # placeholder while the target (which may recurse here) is prepared
            prepared = self.schema(self.resolve(ref, pointer), ref[1:])
            self.alias_defs[name] = prepared if prepared is not False else {}
        return f"#/$defs/{self.aliases[ref]}"

    def find_anchor(self, name: str) -> str | None:
        """The JSON pointer (as ``#/...``) of the subschema with ``$anchor: name``."""

        def walk(node: Any, path: str) -> str | None:
            if isinstance(node, dict):
                if node.get("$anchor") == name:
                    return "#" + path
                for k, v in node.items():
                    found = walk(v, f"{path}/{k}")
                    if found:
                        return found
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    found = walk(v, f"{path}/{i}")
                    if found:
                        return found
            return None

        return walk(self.root, "")

    # -- allOf ------------------------------------------------------------------------------
    def merge_all_of(self, node: dict[str, Any], pointer: str) -> tuple[dict[str, Any], list[str]]:
        """Fold ``allOf`` branches into the node where the result is exact, else into a superset.

        Returns the merged node and the references inlined into it.
        """
        branches = node.get("allOf")
        if not isinstance(branches, list) or not branches:
            raise SchemaError("allOf must be a non-empty array", pointer)
        merged = {k: v for k, v in node.items() if k != "allOf"}
        exact = True
        inlined: list[str] = []
        for i, raw in enumerate(branches):
            branch = self.inline(raw, f"{pointer}/allOf/{i}", inlined)
            if branch is None:
                exact = False
                continue
            if branch is False:
                raise UnsupportedSchemaError("allOf", pointer, "a branch is `false`: no value satisfies the schema")
            exact &= _merge_into(merged, branch)
        self.mark(
            pointer,
            "allOf",
            "enforced" if exact else "checked",
            "branches merged" + ("" if exact else " into a superset"),
        )
        return merged, inlined

    def inline(self, branch: Any, pointer: str, inlined: list[str]) -> Any:
        """A branch with its top-level local ``$ref`` chain inlined (appended to ``inlined``); None if recursive."""
        seen: list[str] = []
        while isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and branch["$ref"].startswith("#"):
            ref = branch["$ref"]
            if ref in seen or ref in self._expanding:
                return None
            seen.append(ref)
            inlined.append(ref)
            target = self.resolve(ref, pointer)
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            if rest:
                return _combine(target, rest) if isinstance(target, dict) else None
            branch = target
        return {} if branch is True else branch  # a reference may name a boolean schema

    # -- enum / const -----------------------------------------------------------------------
    def literal(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        for key in ("const", "enum"):
            if key not in node:
                continue
            values = [node[key]] if key == "const" else node[key]
            if key == "enum" and (not isinstance(values, list) or not values):
                raise SchemaError("enum must be a non-empty array", pointer)
            if all(not isinstance(v, (dict, list)) for v in values):
                out[key] = node[key]
            else:  # the engine cannot express composite literals: spell each out as a schema
                out["anyOf"] = [_literal_schema(v) for v in values]
            self.mark(pointer, key, "enforced")

    # -- per-keyword handlers ---------------------------------------------------------------
    def _properties(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError("properties must be an object", at)
        props = {}
        for name, sub in value.items():
            prepared = self.schema(sub, f"{ptr}/{_escape(name)}")
            if prepared is False:
                self.mark(f"{ptr}/{_escape(name)}", "false", "checked", "a property that must be absent")
                continue
            props[name] = prepared
        out[key] = props
        self.mark(at, key, "enforced")

    def _subschema_map(
        self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str
    ) -> None:
        if not isinstance(value, dict):
            raise SchemaError(f"{key} must be an object", at)
        prepared = {name: self.schema(sub, f"{ptr}/{_escape(name)}") for name, sub in value.items()}
        out[key] = {name: ({} if sub is False else sub) for name, sub in prepared.items()}  # false: a superset
        self.mark(at, key, "enforced")

    def _one_subschema(
        self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str
    ) -> None:
        out[key] = self.schema(value, ptr)  # may be False: no additional properties / items
        self.mark(at, key, "enforced")

    def _schema_list(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, list) or not value:
            raise SchemaError(f"{key} must be a non-empty array", at)
        branches = [self.schema(sub, f"{ptr}/{i}") for i, sub in enumerate(value)]
        live = [b for b in branches if b is not False]
        if key == "prefixItems":
            out[key] = [b if b is not False else {} for b in branches]
            self.mark(at, key, "enforced" if len(live) == len(branches) else "checked")
            return
        if not live:
            raise UnsupportedSchemaError(key, at, "every branch is `false`: no value satisfies it")
        out["anyOf"] = live
        if key == "oneOf":
            self.mark(at, key, "checked", "branches enforced as anyOf; exclusivity validated afterwards")
        else:
            self.mark(at, key, "enforced")

    def _pattern(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, str):
            raise SchemaError("pattern must be a string", at)
        search = _search_pattern(value)
        if search is None:
            self.mark(at, key, "checked", "anchors inside the pattern: validated afterwards")
            return
        try:
            xgr.Grammar.from_regex(search)
        except RuntimeError:
            self.mark(at, key, "checked", "the regex uses features the engine lacks")
            return
        out[key] = search
        self.mark(at, key, "enforced", "search semantics: unanchored ends match anything")

    def _format(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if value in ENGINE_FORMATS:
            out[key] = value
            self.mark(at, key, "enforced")
        else:
            self.mark(
                at, key, "checked", "validated afterwards by jsonschema's format checker where it knows the format"
            )

    def _multiple_of(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if node.get("type") == "integer" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
            self.mark(at, key, "enforced")
        else:
            self.mark(at, key, "checked", "multipleOf on non-integers is validated afterwards")

    def _number_bound(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SchemaError(f"{key} must be a number", at)
        limit = INT64_AS_FLOAT if node.get("type") == "integer" else FLOAT_BOUND
        if abs(value) > limit or (isinstance(value, float) and not math.isfinite(value)):
            self.mark(at, key, "checked", "bound beyond what the engine handles; validated afterwards")
            return
        out[key] = value
        self.mark(at, key, "enforced")

    def _pattern_properties(
        self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str
    ) -> None:
        self.mark(at, key, "checked", "keys matching a pattern are accepted with any value; validated afterwards")

    _HANDLERS: ClassVar[dict[str, Callable[..., None]]] = {
        "properties": _properties,
        "$defs": _subschema_map,
        "definitions": _subschema_map,
        "additionalProperties": _one_subschema,
        "items": _one_subschema,
        "prefixItems": _schema_list,
        "anyOf": _schema_list,
        "oneOf": _schema_list,
        "pattern": _pattern,
        "format": _format,
        "multipleOf": _multiple_of,
        "minimum": _number_bound,
        "maximum": _number_bound,
        "exclusiveMinimum": _number_bound,
        "exclusiveMaximum": _number_bound,
        "patternProperties": _pattern_properties,
    }

    def loosen_for_checked(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        """Keep the grammar a superset where a dropped keyword would have widened what is allowed."""
        widening = ("patternProperties", "unevaluatedProperties", "dependentSchemas", "if", "then", "else")
        if any(k in node for k in widening) and "additionalProperties" in out:
            out.pop("additionalProperties")  # keys the dropped keyword would admit must stay possible
            self.mark(pointer, "additionalProperties", "checked", "relaxed beside patternProperties/unevaluated*")
        if "unevaluatedItems" in node and out.get("items") is False:
            out.pop("items")

    def declare_required(self, node: dict[str, Any], out: dict[str, Any]) -> None:
        """A required key that ``properties`` does not describe becomes a property with the value schema of
        other keys (xgrammar enforces only described required keys; closing must not make them impossible).
        Only beside ``properties``: a branch that lists required keys alone is described by its siblings."""
        extra = out.get("additionalProperties", {})
        typed = "properties" in out or out.get("type") == "object"
        if not typed or extra is False or not isinstance(out.get("required"), list):
            return
        described: Any = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in out["required"]:
            if isinstance(name, str) and name not in described:
                out.setdefault("properties", {}).setdefault(name, extra)

    def close(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        """Closed mode: an object that declares its keys (``properties``) takes no others; a tuple takes no
        further items. A branch that lists required keys alone is left open: its siblings describe them."""
        if "properties" in node:
            out["additionalProperties"] = False
            self.mark(pointer, "additionalProperties", "enforced", "closed: no keys beyond those declared")
        if "prefixItems" in out and "items" not in out:
            out["items"] = False
            self.mark(pointer, "items", "enforced", "closed: no items beyond prefixItems")

    def integer_bounds(self, out: dict[str, Any], pointer: str) -> None:
        """The engine wants whole numbers: counts written ``2.0`` become ``2``; integer bounds round inward."""
        for key in _COUNTS:
            if isinstance(out.get(key), float) and out[key].is_integer():
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


_SAYS_WHAT_ELSE = (
    "additionalProperties", "patternProperties", "unevaluatedProperties", "dependentSchemas", "dependencies",
    "if", "items", "unevaluatedItems",
)  # fmt: skip
"""Keywords by which a schema says what else an object or array may hold: closed mode leaves such a
node as the schema has it."""


def _says_what_else(node: dict[str, Any]) -> bool:
    """Whether ``node`` or one of its inline ``allOf`` branches has a keyword of :data:`_SAYS_WHAT_ELSE`."""
    branches: Any = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    return any(isinstance(n, dict) and any(k in n for k in _SAYS_WHAT_ELSE) for n in [node, *branches])


def resolve_local(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or ``#/...``, a JSON pointer) names in ``root``.

    Raises ``LookupError`` when it names nothing there.
    """
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise LookupError(ref)
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise LookupError(ref)
    return node


_SIMPLE_REF = re.compile(r"#/(\$defs|definitions)/[A-Za-z0-9_.-]+")
"""References the engine follows itself; others get an alias (see ``_Preparer.alias``)."""


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _search_pattern(pattern: str) -> str | None:
    """JSON Schema ``pattern`` is a search: pad unanchored ends and anchor, so both engines read it alike.

    None when the engine would misread it: an anchor inside the pattern (xgrammar ignores those)
    or a top-level ``|`` (an outer anchor binds one alternative only).
    """
    body = pattern
    start = body.startswith("^")
    end = body.endswith("$") and not body.endswith("\\$")
    if start:
        body = body[1:]
    if end:
        body = body[:-1]
    depth, in_class, escaped = 0, False, False
    for ch in body:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch in "^$" or (ch == "|" and depth == 0 and (start or end)):
            return None
    # anchored explicitly: xgrammar reads a pattern as a full match, llguidance as a search
    return "^" + ("" if start else ".*") + f"(?:{body})" + ("" if end else ".*") + "$"


_FAMILIES = {
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
_ALL_TYPES = ("null", "boolean", "object", "array", "string", "number")


def _split_by_type(out: dict[str, Any]) -> dict[str, Any]:
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


def _literal_schema(value: Any) -> dict[str, Any]:
    """A schema that accepts exactly the JSON value ``value`` (objects in any key order)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: _literal_schema(v) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list):
        return {
            "type": "array",
            "prefixItems": [_literal_schema(v) for v in value],
            "items": False,
            "minItems": len(value),
        }
    return {"const": value}


def _combine(target: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    merged = dict(target)
    _merge_into(merged, rest)
    return merged


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_TAKE_MAX = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_TAKE_MIN = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


def _merge_into(merged: dict[str, Any], branch: dict[str, Any]) -> bool:
    """Intersect ``branch`` into ``merged``; return False where the result had to be a superset."""
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
                    if (
                        isinstance(props[name], dict)
                        and isinstance(sub, dict)
                        and "$ref" not in props[name]
                        and "$ref" not in sub
                    ):
                        combined = dict(props[name])
                        exact &= _merge_into(combined, sub)
                        props[name] = combined
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
                raise UnsupportedSchemaError("allOf", "", f"types {sorted(a)} and {sorted(b)} never meet")
            merged[key] = common[0] if len(common) == 1 else common
        elif key == "enum":
            common_values = [v for v in merged[key] if v in value]
            if not common_values:
                raise UnsupportedSchemaError("allOf", "", "enums share no value")
            merged[key] = common_values
        elif key == "additionalProperties":
            exact = False  # its meaning depends on the branch's own properties: drop it (superset)
            merged.pop(key)
        else:
            exact = False  # two different values of a keyword we do not intersect: keep the first
    return exact


def prepare(schema: Any, *, lenient: bool, closed: bool = False) -> tuple[Any, tuple[CoverageEntry, ...]]:
    """Return ``(schema for the engine, coverage)``; see the module docstring.

    ``closed``: objects that declare their keys take no others, tuples no further items (see
    :func:`constrain.json_schema`); written into the schema, so both engines read it alike.

    Raises
    ------
    SchemaError
        A dangling ``$ref`` or a malformed keyword (with its JSON pointer).
    UnsupportedSchemaError
        Strict mode, and a keyword that can be neither enforced nor checked.
    """
    preparer = _Preparer(schema, lenient, closed)
    if schema is False:
        raise UnsupportedSchemaError("false", "", "the schema `false` accepts no value")
    prepared = preparer.schema(schema, "")
    if preparer.alias_defs:
        prepared.setdefault("$defs", {}).update(preparer.alias_defs)
    return prepared, tuple(sorted(preparer.coverage.values(), key=lambda e: (e.pointer, e.keyword)))
