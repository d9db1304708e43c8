"""Keywords beyond a grammar, compiled: where in a schema a value stands, and whether it may stand there.

A grammar cannot say "no two items equal" (``uniqueItems``), "a multiple of 0.01", ``not``,
``if``/``then``/``else``, ``dependentRequired``, ``contains`` with ``maxContains``, a ``format`` beyond
its regexes, or that a key written as an extra key of an open object still takes the value schema
``properties`` gives it. :mod:`constrain.constraints.schema` leaves such keywords out of the grammar (a
superset) and marks them; :class:`ValueChecks` is what checking them takes, compiled once per
constraint, and the scanner of :mod:`constrain.match.values` asks it about each value it sees complete.

How a completed value is judged:

- Its *location* in the schema is a disjunction of conjunctions of subschemas
  (:data:`~constrain.match.values.Dnf`): the subschemas every valid document applies to the value
  (``properties``, ``items``, ``$ref``, ``allOf``), with ``anyOf``/``oneOf`` branches as alternatives.
  The location is a *necessary* condition, so a value of a valid document is never refused.
- A value is checked where the grammar is loose at its location (:meth:`ValueChecks.must_check`): a
  subschema there holds a keyword beyond the grammar, or alternatives are to be told apart. Where the
  grammar is loose only *below*, the values below were checked as they completed, and the grammar
  wrote the rest: nothing is asked.
- Where the location has one alternative, each subschema is checked for its keywords beyond the grammar
  alone (its *loose part*: ``uniqueItems``, ``required`` where keys come in any order..., with the
  keywords they are read with), with the verdicts of ``jsonschema`` (the validator of
  :func:`constrain.match.validate.validate`): by jsonschema-rs where it reads the subschema the same
  way (hundreds of times faster on a large value), else by ``jsonschema`` itself. An open object's
  members under declared keys are checked whole, since a declared key may have been written as an
  extra key. Alternatives are checked whole.
- An open container is also checked as it grows, with the keywords no later item can repair
  (``uniqueItems``, ``maxContains``, ``maxProperties``, ``propertyNames``).
- A check never passes for want of an answer: references outside the document stand for ``true``
  (approximated, refused in strict mode), formats are checked, refused or annotations at compile time
  (:mod:`constrain.constraints.formats`), and a check that raises anyway refuses the value.

A grammar's text may also embed JSON values (tool calls' arguments,
:class:`~constrain.constraints.EmbeddedJson`): :class:`CallChecks` holds the checks of each one's schema.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jsonschema_rs
import regex

from constrain import caches
from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded
from constrain.constraints.constraint import NATIVE_VALIDATORS, EmbeddedJson
from constrain.constraints.formats import FORMATS, format_status
from constrain.constraints.schema import CoverageEntry, subschemas
from constrain.constraints.schema_refs import resolve_local
from constrain.constraints.schema_rewrites import says_what_else
from constrain.constraints.schema_unsatisfiable import json_kind
from constrain.match.embedded import CallValues
from constrain.match.keys import Names, written_forms
from constrain.match.numbers import NumberBounds, bounds_of, viable_under
from constrain.match.values import Dnf, ValueState

__all__ = [
    "BEYOND_GRAMMAR",
    "FALSE",
    "KEY_KEYWORDS",
    "MAX_ALTERNATIVES",
    "MEMO_ENTRIES",
    "MEMO_KEY_CHARS",
    "MONOTONE",
    "TRUE",
    "WARM_SECONDS",
    "CallChecks",
    "ValueChecks",
]

_log = logging.getLogger(__name__)
_UNSET = object()
TRUE: Dnf = frozenset({frozenset()})
FALSE: Dnf = frozenset()
MAX_ALTERNATIVES = 64
"""A location with more alternatives than this is not checked (a weaker, still necessary condition)."""

MEMO_ENTRIES = 100_000
"""Entries of each of a :class:`ValueChecks`' two memos (children, verdicts) before it starts over."""

MEMO_KEY_CHARS = 1024
"""Longest value (its text, or a string's length) whose verdict is memoized: a long string or a
growing container is seldom judged twice, and keeping each step of it would hold the square of its size."""

WARM_SECONDS = 0.003
"""About how long a compile spends building value checks ahead of the first tokens (:meth:`ValueChecks.warm`)."""

BEYOND_GRAMMAR = frozenset(
    {
        "uniqueItems", "contains", "minContains", "maxContains", "not", "dependentRequired",
        "dependentSchemas", "dependencies", "if", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "patternProperties", "format", "oneOf", "minProperties", "maxProperties",
    }
)  # fmt: skip
"""Keywords checked wherever they appear (the grammar enforces them loosely, or not at all)."""

_READ_TOGETHER = (
    frozenset({"if", "then", "else"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"prefixItems", "items", "additionalItems"}),
)
"""Keywords one of which is read with the others (``additionalProperties`` applies to the keys neither
``properties`` nor ``patternProperties`` names)."""

_READ_WITH_ALL = frozenset({"unevaluatedProperties", "unevaluatedItems"})
"""Keywords read with every applicator of their subschema: where one is beyond the grammar, all of it is checked."""

_BASE_KEYWORDS = frozenset({"$id", "$anchor", "$dynamicAnchor", "$schema", "id"})
"""Keywords kept in a subschema's loose part for the references inside it to resolve as in the whole."""

KEY_KEYWORDS = frozenset({"required", "minProperties", "maxProperties", "propertyNames", "dependentRequired"})
"""Keywords that read an object's keys alone (``ValueChecks.reads_members``)."""

MONOTONE = ("type", "uniqueItems", "maxProperties", "propertyNames", "contains", "maxContains")
"""Keywords an open container can already break: no item written later repairs them."""


