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

A subschema proven to admit no value (``false``, or by :mod:`~constrain.constraints.schema_unsatisfiable`)
is prepared as ``False``: its enclosing node leaves it out (a property that must be absent, an ``anyOf``
branch dropped) or loses its value with it (a required key, the only type it allows). Where the root
admits no value, :func:`prepare` raises :class:`~constrain.errors.UnsatisfiableSchemaError` naming the
keyword, in lenient mode too: no output is valid, so there is nothing to approximate.

One walk prepares the schema, node by node, innermost first (a node's steps 4 and 5 need what became of
its subschemas: one that admits no value changes its parent). Each node takes five steps, in this order
(:meth:`_Preparer.rewrite`), each a method of the walk with its section below:

1. references: a ``$ref`` is given to the engine, or becomes an ``allOf`` branch beside other keywords
   (resolution, anchors and aliases: :mod:`~constrain.constraints.schema_refs`);
2. ``allOf``: the branches merged into the node (:meth:`~constrain.constraints.schema_refs.References.merge_all_of`,
   by :func:`~constrain.constraints.schema_rewrites.merge_into`);
3. each keyword to its handler (``_Preparer._HANDLERS``, then the keyword sets below), which prepares the
   subschemas under it and says what the engine enforces;
4. the proof that the node admits no value, or none (:mod:`~constrain.constraints.schema_unsatisfiable`);
5. the result rewritten for the engines (:meth:`_Preparer.finish`; the rewrites themselves are pure
   functions of :mod:`~constrain.constraints.schema_rewrites`).

Before the walk, :func:`~constrain.constraints.schema_refs.resolve_from_resources` makes the references
inside nested schema resources absolute; after it, the aliases step 1 made are added to the root's ``$defs``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, overload

from constrain.backends.xgrammar import check_regex
from constrain.caches import bounded
from constrain.constraints.formats import format_status
from constrain.constraints.schema_refs import References, pointer_token, resolve_from_resources
from constrain.constraints.schema_rewrites import (
    ANNOTATIONS,
    absorb_branches,
    declare_required,
    disjoint_searches,
    distribute_any_of,
    literal_schema,
    round_integer_bounds,
    says_what_else,
    search_pattern,
    split_by_type,
)
from constrain.constraints.schema_unsatisfiable import contradiction, draft_of
from constrain.errors import SchemaError, UnsatisfiableSchemaError, UnsupportedSchemaError

__all__ = [
    "SCHEMA_LISTS", "SCHEMA_MAPS", "SINGLE_SCHEMAS", "SUBSCHEMA_KEYS", "Coverage", "CoverageEntry", "Status", "prepare",
    "prepared_schema", "subschemas",
]  # fmt: skip

Status = Literal["enforced", "checked", "approximated", "ignored"]


ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
        "maxItems", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "minProperties", "maxProperties", "anyOf", "$defs", "definitions", "enum", "const",
    }
)  # fmt: skip
"""Keywords the engine enforces (after the rewrites of :mod:`~constrain.constraints.schema_rewrites`)."""

_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
"""Beside any of these, xgrammar 0.2.8 writes an integer's range and drops its ``multipleOf``."""

CHECKED = frozenset(
    {
        "uniqueItems", "not", "contains", "minContains", "maxContains", "dependentRequired",
        "dependentSchemas", "if", "then", "else", "patternProperties", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "dependencies",
    }
)  # fmt: skip
"""Keywords dropped from the grammar (a superset) and checked on the finished output."""

OTHER_DRAFTS = {"dependencies": True, "dependentRequired": False, "dependentSchemas": False}
"""Keywords of :data:`CHECKED` that one side of 2019-09 does not define: ignored where the value says the schema's
draft is 2019-09 or later (``True``), or earlier (``False``), as the validator ignores them there."""

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

_PLAIN = ANNOTATIONS | {"type"}
"""A node of these keywords alone is its keywords: each is kept (``type``) or reported (annotations), and none
of the walk's rewrites or proofs applies (``{"type": "string", "description": ...}``)."""

_WIDENING = frozenset({"unevaluatedProperties", "dependentSchemas", "if", "then", "else"})
"""Keywords dropped for the engine that would admit keys beyond ``additionalProperties``."""
_WIDENING_UNPATTERNED = _WIDENING | {"patternProperties"}
""":data:`_WIDENING` where the engine is not given the ``patternProperties`` (it has no patterns)."""

SUBSCHEMA_KEYS = frozenset((*SCHEMA_MAPS, *SCHEMA_LISTS, *SINGLE_SCHEMAS))
"""Every keyword under which a subschema sits."""
_MAP_KEYS, _LIST_KEYS = frozenset(SCHEMA_MAPS), frozenset(SCHEMA_LISTS)


def subschemas(node: dict[str, Any]) -> Iterator[Any]:
    """The values directly inside ``node`` where subschemas sit, in ``node``'s key order: the values of its
    maps, the members of its lists (a draft-7 ``items`` list too), its single ones. Callers skip what is
    not a schema (a ``dependencies`` entry may be a list of names). Walks ``node``'s own keys only."""
    for key, value in node.items():
        if key not in SUBSCHEMA_KEYS:
            continue
        if key in _MAP_KEYS:
            if isinstance(value, dict):
                yield from value.values()
        elif isinstance(value, list):
            yield from value
        elif key not in _LIST_KEYS:
            yield value


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


class Coverage(Sequence[CoverageEntry]):
    """A schema's coverage: its :class:`CoverageEntry` items, in order. Immutable; ``+`` appends entries.

    Held as tuples of strings, which Python's cyclic collector stops walking once it has seen them: an
    object per entry was a quarter of what a process held after compiling MaskBench's 400-schema sample
    (35,000 of 150,000 objects), walked at every full collection (a pause of 50 to 70 ms, in some first
    mask). Each item read is a new :class:`CoverageEntry`."""

    __slots__ = ("_rows",)

    def __init__(self, entries: Iterable[CoverageEntry] = ()) -> None:
        self._rows = tuple((e.pointer, e.keyword, e.status, e.note) for e in entries)

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, str, Status, str]]) -> Coverage:
        """The coverage of entries given as ``(pointer, keyword, status, note)``."""
        coverage = cls.__new__(cls)
        coverage._rows = tuple(rows)
        return coverage

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> CoverageEntry: ...
    @overload
    def __getitem__(self, index: slice) -> Coverage: ...
    def __getitem__(self, index: int | slice) -> CoverageEntry | Coverage:
        if isinstance(index, slice):
            return Coverage(CoverageEntry(*row) for row in self._rows[index])
        return CoverageEntry(*self._rows[index])

    def __iter__(self) -> Iterator[CoverageEntry]:
        return (CoverageEntry(*row) for row in self._rows)

    def __add__(self, entries: Iterable[CoverageEntry]) -> Coverage:
        return Coverage.from_rows((*self._rows, *Coverage(entries)._rows))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Coverage) and self._rows == other._rows

    def __hash__(self) -> int:
        return hash(self._rows)

    def __repr__(self) -> str:
        return f"Coverage({list(self)!r})"