def _and(left: Dnf, right: Dnf) -> Dnf:
    product = frozenset(a | b for a in left for b in right)
    return product if len(product) <= MAX_ALTERNATIVES else left  # too many: keep the weaker side


def _or(parts: Iterable[Dnf]) -> Dnf:
    union = frozenset().union(*parts)
    return TRUE if frozenset() in union or len(union) > MAX_ALTERNATIVES else union


class ValueChecks:
    """What the checks of one JSON Schema constraint need: compiled once, shared by its matchers.

    ``schema`` is the schema as the user wrote it; ``validator`` checks against it (``jsonschema``,
    its draft, formats asserted); ``coverage`` is the preparer's, whose ``checked`` pointers say where the
    grammar accepts a superset; ``everywhere``: keywords under check wherever they appear (the grammar
    is loose on them schema-wide). Thread-safe: its caches only ever gain entries that are equal.

    It lives as long as its compiled constraint (in the compile cache), so its memos are bounded: the
    validators per subschema are as many as the schema has subschemas; the children and verdicts
    each start over at :data:`MEMO_ENTRIES` entries, and no verdict on a value longer than
    :data:`MEMO_KEY_CHARS` is kept. The memos of every live instance are reported together as
    ``"match.checks.memos"`` by :func:`constrain.cache_stats` (hits and misses approximate under
    concurrency: plain counters).
    """

    def __init__(
        self,
        schema: Any,
        validator: Any,
        coverage: Iterable[CoverageEntry],
        everywhere: Iterable[str] = (),
        *,
        closed: bool = False,
    ) -> None:
        self.root = schema
        self.closed = closed  # closed mode: objects that declare their keys take no others (``key_names``)
        self.validator = validator
        self.legacy = "prefixItems" not in validator.VALIDATORS  # draft 7 and before: tuple ``items``
        self.nodes: list[Any] = []  # subschemas by index
        self._index: dict[int, int] = {}
        checked = {(e.pointer, e.keyword) for e in coverage if e.status in ("checked", "approximated")}
        self._loose: dict[int, set[str] | None] = {}  # per own subschema, its keywords beyond the grammar (None: all)
        # per subschema index, those directly inside it and its $ref's; and reversed (``_reaching``): tuples of
        # ints, which the collector leaves alone (see ``_numbered``)
        self._edges: dict[int, tuple[int, ...]] = {}
        self._parents: dict[int, tuple[int, ...]] | None = None
        self._targets: dict[str, Any] = {}  # per local reference, what it names (``_target``)
        self._needing = self._find_needing(checked, set(everywhere))
        self._children: dict[tuple[int, str | int], Dnf] = {}  # by location's number and member: its location
        # the memos are keyed by a location's number (``_number``), not the location: a key of atomic
        # values only is left alone by Python's collector once it has seen it, where a tuple holding a
        # frozenset is walked at every full collection (a third of a process's objects, 80,000, once it
        # had replayed MaskBench's 400-schema sample)
        self._numbered: dict[Dnf, int] = {}
        self._count = itertools.count()  # the next location's number (``next`` is atomic: thread-safe)
        self._verdicts: dict[tuple[int, str, Any], bool] = {}  # by location's number, how judged, the value
        self._validators: dict[tuple[int, bool], Any] = {}  # per subschema index and ``loose``: its validator
        self._members: dict[tuple[int, str], Dnf] = {}  # per subschema index and declared property, its location
        self._prefixes: dict[int, Any] = {}  # per subschema index, its validator as it grows, or None
        self._numbers: dict[Dnf, Any] = {}  # per location, its number alternatives (``_number_alternatives``)
        self._string_bounds: dict[Dnf, int | None] = {}  # per location, ``string_bound``
        self._admits: dict[tuple[int, str], bool] = {}  # by location's number and JSON type, ``admits``
        self._key_names: dict[Dnf, Names] = {}  # per location, ``key_names``
        self._location_flags: dict[Dnf, tuple[bool, bool, bool, bool]] = {}  # per location, ``_flags``
        self._options: dict[bool, dict[str, Any]] = {}  # ``_native_options``
        self.hits = 0  # of the children and verdicts memos
        self.errors = 0  # checks that raised (and so refused: ``_holds``)
        self.misses = 0
        with _live_lock:
            _live.add(self)

    def warm(self, seconds: float = WARM_SECONDS) -> int:
        """Build, for about ``seconds`` (the one under way is finished), the validators that values completed
        at the subschemas holding keywords beyond the grammar are checked with (the root first), and the
        root's location: else the first token completing such a value builds them (a jsonschema-rs
        validator takes 50 µs to tens of milliseconds). What a compile calls. Returns how many were built."""
        end = time.perf_counter() + seconds
        _ = self.root_location  # (a cached property: the first token asks it)
        built = 0
        for index in sorted(self._own):
            if time.perf_counter() >= end:
                break
            self._node_validator(index, loose=True)
            built += 1
        return built

    @property
    def memo_entries(self) -> int:
        """Entries of the children and verdicts memos now."""
        return len(self._children) + len(self._verdicts)

    def initial_state(self, info: TokenizerInfo, *, unique_keys: bool = False) -> ValueState:
        """The scanner's state before any output, for a tokenizer (``unique_keys``: the key guard's too,
        see :class:`~constrain.match.values.ValueState`)."""
        return ValueState.initial(self, info, unique_keys=unique_keys)

    # -- the schema graph -------------------------------------------------------------------
    def _loc(self, node: dict[str, Any]) -> int:
        index = self._index.get(id(node))
        if index is None:
            index = self._index[id(node)] = len(self.nodes)
            self.nodes.append(node)
        return index

    def _target(self, node: dict[str, Any]) -> Any:
        """The subschema ``node["$ref"]`` names, or None (remote, dangling). Memoized per reference (a large
        schema names a few definitions from hundreds of places)."""
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return None
        if ref not in self._targets:
            try:
                self._targets[ref] = resolve_local(self.root, ref)
            except LookupError:
                self._targets[ref] = None
        return self._targets[ref]

    def _find_needing(self, checked: set[tuple[str, str]], everywhere: set[str]) -> frozenset[int]:
        """The subschemas under which some keyword is beyond the grammar (themselves included). Records,
        per subschema that holds one itself (``_own``), which keywords those are (``_loose``)."""
        edges: dict[int, tuple[int, ...]] = {}
        stack: list[Any] = [self.root]
        members: list[dict[str, Any]] = []  # the declared members' subschemas where the grammar leaves them loose
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or (index := self._loc(node)) in edges:
                continue
            loose = self._beyond(node) | {key for key in everywhere if key in node}
            if loose:
                self._loose[index] = loose
            if "properties" in loose and isinstance(node["properties"], dict):  # (loose there: schema-wide)
                members += [sub for sub in node["properties"].values() if isinstance(sub, dict)]
            subs = [*subschemas(node), self._target(node)]
            edges[index] = tuple(self._loc(sub) for sub in subs if isinstance(sub, dict))
            stack += subs
        self._edges = edges
        # an open object's grammar lets a declared key's value be any JSON value (specification mode): each
        # such value is checked whole as it completes (and refused where it begins, when its type cannot
        # be valid), not only with the object, which a value that cannot be valid left at a dead end
        for member in members:
            self._loose[self._loc(member)] = None
        for pointer, keyword in checked:
            if pointer == "" and keyword in everywhere:
                continue  # schema-wide: each subschema holding the keyword has it above
            node, exact = self._deepest(pointer)
            if not isinstance(node, dict):
                continue
            index = self._loc(node)
            known = self._loose.get(index, set())
            # a keyword of that very subschema; else (a place the preparer made): all of it is checked
            self._loose[index] = None if known is None or not exact or keyword not in node else known | {keyword}
        self._own = frozenset(self._loose)
        return frozenset(self._reaching(self._own))

    def _reaching(self, seeds: Iterable[int]) -> set[int]:
        """The subschemas from which one of ``seeds`` can be reached (inside them, or through a ``$ref``),
        the seeds included."""
        if self._parents is None:
            parents: dict[int, list[int]] = {}
            for parent, children in self._edges.items():
                for child in children:
                    parents.setdefault(child, []).append(parent)
            self._parents = {child: tuple(found) for child, found in parents.items()}
        found = set(seeds)
        frontier = list(found)
        while frontier:
            for parent in self._parents.get(frontier.pop(), ()):
                if parent not in found:
                    found.add(parent)
                    frontier.append(parent)
        return found

    def _deepest(self, pointer: str) -> tuple[Any, bool]:
        """The deepest subschema of the document on ``pointer``'s path, and whether it is the one the
        pointer names: a coverage pointer may name a place the preparer made (inside merged ``allOf``
        branches), checked from the node that holds it."""
        node, found, exact = self.root, self.root, True
        for raw in pointer.split("/")[1:]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                exact = False
                break
            if isinstance(node, dict):
                found = node
        return found, exact and found is node

    @staticmethod
    def _beyond(node: dict[str, Any]) -> set[str]:
        """The keywords of ``node`` beyond the grammar wherever they appear."""
        found = {key for key in node.keys() & BEYOND_GRAMMAR if node[key] is not False}
        if not isinstance(node.get("format"), str) or format_status(node["format"]) != "checked":
            found.discard("format")  # an annotation, or a format no checker here runs (refused, or lenient)
        required, described = node.get("required"), node.get("properties")
        if isinstance(required, list) and not set(required) <= set(described if isinstance(described, dict) else ()):
            found.add("required")  # a required key the properties do not describe: the engines may let it be skipped
        step = node.get("multipleOf")
        if step is not None and not (isinstance(step, int) and node.get("type") == "integer"):
            found.add("multipleOf")
        return found

    # -- locations --------------------------------------------------------------------------
    @functools.cached_property
    def root_location(self) -> Dnf:
        return self.expand(self.root)

    def expand(self, node: Any, visiting: frozenset[int] = frozenset()) -> Dnf:
        """The location of a value ``node`` applies to: ``node`` and, at the same value, its ``$ref``,
        ``allOf`` members and ``anyOf``/``oneOf`` branches (as alternatives)."""
        if node is False:
            return FALSE
        if not isinstance(node, dict) or id(node) in visiting:
            return TRUE
        visiting |= {id(node)}
        target = self._target(node)
        if target is not None and self.legacy:
            return self.expand(target, visiting)  # draft 7 and before: a $ref's siblings are ignored
        location: Dnf = frozenset({frozenset({self._loc(node)})})
        if target is not None:
            location = _and(location, self.expand(target, visiting))
        for member in node.get("allOf", ()) if isinstance(node.get("allOf"), list) else ():
            location = _and(location, self.expand(member, visiting))
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                location = _and(location, _or(self.expand(branch, visiting) for branch in node[key]))
        return location

    def child(self, location: Dnf, key: str | int) -> Dnf:
        """The location of member ``key`` (a str) of an object, or item ``key`` (an int) of an array."""
        memo_key = (self._number(location), key)
        found = self._children.get(memo_key)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        found = _or(self._child_alternative(alternative, key) for alternative in location)
        if len(self._children) >= MEMO_ENTRIES:
            self._children.clear()
        self._children[memo_key] = found
        return found

    def _child_alternative(self, alternative: frozenset[int], key: str | int) -> Dnf:
        location = TRUE
        for index in alternative:
            location = _and(location, self._child_of(self.nodes[index], key))
            if not location:
                break
        return location

    def _child_of(self, node: dict[str, Any], key: str | int) -> Dnf:
        types = node.get("type")
        if isinstance(types, str):
            types = [types]
        kind = "object" if isinstance(key, str) else "array"
        if isinstance(types, list) and kind not in types:
            return FALSE  # this alternative is not a container of that kind
        parts: list[Any] = []
        if isinstance(key, str):
            properties = node.get("properties")
            if isinstance(properties, dict) and key in properties:
                parts.append(properties[key])
            patterns = node.get("patternProperties")
            for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
                if _search(pattern, key):
                    parts.append(sub)
            if not parts and "additionalProperties" in node:
                parts.append(node["additionalProperties"])
        else:
            tuple_key = "items" if self.legacy else "prefixItems"
            rest_key = "additionalItems" if self.legacy else "items"
            prefix = node.get(tuple_key)
            if isinstance(prefix, list) and key < len(prefix):
                parts.append(prefix[key])
            elif isinstance(prefix, list) or not self.legacy:
                parts += [node[rest_key]] if rest_key in node else []
            elif "items" in node:
                parts.append(node["items"])
        location = TRUE
        for part in parts:
            location = _and(location, self.expand(part))
        return location

    def _number(self, location: Dnf) -> int:
        """``location``'s number in the verdicts' keys: the same for equal locations, never reused."""
        found = self._numbered.get(location)
        if found is None:
            if len(self._numbered) >= MEMO_ENTRIES:
                self._numbered.clear()  # (a location numbered again only misses the entries of its old number)
            found = self._numbered.setdefault(location, next(self._count))
        return found

    # -- checks -----------------------------------------------------------------------------
    def needs(self, location: Dnf) -> bool:
        """Whether the grammar alone is not exact at ``location`` (there or below)."""
        return self._flags(location)[0]

    def must_check(self, location: Dnf) -> bool:
        """Whether a value completed at ``location`` is checked: the grammar is not exact there, and either
        a subschema there holds a keyword beyond it, or alternatives are to be told apart. (Where the
        grammar is loose only below, the values below were checked as they completed.)"""
        flags = self._flags(location)
        return flags[0] and (flags[1] or len(location) > 1)

    def has_own(self, location: Dnf) -> bool:
        """Whether a subschema at ``location`` holds a keyword beyond the grammar itself (not only below)."""
        return self._flags(location)[1]

    def grows_checked(self, location: Dnf) -> bool:
        """Whether an open container at ``location`` is checked as it grows."""
        return self._flags(location)[2]

    def reads_members(self, location: Dnf) -> bool:
        """Whether a check of an object at ``location`` reads its members' values: False where it has one
        alternative whose keywords beyond the grammar read the keys alone (:data:`KEY_KEYWORDS`); the
        scanner then keeps no member's value there (a string's text inside is not even kept)."""
        return self._flags(location)[3]

    def _flags(self, location: Dnf) -> tuple[bool, bool, bool, bool]:
        """``needs``, ``has_own``, ``grows_checked`` and ``reads_members`` of ``location``, worked out once
        (the scanner asks them of every open container at every step)."""
        found = self._location_flags.get(location)
        if found is None:
            indices = {index for alternative in location for index in alternative}
            loose = [self._loose.get(index, set()) for index in indices]
            found = (
                not indices.isdisjoint(self._needing),
                not indices.isdisjoint(self._own),
                any(self._prefix(index) is not None for index in indices),
                len(location) > 1 or any(keywords is None or not keywords <= KEY_KEYWORDS for keywords in loose),
            )
            if len(self._location_flags) >= MEMO_ENTRIES:
                self._location_flags.clear()
            self._location_flags[location] = found
        return found

    def accepts(self, location: Dnf, value: Any, *, prefix: bool = False, whole: bool = False) -> bool:
        """Whether ``value`` may stand at ``location`` (every subschema of some alternative holds); with
        ``prefix``, whether the open container ``value`` (its completed items or members) may still grow
        into one. Memoized per value (up to :data:`MEMO_KEY_CHARS` characters).

        Where ``location`` has one alternative, each subschema is checked for its keywords beyond the
        grammar alone (``_loose``): the grammar wrote the value, and checked what is below as it
        completed. ``whole``: every keyword (a value the grammar wrote by another path: an open object's
        extra key that a declared key took)."""
        scalar = value is None or isinstance(value, (str, int, float))
        as_key = (type(value), value) if scalar else json.dumps(value, sort_keys=True)
        valid: Callable[[int, Any], bool]
        if prefix:
            how, valid = "prefix", self._prefix_valid
        elif whole or len(location) > 1:
            how, valid = "whole", self._valid
        else:
            how, valid = "loose", self._loose_valid
        key = (self._number(location), how, as_key)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self.hits += 1
            return verdict
        self.misses += 1
        verdict = any(all(valid(index, value) for index in alternative) for alternative in location)
        chars = len(value) if isinstance(value, str) else 0 if scalar else len(as_key)
        if chars <= MEMO_KEY_CHARS:
            if len(self._verdicts) >= MEMO_ENTRIES:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def number_checked(self, location: Dnf) -> bool:
        """Whether a number at ``location`` is checked as it is written (:mod:`constrain.match.numbers`)."""
        return self._number_alternatives(location) is not None

    def number_viable(self, location: Dnf, text: bytes) -> bool:
        """Whether the number prefix ``text`` (a scalar being written) can still end valid at ``location``
        (:func:`~constrain.match.numbers.number_prefix_viable`). Memoized with the verdicts."""
        alternatives = self._number_alternatives(location)
        if alternatives is None:
            return True
        key = (self._number(location), "number", text)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = viable_under(text.decode("ascii", "replace"), alternatives)
            if len(self._verdicts) >= MEMO_ENTRIES:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def admits(self, location: Dnf, kind: str) -> bool:
        """Whether a value of JSON type ``kind`` ("string", "number", "boolean", "null", "array" or "object")
        may be valid at ``location``, as the ``type``, ``const`` and ``enum`` of its subschemas say: False
        only where each alternative has a subschema that rules the type out (a value that cannot be valid,
        refused where it begins). Memoized per location and type."""
        key = (self._number(location), kind)
        found = self._admits.get(key)
        if found is None:
            found = any(all(_admits(self.nodes[index], kind) for index in alternative) for alternative in location)
            if len(self._admits) >= MEMO_ENTRIES:
                self._admits.clear()
            self._admits[key] = found
        return found

    def string_bound(self, location: Dnf) -> int | None:
        """The most characters a string at ``location`` may hold, where its ``maxLength`` is beyond the
        grammar (checked as the string is written: :mod:`constrain.match.lengths`): the largest that any
        alternative allows. None where some alternative has no such bound (the grammar's, if any, holds)."""
        if location in self._string_bounds:
            return self._string_bounds[location]
        found: int | None = None
        for alternative in location:
            limits = [limit for index in alternative if (limit := self._checked_length(index)) is not None]
            if not limits:
                found = None
                break
            found = max(found or 0, min(limits))
        if len(self._string_bounds) >= MEMO_ENTRIES:
            self._string_bounds.clear()
        self._string_bounds[location] = found
        return found

    def key_names(self, location: Dnf) -> Names:
        """The keys an object at ``location`` may hold, as written (:func:`~constrain.match.keys.written_forms`),
        where they are a finite set: per alternative, the properties of its subschemas that take no
        others (``additionalProperties: false``, no ``patternProperties``; those of all of them), or in
        closed mode, where one declares ``properties`` and none says what else it holds, every one they
        declare or require (closing takes each object as its subschemas merge); the union over the
        alternatives. None where some alternative may take other keys. The key guard refuses a key that
        cannot become one of them as it is written (:mod:`constrain.match.keys`)."""
        if location in self._key_names:
            return self._key_names[location]
        parts = [self._alternative_names(alternative) for alternative in location]
        found = None if any(part is None for part in parts) else written_forms(set().union(*parts))  # type: ignore[arg-type]
        if len(self._key_names) >= MEMO_ENTRIES:
            self._key_names.clear()
        self._key_names[location] = found
        return found

    def _alternative_names(self, alternative: frozenset[int]) -> set[str] | None:
        """The keys an object may hold where every subschema of ``alternative`` applies (``key_names``)."""
        taken: set[str] | None = None  # the properties of those that take no others, in common
        declared: set[str] = set()
        says_open, closes = False, False  # closed mode closes an object where some subschema declares properties
        for index in alternative:
            node = self.nodes[index]
            types = node.get("type")
            if (isinstance(types, str) and types != "object") or (isinstance(types, list) and "object" not in types):
                return set()  # no object stands here
            properties = node.get("properties")
            own = set(properties) if isinstance(properties, dict) else set()
            closes = closes or isinstance(properties, dict)
            if node.get("additionalProperties") is False and not node.get("patternProperties"):
                taken = own if taken is None else taken & own
            required = node.get("required") if isinstance(node.get("required"), list) else ()
            declared |= own | {key for key in required if isinstance(key, str)}
            says_open = says_open or says_what_else(node)
        if taken is None and self.closed and closes and not says_open:
            return declared
        return taken

    def _checked_length(self, index: int) -> int | None:
        """Subschema ``index``'s ``maxLength`` where it is beyond the grammar, else None."""
        limit, loose = self.nodes[index].get("maxLength"), self._loose.get(index, set())
        if loose is not None and "maxLength" not in loose:
            return None
        number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
        return math.floor(limit) if number and limit >= 0 else None

    def _number_alternatives(self, location: Dnf) -> list[list[NumberBounds]] | None:
        """Per alternative of ``location``, its subschemas' :class:`NumberBounds`; None where some
        alternative asks nothing a number prefix could break (then none is checked)."""
        found = self._numbers.get(location, _UNSET)
        if found is _UNSET:
            alternatives = [[b for i in alt if (b := bounds_of(self.nodes[i])) is not None] for alt in location]
            found = None if not alternatives or not all(alternatives) else alternatives
            self._numbers[location] = found
        return found  # type: ignore[no-any-return]

    def _node_validator(self, index: int, loose: bool = False) -> Any:
        """Subschema ``index``'s validator: all its keywords, or (``loose``) those beyond the grammar with
        the keywords they are read with (None where that is none: the grammar is exact there)."""
        found = self._validators.get((index, loose), _UNSET)
        if found is _UNSET:
            kept = self._loose_schema(index) if loose else self.nodes[index]
            found = None if kept is None else self._validator_of(index, kept)
            self._validators[index, loose] = found
        return found

    def _loose_schema(self, index: int) -> dict[str, Any] | None:
        """The part of subschema ``index`` the grammar does not enforce: its ``_loose`` keywords and those
        they are read with (``then`` beside ``if``...); the whole subschema where that cannot be told."""
        node: dict[str, Any] = self.nodes[index]
        loose = self._loose.get(index, set())
        if loose is None or loose & _READ_WITH_ALL:
            return node
        kept = set(loose) - {"properties"}  # the declared members: checked whole, each (``_loose_valid``)
        for group in _READ_TOGETHER:
            if kept & group:
                kept |= group
        kept = {key for key in kept | _BASE_KEYWORDS if key in node}
        return {key: node[key] for key in kept} if kept - _BASE_KEYWORDS else None

    def _loose_valid(self, index: int, value: Any) -> bool:
        """Whether ``value`` holds the keywords of subschema ``index`` beyond the grammar; the members of an
        object under a declared key are checked whole where the schema-wide looseness of open objects
        applies (a declared key written as an extra key took the extra keys' schema)."""
        validator = self._node_validator(index, loose=True)
        if validator is not None and not self._holds(validator, value):
            return False
        loose, node = self._loose.get(index), self.nodes[index]
        if loose is None or "properties" not in loose or not isinstance(value, dict):
            return True
        declared = node.get("properties")
        return not isinstance(declared, dict) or all(
            self.accepts(self._member_location(index, name), member, whole=True)
            for name, member in value.items()
            if name in declared
        )

    def _member_location(self, index: int, name: str) -> Dnf:
        """The location of subschema ``index``'s declared property ``name``."""
        found = self._members.get((index, name))
        if found is None:
            found = self._members[index, name] = self.expand(self.nodes[index]["properties"][name])
        return found

    def _valid(self, index: int, value: Any) -> bool:
        """Whether ``value`` holds every keyword of subschema ``index``."""
        return self._holds(self._node_validator(index), value)

    def _holds(self, validator: Any, value: Any) -> bool:
        """``validator.is_valid(value)``; False where the check raises (counted in ``errors``, logged once):
        a check that cannot decide refuses, never passes. None is known to raise: references outside the
        document stand for ``true`` (approximated, refused in strict mode), formats without a checker are
        refused or annotations at compile time."""
        try:
            return bool(validator.is_valid(value))
        except Exception as err:
            self.errors += 1
            if self.errors == 1:
                _log.warning("a value check raised, so the value is refused: %r", err)
            return False

    def _prefix(self, index: int) -> Any:
        """A validator for what an open container at subschema ``index`` can already break, or None."""
        if index not in self._prefixes:
            self._prefixes[index] = self._prefix_checker(index)
        return self._prefixes[index]

    def _prefix_checker(self, index: int) -> Any:
        node = self.nodes[index]
        kept = {key: node[key] for key in MONOTONE if key in node}
        if self.legacy or "maxContains" not in kept:
            kept.pop("contains", None)
        if "contains" in kept:
            kept["minContains"] = 0
        if kept.get("uniqueItems") is False:
            del kept["uniqueItems"]
        if set(kept) <= {"type"}:
            return None
        return self._validator_of(index, kept)

    def _validator_of(self, index: int, kept: dict[str, Any]) -> Any:
        """A validator of ``kept`` (some keywords of subschema ``index``): jsonschema-rs, hundreds of times
        faster, where it reads them as ``jsonschema`` does (:meth:`_native_reading`); else ``jsonschema``."""
        native = NATIVE_VALIDATORS.get(type(self.validator).__name__)
        reading = self._native_reading(index)
        if native is None or reading is None:
            return self.validator.evolve(schema=kept)
        try:
            return _Native(native(_rooted(kept), **self._native_options(reading)), self.validator, kept)
        except Exception:  # a schema jsonschema-rs refuses to build (it validates schemas; jsonschema does not)
            return self.validator.evolve(schema=kept)

    def _native_options(self, objects: bool) -> dict[str, Any]:
        """How jsonschema-rs is built for this schema: its references into the document resolved, every
        format checked by this package's checkers (none it does not know), ``pattern`` searched by ``regex``,
        ``multipleOf`` by ``jsonschema`` (:func:`_python_multiple_of`) and (``objects``) ``patternProperties``
        and ``additionalProperties`` too (:func:`_object_keywords`). Memoized."""
        if objects in self._options:
            return self._options[objects]
        options: dict[str, Any] = {
            "registry": jsonschema_rs.Registry([(_ROOT_URI, self.root)]),
            "base_uri": _ROOT_URI + "/node",
            "formats": _FORMAT_CHECKERS,
            "validate_formats": True,
            "keywords": {"pattern": _SearchPattern, "multipleOf": _python_multiple_of(type(self.validator))},
        }
        if objects:
            native = NATIVE_VALIDATORS[type(self.validator).__name__]
            options["keywords"] = {
                **options["keywords"],
                **_object_keywords(lambda sub: native(_rooted(sub), **options)),
            }
        self._options[objects] = options
        return options

    def _native_reading(self, index: int) -> bool | None:
        """How jsonschema-rs reads subschema ``index`` and every subschema it reaches as ``jsonschema`` does:
        ``False``, with ``pattern`` alone searched by ``regex`` (:class:`_SearchPattern`); ``True``, with
        ``patternProperties`` and ``additionalProperties`` too (some subschema has ``patternProperties``:
        ECMA 262 regexes there); None where it cannot: references beyond the document
        (``true`` here), an ``$id`` below the root (a base URI of its own), dynamic references,
        ``unevaluatedProperties`` (the annotations of the keywords read in Python are not seen)."""
        if index not in self._edges:  # a subschema the walk did not reach (a place on a coverage pointer)
            node = self.nodes[index]
            return None if self._foreign(node) else "patternProperties" in node
        foreign, objects = self._native_readings
        return None if index in foreign else index in objects

    def _foreign(self, node: dict[str, Any]) -> bool:
        """Whether jsonschema-rs reads ``node``'s own keywords otherwise (see :meth:`_native_reading`)."""
        ref = node.get("$ref")
        own = _NOT_NATIVE & set(node) - (_ROOT_IDS if node is self.root else set())
        dropped = "dependencies" in node and type(self.validator).__name__ in _DEPENDENCIES_DROPPED
        return bool(own) or dropped or (isinstance(ref, str) and not ref.startswith("#"))

    @functools.cached_property
    def _native_readings(self) -> tuple[set[int], set[int]]:
        """The subschemas reaching one that jsonschema-rs cannot read as ``jsonschema`` does, and those
        reaching a ``patternProperties`` (see :meth:`_native_reading`): worked out once."""
        known = [(index, self.nodes[index]) for index in self._edges]
        return (
            self._reaching(index for index, node in known if self._foreign(node)),
            self._reaching(index for index, node in known if "patternProperties" in node),
        )

    def _prefix_valid(self, index: int, value: Any) -> bool:
        checker = self._prefix(index)
        return checker is None or self._holds(checker, value)


_live: weakref.WeakSet[ValueChecks] = weakref.WeakSet()
"""Every :class:`ValueChecks` alive (one per compiled JSON Schema constraint that needs checks)."""
_live_lock = threading.Lock()


def _memo_figures() -> dict[str, int]:
    """The live value checks' memos together: entries, hits, misses, and their bound (``maxsize``:
    both memos of every instance, or of one while none lives)."""
    with _live_lock:
        live = list(_live)
    return {
        "instances": len(live), "entries": sum(c.memo_entries for c in live),
        "maxsize": 2 * MEMO_ENTRIES * max(len(live), 1),
        "hits": sum(c.hits for c in live), "misses": sum(c.misses for c in live),
    }  # fmt: skip


caches.register("match.checks.memos", _memo_figures)


_NOT_NATIVE = frozenset({"unevaluatedProperties", "$id", "id", "$dynamicRef", "$recursiveRef"})
"""Keywords jsonschema-rs reads otherwise (see :meth:`ValueChecks._native_reading`)."""

_DEPENDENCIES_DROPPED = frozenset({"Draft201909Validator", "Draft202012Validator"})
"""The drafts without ``dependencies`` (split into ``dependentRequired`` and ``dependentSchemas``), which
jsonschema-rs still applies there: a node holding it is read by ``jsonschema``, which ignores it."""