class _Preparer:
    """One preparation: walks the schema, dispatches each keyword (:attr:`_HANDLERS`, then the keyword
    sets above), and records what happens to it in ``coverage`` (the last word on a keyword wins)."""

    def __init__(self, root: Any, lenient: bool, closed: bool) -> None:
        self.lenient = lenient
        self.closed = closed
        self.coverage: dict[tuple[str, str], tuple[Status, str]] = {}  # (pointer, keyword) -> (status, note)
        self.refs = References(root, self.schema)
        self.draft = draft_of(root)  # the draft its output is validated under: the proofs read its keywords
        # where the proofs resolve "#/..." references: nowhere when an $id below the root moves their base
        inner = {k: v for k, v in root.items() if k != "$id"} if isinstance(root, dict) else root
        self.proof_root = None if '"$id"' in json.dumps(inner) else root
        # per node being prepared, innermost last: its subschemas that admit no value, by pointer, with the proof
        self.frames: list[dict[str, UnsatisfiableSchemaError]] = [{}]

    def mark(self, pointer: str, keyword: str, status: Status, note: str = "") -> None:
        self.coverage[pointer, keyword] = status, note  # made the Coverage once, at the end

    def refuse(self, pointer: str, keyword: str, reason: str) -> None:
        """Strict: raise; lenient: record an approximation."""
        if not self.lenient:
            raise UnsupportedSchemaError(keyword, pointer, reason)
        self.mark(pointer, keyword, "approximated", reason)

    # -- the walk ---------------------------------------------------------------------------
    def schema(self, node: Any, pointer: str) -> Any:
        """Return the prepared form of ``node``: a dict, or False where it admits no value (``false``, or
        proven so); the proof is kept, by ``pointer``, in the enclosing node's frame (:attr:`frames`)."""
        if node is True:
            return {}
        if isinstance(node, dict) and node.keys() <= _PLAIN:  # see rewrite: nothing in it can be proven or fail
            out: dict[str, Any] = {}
            for key, value in node.items():
                self.keyword(key, value, node, out, pointer)
            return out
        frame: dict[str, UnsatisfiableSchemaError] = {}
        self.frames.append(frame)
        try:
            return self.node(node, pointer, frame)
        except UnsatisfiableSchemaError as err:
            proof = err
        finally:
            self.frames.pop()
        self.frames[-1][pointer] = proof
        if node is not False:  # where an enclosing node widens it to `true`, values there are checked
            self.mark(pointer, "false", "checked", f"admits no value ({proof.reason}, at '{proof.pointer or '/'}')")
        return False

    def node(self, node: Any, pointer: str, frame: dict[str, UnsatisfiableSchemaError]) -> Any:
        """The prepared form of ``node`` (a dict); ``frame`` collects the proofs of its subschemas that admit
        no value. Raises ``UnsatisfiableSchemaError`` where ``node`` itself admits none.

        The rewrites read keywords as 2020-12 does; where they find no value in a node whose draft reads
        one of its keywords otherwise (:meth:`read_otherwise`), that is no proof: the node is refused as
        a keyword not supported (strict) or approximated (lenient). :func:`contradiction` reads the draft.
        """
        if node is False:
            raise UnsatisfiableSchemaError("the schema is `false`", pointer)
        if not isinstance(node, dict):
            raise SchemaError(f"a schema is an object or a boolean, got {type(node).__name__}", pointer)
        proven: list[UnsatisfiableSchemaError] = []
        try:
            return self.rewrite(node, pointer, frame, proven)
        except UnsatisfiableSchemaError as err:
            keyword = None if any(err is p for p in proven) else self.read_otherwise(node)
            if keyword is None:
                raise
            why = f"no value as draft 2020-12 reads {keyword} ({err.reason}, at '{err.pointer or '/'}')"
            self.refuse(pointer, keyword, f"{why}; this schema's draft reads {keyword} otherwise")
            return {}

    def read_otherwise(self, node: dict[str, Any]) -> str | None:
        """A keyword in ``node`` or below that the schema's draft reads otherwise than 2020-12 (which the
        rewrites assume): ``$ref`` (before 2019-09, the keywords beside it are ignored) or ``const``
        (unknown before draft 6). None where there is none."""
        text = json.dumps(node)
        if self.draft < 2019 and '"$ref"' in text:
            return "$ref"
        if self.draft < 6 and '"const"' in text:
            return "const"
        return None

    def rewrite(
        self,
        node: dict[str, Any],
        pointer: str,
        frame: dict[str, UnsatisfiableSchemaError],
        proven: list[UnsatisfiableSchemaError],
    ) -> Any:
        """:meth:`node`'s five steps, in order; subschemas are prepared in step 3 (innermost first), so
        steps 4 and 5 see what became of them. A proof of step 4 is appended to ``proven`` before it is
        raised. A node of ``type`` and annotations alone (:data:`_PLAIN`) takes step 3 only, in :meth:`schema`."""
        out: dict[str, Any] = {}
        written, node = node, dict(node)  # `node` becomes the node with its allOf branches merged in
        referring = "$ref" in node
        if referring:
            self.reference(node, out, pointer)  # 1. to the engine, or an allOf branch beside other keywords
        says_open = says_what_else(node)  # (for step 5, before step 2's merges drop additionalProperties)
        node, inlined = self.merge_all_of(node, pointer)  # 2. allOf branches merged into the node
        self.keywords(node, out, pointer, inlined)  # 3. each keyword to its handler
        if not (referring and self.draft < 2019):  # before 2019-09, $ref alone counts beside other keywords
            self.prove(node, pointer, frame, written, proven)  # 4. no value admitted, or not proven so
        return self.finish(node, out, pointer, says_open)  # 5. the result rewritten for the engines

    # -- 1. references ----------------------------------------------------------------------
    def reference(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        """A ``$ref`` the engine can follow goes to ``out``; beside other keywords it becomes an ``allOf``
        branch of ``node`` (changed in place); a reference that cannot be resolved here is refused."""
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise SchemaError("$ref must be a string", pointer)
        local, reason = self.refs.local(ref)
        if local is None:
            self.refuse(pointer, "$ref", reason)
            return
        ref = local
        self.refs.resolve(ref, pointer)  # fails early on a dangling reference
        out["$ref"] = self.refs.engine_ref(ref, pointer)
        self.mark(pointer, "$ref", "enforced")
        if set(node) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
            # a $ref beside other keywords means allOf(ref, rest) in 2020-12
            siblings = {k: v for k, v in node.items() if k not in ("$ref", "$defs", "definitions")}
            for key in siblings:
                del node[key]
            node["allOf"] = [{"$ref": ref}, siblings]
            del out["$ref"]

    # -- 2. allOf ---------------------------------------------------------------------------
    def merge_all_of(self, node: dict[str, Any], pointer: str) -> tuple[dict[str, Any], list[str]]:
        """``node`` with its ``allOf`` branches merged in (:meth:`References.merge_all_of`: a new dict;
        ``node`` itself where it has none), and the references inlined doing so."""
        if "allOf" not in node:
            return node, []
        node, inlined, exact = self.refs.merge_all_of(node, pointer)
        self.mark(
            pointer,
            "allOf",
            "enforced" if exact else "checked",
            "branches merged" + ("" if exact else " into a superset"),
        )
        return node, inlined

    # -- 3. each keyword --------------------------------------------------------------------
    def keywords(self, node: dict[str, Any], out: dict[str, Any], pointer: str, inlined: list[str]) -> None:
        """Each keyword of ``node`` (the literals first) to its handler, which writes ``out``; the
        references step 2 inlined (``inlined``) are not inlined again below (a recursive ``allOf``)."""
        expanding = self.refs.expanding
        expanding.extend(inlined)
        try:
            if "enum" in node or "const" in node:
                self.literal(node, out, pointer)
            for key, value in node.items():
                if key not in out and key not in ("$ref", "enum", "const", "allOf"):
                    self.keyword(key, value, node, out, pointer)
        finally:
            del expanding[len(expanding) - len(inlined) :]

    def keyword(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        handler = self._HANDLERS.get(key)
        if handler is not None:
            handler(self, key, value, node, out, f"{pointer}/{key}", pointer)
        elif key in ENFORCED:
            out[key] = value
            self.mark(pointer, key, "enforced")
        elif key in OTHER_DRAFTS and (self.draft >= 2019) == OTHER_DRAFTS[key]:
            self.mark(pointer, key, "ignored", f"not a keyword of the schema's draft ({self.draft})")
        elif key in CHECKED:
            self.mark(pointer, key, "checked", "the grammar accepts a superset; validated afterwards")
        elif key in ANNOTATIONS:
            self.mark(pointer, key, "ignored", "annotation")
        elif key in ("$dynamicRef", "$recursiveRef"):
            self.refuse(pointer, key, "dynamic references are not supported")
        else:
            self.mark(pointer, key, "ignored", "unknown keyword")

    # -- 3. enum and const ----------------------------------------------------------------
    def literal(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        for key in ("const", "enum"):
            if key not in node:
                continue
            values = [node[key]] if key == "const" else node[key]
            if key == "enum" and not isinstance(values, list):
                raise SchemaError("enum must be an array", pointer)
            if not values:
                raise UnsatisfiableSchemaError("enum is empty", f"{pointer}/enum")
            if all(not isinstance(v, (dict, list)) for v in values):
                out[key] = node[key]
            else:  # the engine cannot express composite literals: spell each out as a schema
                out["anyOf"] = [literal_schema(v) for v in values]
            self.mark(pointer, key, "enforced")

    # -- 3. the other keywords' handlers -----------------------------------------------------
    def _properties(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError("properties must be an object", at)
        props = {}
        for name, sub in value.items():
            prepared = self.schema(sub, f"{ptr}/{pointer_token(name)}")
            if prepared is False:
                self.mark(f"{ptr}/{pointer_token(name)}", "false", "checked", "a property that must be absent")
                continue
            props[name] = prepared
        out[key] = props
        self.mark(at, key, "enforced")

    def _subschema_map(
        self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str
    ) -> None:
        if not isinstance(value, dict):
            raise SchemaError(f"{key} must be an object", at)
        prepared = {name: self.schema(sub, f"{ptr}/{pointer_token(name)}") for name, sub in value.items()}
        out[key] = {name: ({} if sub is False else sub) for name, sub in prepared.items()}  # false: a superset
        if any(sub is False for sub in prepared.values()):
            self.mark(
                at, key, "checked", "a subschema that admits no value is `true` to the engine; validated afterwards"
            )
        else:
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
            first = self.frames[-1].get(f"{ptr}/0")
            why = f" (branch 0: {first.reason}, at '{first.pointer or '/'}')" if first is not None else ""
            raise UnsatisfiableSchemaError(f"no branch admits a value{why}", ptr)
        out["anyOf"] = live if key == "oneOf" else absorb_branches(live)
        if key == "oneOf":
            self.mark(at, key, "checked", "branches enforced as anyOf; exclusivity validated afterwards")
        else:
            self.mark(at, key, "enforced")

    def _pattern(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if not isinstance(value, str):
            raise SchemaError("pattern must be a string", at)
        search = search_pattern(value)
        if search is None:
            self.mark(at, key, "checked", "an anchor inside an alternative: checked as the string completes")
            return
        try:
            check_regex(search)
        except RuntimeError:
            self.mark(at, key, "checked", "the regex uses features the engine lacks")
            return
        out[key] = search
        if node.get("format") in ENGINE_FORMATS:
            self.mark(at, key, "checked", "xgrammar drops a pattern beside a format: checked as the string completes")
        else:
            self.mark(at, key, "enforced", "search semantics: unanchored ends match anything")

    def _format(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        status = format_status(value) if isinstance(value, str) else "ignored"
        if value in ENGINE_FORMATS:
            out[key] = value
            self.mark(at, key, "enforced")
        elif status == "checked":
            self.mark(at, key, "checked", f"{value!r}: checked by jsonschema's format checker")
        elif status == "approximated":
            self.refuse(at, key, f"{value!r}: no checker for this format here (its library is missing)")
        else:
            self.mark(at, key, "ignored", f"{value!r} is no format JSON Schema defines: an annotation, not checked")

    def _multiple_of(self, key: str, value: Any, node: dict[str, Any], out: dict[str, Any], ptr: str, at: str) -> None:
        if node.get("type") == "integer" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
            if any(bound in node for bound in _NUMBER_BOUNDS):
                self.mark(at, key, "checked", "xgrammar drops multipleOf beside a bound: checked as it is written")
            else:
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
        """Where no other key is allowed (``additionalProperties: false``), the engine is given the patterns
        (as searches, like ``pattern``): its mask then refuses a key, character by character, once no
        declared name nor pattern can match it. In generation mode each pattern's subschema goes with it, so
        that the model writes the value by it; in specification mode the engine takes any value there (the
        subschemas would grow the grammar past what ``engine="auto"`` leaves to xgrammar, and llguidance
        takes an object's declared keys in the schema's order where it has patterns of its own). The
        values stay checked: a key matching a pattern and a declared name must satisfy both. Else, where a
        pattern is one the engine would misread or cannot serve, or two patterns may match one key
        (llguidance refuses those), the keys are checked as they complete."""
        if not isinstance(value, dict):
            raise SchemaError("patternProperties must be an object", at)
        no_others = node.get("additionalProperties") is False
        searches = [search for search in map(search_pattern, value) if search is not None] if no_others else []
        try:
            for search in searches:
                check_regex(search)
        except RuntimeError:
            searches = []
        if not searches or len(searches) < len(value) or not disjoint_searches(searches):
            self.mark(at, key, "checked", "keys matching a pattern are accepted with any value; validated afterwards")
            return
        out[key] = {search: {} for search in searches}
        if self.closed:  # generation: the model writes each key's value by its pattern's schema
            for search, (pattern, sub) in zip(searches, value.items(), strict=True):
                prepared = self.schema(sub, f"{ptr}/{pointer_token(pattern)}")
                out[key][search] = {} if prepared is False else prepared  # false: a superset
        self.mark(
            at, key, "checked", "keys no pattern nor declared name can match are refused by the mask; their "
            "values validated afterwards",
        )  # fmt: skip

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

    # -- 4. no value ------------------------------------------------------------------------
    def prove(
        self,
        node: dict[str, Any],
        pointer: str,
        frame: dict[str, UnsatisfiableSchemaError],
        written: dict[str, Any],
        proven: list[UnsatisfiableSchemaError],
    ) -> None:
        """Raise the proof of :func:`contradiction` (appended to ``proven``) where ``node`` (its allOf
        merged; ``written``: as the schema has it) admits no value, ``frame`` holding its subschemas' proofs."""
        proof = contradiction(node, pointer, frame, self.proof_root, self.draft, written)
        if proof is not None:
            proven.append(proof)
            raise proof

    # -- 5. the result, rewritten for the engines -------------------------------------------
    def finish(self, node: dict[str, Any], out: dict[str, Any], pointer: str, says_open: bool) -> Any:
        """``out`` rewritten, in this order: loosened where a checked keyword would widen it, required keys
        declared, closed (closed mode, where ``node`` does not say what else it holds: ``says_open``),
        integer bounds rounded, lengths beside a pattern or format left to the checks, ``anyOf``
        distributed over the keywords beside it (a single branch left put in its place), each type's
        keywords bound to it. Returns the node prepared (``out`` is changed in place on the way)."""
        self.loosen_for_checked(node, out, pointer)
        declare_required(node, out)
        if self.closed and not says_open:
            self.close(node, out, pointer)
        round_integer_bounds(out)
        if ("pattern" in out or "format" in out) and ("minLength" in out or "maxLength" in out):
            for key in ("minLength", "maxLength"):  # the engine drops lengths beside a pattern or format
                if out.pop(key, None) is not None:
                    self.mark(pointer, key, "checked", "beside a pattern or format: validated afterwards")
        notes: list[str] = []
        out = distribute_any_of(out, pointer, notes)
        for note in notes:
            self.mark(pointer, "anyOf", "checked", note)
        if len(out.get("anyOf", ())) == 1 and out.keys() <= {"anyOf", "$defs", "definitions"}:
            (branch,) = out.pop("anyOf")  # one branch left (the others absorbed, or contradicting): in place
            out = {**out, **branch}
        return split_by_type(out)

    def loosen_for_checked(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        """Keep the grammar a superset where a dropped keyword would have widened what is allowed."""
        widening = _WIDENING if "patternProperties" in out else _WIDENING_UNPATTERNED  # see _pattern_properties
        if "additionalProperties" in out and not node.keys().isdisjoint(widening):
            out.pop("additionalProperties")  # keys the dropped keyword would admit must stay possible
            self.mark(pointer, "additionalProperties", "checked", "relaxed beside patternProperties/unevaluated*")
        if "unevaluatedItems" in node and out.get("items") is False:
            out.pop("items")

    def close(self, node: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
        """Closed mode: an object that declares its keys (``properties``) takes no others; a tuple takes no
        further items. A branch that lists required keys alone is left open: its siblings describe them."""
        if "properties" in node:
            out["additionalProperties"] = False
            self.mark(pointer, "additionalProperties", "enforced", "closed: no keys beyond those declared")
        if "prefixItems" in out and "items" not in out:
            out["items"] = False
            self.mark(pointer, "items", "enforced", "closed: no items beyond prefixItems")


def prepare(schema: Any, *, lenient: bool, closed: bool = False) -> tuple[Any, Coverage]:
    """Return ``(schema for the engine, coverage)``; see the module docstring.

    ``closed``: objects that declare their keys take no others, tuples no further items (see
    :func:`constrain.json_schema`); written into the schema, so both engines read it alike.

    Raises
    ------
    UnsatisfiableSchemaError
        The schema admits no value (proven; in both modes), naming the keyword that leaves none.
    SchemaError
        A dangling ``$ref`` or a malformed keyword (with its JSON pointer).
    UnsupportedSchemaError
        Strict mode, and a keyword that can be neither enforced nor checked.
    """
    schema = resolve_from_resources(schema)
    if (draft := draft_of(schema)) < 2020:
        schema = _as_2020_12(schema, draft)
    preparer = _Preparer(schema, lenient, closed)
    prepared = preparer.schema(schema, "")
    if prepared is False:
        raise preparer.frames[0][""]
    if preparer.refs.alias_defs:
        prepared.setdefault("$defs", {}).update(preparer.refs.alias_defs)
    entries = sorted(preparer.coverage.items())  # by pointer, then keyword
    return prepared, Coverage.from_rows((pointer, keyword, *said) for (pointer, keyword), said in entries)


@bounded("constraints.prepared_schema", maxsize=1024)
def prepared_schema(text: str, lenient: bool, closed: bool) -> tuple[Any, Coverage]:
    """:func:`prepare` of a schema given as JSON text, memoized: :func:`~constrain.json_schema` prepares its
    schema to refuse a bad one at once, and the compile of the same constraint reads it here again (do
    not mutate what it returns). As many entries as the compile cache keeps constraints
    (:data:`~constrain.compiler.compiler.CACHE_MAX_ENTRIES`), so that a request whose constraint is
    compiled already is not prepared again."""
    return prepare(json.loads(text), lenient=lenient, closed=closed)


def _as_2020_12(node: Any, draft: int) -> Any:
    """A copy of a schema of an earlier ``draft`` with the keywords 2020-12 writes otherwise rewritten as it
    writes them, which the walk and the engines read (the value checks read the schema as written):

    - an ``items`` list (a tuple, before 2020-12) becomes ``prefixItems``, and ``additionalItems`` beside it
      ``items``; ``additionalItems`` without an ``items`` list, which the draft ignores, is dropped;
    - draft 4's boolean ``exclusiveMinimum`` and ``exclusiveMaximum`` (which make ``minimum`` and ``maximum``
      exclusive) become numbers: ``{"minimum": 0, "exclusiveMinimum": true}`` is ``{"exclusiveMinimum": 0}``;
      ``false``, or one without its bound, is dropped.

    ``node`` is not mutated."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _as_2020_12(sub, draft) for name, sub in value.items()}
        elif key in SUBSCHEMA_KEYS:
            out[key] = (
                [_as_2020_12(sub, draft) for sub in value] if isinstance(value, list) else _as_2020_12(value, draft)
            )
        else:
            out[key] = value
    rest = out.pop("additionalItems", None)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if rest is not None:
            out["items"] = rest
    if draft == 4:
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(out.get(exclusive), bool) and out.pop(exclusive) and bound in out:
                out[exclusive] = out.pop(bound)
    return out