_ROOT_IDS = frozenset({"$id", "id"})
"""The root's own base URI changes nothing: its ``#...`` references still point into the document."""

_FORMAT_NAMES = frozenset(FORMATS.checkers) | {
    "date", "date-time", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    "regex", "uuid",
}  # fmt: skip
"""Every format either package checks: each goes to this package's checkers (one it has none for passes)."""

_FORMAT_CHECKERS = {name: functools.partial(FORMATS.conforms, format=name) for name in _FORMAT_NAMES}
"""jsonschema-rs's ``formats``: one for every schema (a copy per schema was 12,000 of the objects Python's
collector walks at each full collection once MaskBench's 400-schema sample was compiled)."""

_ROOT_URI = "urn:constrain:schema"
"""Where jsonschema-rs finds the document a subschema's ``#...`` references point into."""


def _rooted(node: Any) -> Any:
    """``node`` with its ``#...`` references made absolute (into the document at :data:`_ROOT_URI`)."""
    if isinstance(node, list):
        return [_rooted(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {
        key: _ROOT_URI + value
        if key == "$ref" and isinstance(value, str) and value.startswith("#")
        else value
        if key in _LITERALS
        else _rooted(value)
        for key, value in node.items()
    }


_LITERALS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON values, not schemas: :func:`_rooted` leaves them as they are."""


class _SearchPattern:
    """``pattern`` for jsonschema-rs as ``jsonschema`` reads it: a search (``$`` matches before a final
    newline there, not in ECMA 262), by the ``regex`` module, which reads Python's syntax and ECMA 262's
    Unicode properties (``\\p{L}``) too."""

    def __init__(self, parent_schema: dict[str, Any], value: str, schema_path: list[str | int]) -> None:
        self.pattern = regex.compile(value)

    def validate(self, instance: Any) -> None:
        if isinstance(instance, str) and self.pattern.search(instance) is None:
            raise ValueError(f"{instance!r} does not match {self.pattern.pattern!r}")


def _admits(node: dict[str, Any], kind: str) -> bool:
    """Whether ``node``'s own ``type``, ``const`` and ``enum`` let a value of JSON type ``kind`` be valid."""
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list) and kind not in types and not (kind == "number" and "integer" in types):
        return False
    if "const" in node and json_kind(node["const"]) != kind:
        return False
    values = node.get("enum")
    return not isinstance(values, list) or any(json_kind(value) == kind for value in values)


@bounded("match.checks.multiple_of", maxsize=16)
def _python_multiple_of(python: type) -> type:
    """``multipleOf`` for jsonschema-rs as ``python`` (a ``jsonschema`` validator class, which the output is
    validated with) reads it: jsonschema-rs divides floats exactly, so ``0.07`` is a multiple of ``0.01``
    there and not in ``jsonschema``."""

    class MultipleOf:
        def __init__(self, parent_schema: dict[str, Any], value: Any, schema_path: list[str | int]) -> None:
            self.python = python({"multipleOf": value})

        def validate(self, instance: Any) -> None:
            if not self.python.is_valid(instance):
                raise ValueError(f"{instance!r} is not a multiple of {self.python.schema['multipleOf']!r}")

    return MultipleOf


def _object_keywords(build: Callable[[Any], Any]) -> dict[str, Callable[..., Any]]:
    """``patternProperties`` and ``additionalProperties`` for jsonschema-rs as ``jsonschema`` reads them:
    a key matches a pattern by a search (the ``regex`` module), and is additional where it is neither declared nor
    matches the patterns joined by ``|``. ``build``: a native validator of a subschema.

    The subschemas' validators are memoized by their JSON text (a schema repeats ``additionalProperties: {}``
    hundreds of times). A subschema that reaches itself (through a ``$ref``) reads its own validator from the
    memo at its first value: built when met, each built the next, until Python's recursion limit.
    """
    built: dict[str, Any] = {}  # per subschema's JSON text, its validator (None while it is being built)
    lock = threading.RLock()  # one build at a time: another thread would read a None

    def validator(sub: Any) -> Any:
        key = json.dumps(sub, sort_keys=True)
        with lock:
            if key not in built:
                built[key] = None
                try:
                    built[key] = build(sub)
                except BaseException:
                    del built[key]  # the validator holding this one fails to build too
                    raise
            found = built[key]
            return _Built(built, key) if found is None else found

    return {
        "patternProperties": functools.partial(_PatternProperties, validator),
        "additionalProperties": functools.partial(_AdditionalProperties, validator),
    }


class _PatternProperties:
    """jsonschema-rs's ``patternProperties`` (see :func:`_object_keywords`); ``validator``: a subschema's."""

    __slots__ = ("patterns",)

    def __init__(
        self, validator: Callable[[Any], Any], parent: dict[str, Any], value: dict[str, Any], path: Any
    ) -> None:
        self.patterns = [(regex.compile(pattern), validator(sub)) for pattern, sub in value.items()]

    def validate(self, instance: Any) -> None:
        if not isinstance(instance, dict):
            return
        for key, member in instance.items():
            for pattern, validator in self.patterns:
                if pattern.search(key) is not None and not validator.is_valid(member):
                    raise ValueError(f"{key!r}: {member!r} is not valid under {pattern.pattern!r}")


class _AdditionalProperties:
    """jsonschema-rs's ``additionalProperties`` (see :func:`_object_keywords`); ``validator``: a subschema's."""

    __slots__ = ("anything", "declared", "patterns", "validator")

    def __init__(self, validator: Callable[[Any], Any], parent: dict[str, Any], value: Any, path: Any) -> None:
        declared, patterns = parent.get("properties"), parent.get("patternProperties")
        self.declared = frozenset(declared) if isinstance(declared, dict) else frozenset()
        self.patterns = regex.compile("|".join(patterns)) if isinstance(patterns, dict) and patterns else None
        self.anything = value is True
        self.validator = validator(value) if isinstance(value, dict) else None

    def validate(self, instance: Any) -> None:
        if not isinstance(instance, dict) or self.anything:
            return
        for key, member in instance.items():
            if key in self.declared or (self.patterns is not None and self.patterns.search(key) is not None):
                continue
            if self.validator is None or not self.validator.is_valid(member):
                raise ValueError(f"{key!r} is not allowed here")


class _Built:
    """The validator of a subschema that reaches itself, read from the memo of :func:`_object_keywords` at its
    first value (its build is over by then)."""

    __slots__ = ("built", "key")

    def __init__(self, built: dict[str, Any], key: str) -> None:
        self.built = built
        self.key = key

    def is_valid(self, value: Any) -> bool:
        return bool(self.built[self.key].is_valid(value))


class _Native:
    """A jsonschema-rs validator, with ``jsonschema``'s to fall back on where it raises (a number past 64
    bits, say): ``is_valid`` alone, what the checks ask. ``jsonschema``'s is made from ``base`` (a validator of
    the whole schema) at each fallback: kept, it was 5 objects more per subschema for Python's collector to
    walk."""

    __slots__ = ("base", "native", "schema")

    def __init__(self, native: Any, base: Any, schema: Any) -> None:
        self.native = native
        self.base = base
        self.schema = schema

    @property
    def python(self) -> Any:
        """``jsonschema``'s validator of the same ``schema``."""
        return self.base.evolve(schema=self.schema)

    def is_valid(self, value: Any) -> bool:
        try:
            return bool(self.native.is_valid(value))
        except (ValueError, OverflowError):
            return bool(self.python.is_valid(value))


@bounded("match.checks.patterns", maxsize=1024)
def _compiled_pattern(pattern: str) -> Any:
    try:
        return regex.compile(pattern)
    except regex.error:
        return None


def _search(pattern: str, key: str) -> bool:
    """Whether ``patternProperties``' ``pattern`` matches ``key`` (an unreadable pattern matches all:
    the weaker condition)."""
    compiled = _compiled_pattern(pattern)
    return compiled is None or compiled.search(key) is not None


class CallChecks:
    """The checks of a text that embeds JSON values (:class:`~constrain.constraints.EmbeddedJson`, the
    arguments of tool calls): per name, the :class:`ValueChecks` of its schema. Shared like them."""

    def __init__(self, embedded: EmbeddedJson, checks: dict[str, ValueChecks]) -> None:
        self.trigger = embedded.trigger.encode()
        opener, name_end = regex.escape(embedded.opener.encode()), regex.escape(embedded.name_end.encode())
        self.opener = regex.compile(opener + rb'([^"\\]{1,64})' + name_end)  # group 1: the name
        self.checks = checks
        self.keep = max(len(self.trigger), len(embedded.opener) + 64 + len(embedded.name_end))

    def initial_state(self, info: TokenizerInfo) -> CallValues:
        """The scanner's state before any output, for a tokenizer."""
        return CallValues.initial(self, info)
