"""Keywords beyond a grammar, enforced while generating: each value is checked as it completes.

A grammar cannot say "no two items equal" (``uniqueItems``), "a multiple of 0.01", ``not``,
``if``/``then``/``else``, ``dependentRequired``, ``contains`` with ``maxContains``, a ``format`` beyond
its regexes, or that a key written as an extra key of an open object still takes the value schema
``properties`` gives it. :mod:`constrain.constraints.schema` leaves such keywords out of the grammar (a superset) and
marks them; here the :class:`~constrain.match.matcher.Matcher` enforces them at *value boundaries*: the
token that would complete a value (a string's closing quote, a number's end, an item's ``,`` or
``]``, an object's ``}``, EOS after a root scalar) is masked out when the completed value cannot be
valid, and the model writes another value instead.

How a completed value is judged:

- Its *location* in the schema is a disjunction of conjunctions of subschemas (:data:`Dnf`): the
  subschemas every valid document applies to the value (``properties``, ``items``, ``$ref``,
  ``allOf``), with ``anyOf``/``oneOf`` branches as alternatives. Each subschema is checked exactly
  by ``jsonschema`` (the same validator as :func:`constrain.match.validate.validate`); the location is a
  *necessary* condition, so a value of a valid document is never refused. At the root the location is
  the schema itself: the whole document is checked exactly before it can end.
- An open container is also checked as it grows, with the keywords no later item can repair
  (``uniqueItems``, ``maxContains``, ``maxProperties``, ``propertyNames``).
- Only where a subschema below holds a keyword the grammar does not enforce (:meth:`ValueChecks.needs`):
  elsewhere the grammar is exact and nothing is scanned.

A grammar's text may also embed JSON values (tool calls' arguments, :class:`~constrain.constraints.EmbeddedJson`):
:class:`CallValues` follows the text between them only to find where the next one starts, and checks each
as above against its own schema.

When every token the grammar allows would complete an invalid value (no valid continuation), the
mask is left as the grammar filled it and the matcher records a *dead end*: the result's violations
then come from post-validation, and the dead end says why they could not be avoided.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import regex
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.constraints.constraint import EmbeddedJson
from constrain.constraints.schema import SCHEMA_LISTS, SCHEMA_MAPS, SINGLE_SCHEMAS, CoverageEntry, resolve_local
from constrain.match.keys import clear_bits

__all__ = ["DEAD_END", "HEADED_FOR_DEAD_END", "VIABLE", "CallChecks", "CallValues", "ValueChecks", "ValueState"]

Dnf = frozenset[frozenset[int]]
"""A location: alternatives (any may hold), each a set of subschemas (all must hold), by index."""

TRUE: Dnf = frozenset({frozenset()})
FALSE: Dnf = frozenset()
MAX_ALTERNATIVES = 64
"""A location with more alternatives than this is not checked (a weaker, still necessary condition)."""

BEYOND_GRAMMAR = frozenset(
    {
        "uniqueItems", "contains", "minContains", "maxContains", "not", "dependentRequired",
        "dependentSchemas", "dependencies", "if", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "patternProperties", "format", "oneOf", "minProperties", "maxProperties",
    }
)  # fmt: skip
"""Keywords checked wherever they appear (the grammar enforces them loosely, or not at all)."""

VIABLE, HEADED_FOR_DEAD_END, DEAD_END = 2, 1, 0
"""What :meth:`ValueState.forbid_violations` found."""

LOOKAHEAD_TOKENS = 32
"""Where at most this many tokens are allowed inside a checked value, the matcher looks ahead past each
(see ``forbid_violations``)."""

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
    """

    def __init__(
        self, schema: Any, validator: Any, coverage: Iterable[CoverageEntry], everywhere: Iterable[str] = ()
    ) -> None:
        self.root = schema
        self.validator = validator
        self.legacy = "prefixItems" not in validator.VALIDATORS  # draft 7 and before: tuple ``items``
        self.nodes: list[Any] = []  # subschemas by index
        self._index: dict[int, int] = {}
        checked = {e.pointer for e in coverage if e.status in ("checked", "approximated")}
        self._needing = self._find_needing(checked, set(everywhere))
        self._children: dict[tuple[Dnf, str | int], Dnf] = {}
        self._verdicts: dict[tuple[Dnf, bool, Any], bool] = {}

    def initial_state(self, info: TokenizerInfo) -> ValueState:
        """The state before any output, for a tokenizer."""
        return ValueState(self, _vocab(info))

    # -- the schema graph -------------------------------------------------------------------
    def _loc(self, node: dict[str, Any]) -> int:
        index = self._index.get(id(node))
        if index is None:
            index = self._index[id(node)] = len(self.nodes)
            self.nodes.append(node)
        return index

    def _target(self, node: dict[str, Any]) -> Any:
        """The subschema ``node["$ref"]`` names, or None (remote, dangling)."""
        ref = node.get("$ref")
        try:
            return resolve_local(self.root, ref) if isinstance(ref, str) else None
        except LookupError:
            return None

    def _find_needing(self, checked: set[str], everywhere: set[str]) -> frozenset[int]:
        """The subschemas under which some keyword is beyond the grammar (themselves included)."""
        edges: dict[int, list[int]] = {}
        own: set[int] = set()
        stack: list[Any] = [self.root]
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or (index := self._loc(node)) in edges:
                continue
            if self._beyond(node) or any(key in node for key in everywhere):
                own.add(index)
            subs = [*_subschemas(node), self._target(node)]
            edges[index] = [self._loc(sub) for sub in subs if isinstance(sub, dict)]
            stack += subs
        own |= {self._loc(node) for node in map(self._deepest, checked) if isinstance(node, dict)}
        self._own = frozenset(own)
        needing, frontier = set(own), list(own)
        parents: dict[int, list[int]] = {}
        for parent, children in edges.items():
            for child in children:
                parents.setdefault(child, []).append(parent)
        while frontier:
            for parent in parents.get(frontier.pop(), ()):
                if parent not in needing:
                    needing.add(parent)
                    frontier.append(parent)
        return frozenset(needing)

    def _deepest(self, pointer: str) -> Any:
        """The deepest subschema of the document on ``pointer``'s path: a coverage pointer may name a
        place the preparer made (inside merged ``allOf`` branches), checked from the node that holds it."""
        node, found = self.root, self.root
        for raw in pointer.split("/")[1:]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                break
            if isinstance(node, dict):
                found = node
        return found

    @staticmethod
    def _beyond(node: dict[str, Any]) -> bool:
        if any(key in node for key in BEYOND_GRAMMAR if node.get(key) is not False):
            return True
        required, described = node.get("required"), node.get("properties")
        if isinstance(required, list) and not set(required) <= set(described if isinstance(described, dict) else ()):
            return True  # a required key the properties do not describe: the engines may let it be skipped
        step = node.get("multipleOf")
        return step is not None and not (isinstance(step, int) and node.get("type") == "integer")

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
        found = self._children.get((location, key))
        if found is None:
            found = _or(self._child_alternative(alternative, key) for alternative in location)
            if len(self._children) > 100_000:
                self._children.clear()
            self._children[location, key] = found
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

    # -- checks -----------------------------------------------------------------------------
    def needs(self, location: Dnf) -> bool:
        """Whether a value at ``location`` must be checked (the grammar alone is not exact there)."""
        return any(index in self._needing for alternative in location for index in alternative)

    def has_own(self, location: Dnf) -> bool:
        """Whether a subschema at ``location`` holds a keyword beyond the grammar itself (not only below)."""
        return any(index in self._own for alternative in location for index in alternative)

    def grows_checked(self, location: Dnf) -> bool:
        """Whether an open container at ``location`` is checked as it grows."""
        return any(self._prefix(index) is not None for alternative in location for index in alternative)

    def accepts(self, location: Dnf, value: Any, *, prefix: bool = False) -> bool:
        """Whether ``value`` may stand at ``location`` (every subschema of some alternative holds); with
        ``prefix``, whether the open container ``value`` (its completed items or members) may still grow
        into one. Memoized per value."""
        scalar = value is None or isinstance(value, (str, int, float))
        key = (location, prefix, (type(value), value) if scalar else json.dumps(value, sort_keys=True))
        verdict = self._verdicts.get(key)
        if verdict is None:
            valid = self._prefix_valid if prefix else self._valid
            verdict = any(all(valid(index, value) for index in alternative) for alternative in location)
            if len(self._verdicts) > 100_000:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one per constraint, kept with it)
    def _node_validator(self, index: int) -> Any:
        return self.validator.evolve(schema=self.nodes[index])

    def _valid(self, index: int, value: Any) -> bool:
        try:
            return bool(self._node_validator(index).is_valid(value))
        except Exception:  # a reference that does not resolve offline: cannot check, never refuse
            return True

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def _prefix(self, index: int) -> Any:
        """A validator for what an open container at subschema ``index`` can already break, or None."""
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
        return self.validator.evolve(schema=kept)

    def _prefix_valid(self, index: int, container: Any) -> bool:
        checker = self._prefix(index)
        try:
            return checker is None or bool(checker.is_valid(container))
        except Exception:
            return True


def _subschemas(node: dict[str, Any]) -> Iterable[Any]:
    """The subschemas directly inside ``node``."""
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in (*SCHEMA_LISTS, "items"):
        if isinstance(node.get(key), list):
            yield from node[key]
    for key in SINGLE_SCHEMAS:
        if key in node and not isinstance(node[key], list):
            yield node[key]


@functools.lru_cache(maxsize=1024)
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


# -- the scanner ------------------------------------------------------------------------------
# modes, as in constrain.match.keys
_VALUE, _KEY, _IN_KEY, _KEY_ESCAPE, _COLON, _IN_STRING, _STRING_ESCAPE, _SCALAR, _AFTER = range(9)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WHITESPACE = frozenset(b" \t\n\r")
_CLOSERS = frozenset(b",]}")
_WHITESPACE_RUN = regex.compile(rb"[ \t\n\r]+")
_STRING_SPECIAL = regex.compile(rb'["\\]')


@dataclass(frozen=True, slots=True)
class _Frame:
    """An open container: where it stands, and what it holds so far."""

    location: Dnf
    is_object: bool
    items: tuple[Any, ...] = ()  # arrays: the completed items; objects: (key, value) pairs
    key: str | None = None  # objects: the key whose value is being written

    def value(self) -> Any:
        """The container as a JSON value: its completed items or members."""
        return dict(self.items) if self.is_object else list(self.items)


@dataclass(frozen=True, slots=True)
class _Vocab:
    """Per token, its bytes; and the ids of the tokens that can complete a value, per scanner mode."""

    texts: list[bytes]
    quote: np.ndarray  # [q] int64: ids holding '"' (in a string: they may close it)
    quote_closer: np.ndarray  # [qc] int64: ids holding '"' and a closer (close a string, then a container)
    value_end: np.ndarray  # [e] int64: a closer, two '"' or whitespace after other text (outside strings)
    key_end: np.ndarray  # [k] int64: ``value_end`` with a '"' (in a key: close it, then complete a value)
    closer: np.ndarray  # [c] int64: ids holding ',', ']' or '}'
    spaced: np.ndarray  # [s] int64: ``value_end`` or any whitespace (in a scalar: end it)


@functools.lru_cache(maxsize=8)
def _vocab(info: TokenizerInfo) -> _Vocab:
    special = set(info.xgr_info.special_token_ids)
    texts = [b"" if i in special else bytes(t) for i, t in enumerate(info.xgr_info.decoded_vocab)]
    texts += [b""] * (info.vocab_size - len(texts))

    def ids(test: Callable[[bytes], bool]) -> np.ndarray:
        return np.array([i for i, t in enumerate(texts) if t and test(t)], dtype=np.int64)

    def closes(t: bytes) -> bool:
        return any(c in _CLOSERS for c in t)

    def value_end(t: bytes) -> bool:
        return closes(t) or t.count(b'"') >= 2 or any(c in _WHITESPACE for c in t.lstrip(b" \t\n\r"))

    return _Vocab(
        texts,
        quote=ids(lambda t: b'"' in t),
        quote_closer=ids(lambda t: b'"' in t and closes(t)),
        value_end=ids(value_end),
        key_end=ids(lambda t: b'"' in t and value_end(t)),
        closer=ids(closes),
        spaced=ids(lambda t: value_end(t) or any(c in _WHITESPACE for c in t)),
    )


class _Violation(Exception):
    """A completed value that cannot be valid where it stands."""


@dataclass(frozen=True, slots=True)
class ValueState:
    """The output as JSON values being built, and where each stands in the schema. Immutable."""

    checks: ValueChecks
    vocab: _Vocab
    mode: int = _VALUE
    stack: tuple[_Frame, ...] = ()
    text: bytes = b""  # the string, key or scalar being written, as written
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- advancing --------------------------------------------------------------------------
    def advance(self, token_id: int, *, strict: bool = True) -> ValueState | None:
        """The state after ``token_id``; None when it would complete a value that cannot be valid
        (``strict=False``: never None, the value is taken as it is)."""
        return self.advance_bytes(self.vocab.texts[token_id], strict=strict)

    def advance_bytes(self, data: bytes, *, strict: bool = True) -> ValueState | None:
        """The state after ``data``; None when it would complete a value that cannot be valid."""
        try:
            return self._scan(data, strict)
        except _Violation:
            return None

    def can_end(self) -> bool:
        """Whether the output may end here (a root scalar being written is completed first)."""
        if self.mode != _SCALAR or self.stack:
            return True
        try:
            self._complete(self.stack, _parse(self.text), True)
        except _Violation:
            return False
        return True

    def digest(self) -> int:
        """A hash of the open containers' contents where a check of the container itself depends on them
        (a keyword of its own beyond the grammar, or a check as it grows): the closing search tells states
        apart by it (two arrays at one grammar state, one holding ``"a"`` already). The scalar being
        written is left out: the search's masks show the values it can no longer complete."""
        checks = self.checks
        held = [
            (frame.items, frame.key) if checks.has_own(frame.location) or checks.grows_checked(frame.location) else None
            for frame in self.stack
        ]
        return hash(json.dumps(held, sort_keys=True, default=repr)) if any(held) else 0

    def _location(self, stack: tuple[_Frame, ...]) -> Dnf:
        """The location of the value being written under ``stack`` (not while a key is)."""
        if not stack:
            return self.checks.root_location
        top = stack[-1]
        return self.checks.child(top.location, top.key if top.key is not None else len(top.items))

    def _complete(self, stack: tuple[_Frame, ...], value: Any, strict: bool) -> tuple[_Frame, ...]:
        """Record a completed value: check it, add it to its container, check the container."""
        checks = self.checks
        if strict:
            location = self._location(stack)
            if checks.needs(location) and not checks.accepts(location, value):
                raise _Violation
        if not stack:
            return stack
        top = stack[-1]
        if top.is_object and top.key is None:
            return stack  # a value where a key belongs: not JSON, and the grammar refuses it
        grown = replace(top, items=(*top.items, (top.key, value) if top.is_object else value), key=None)
        if (
            strict
            and checks.grows_checked(top.location)
            and not checks.accepts(top.location, grown.value(), prefix=True)
        ):
            raise _Violation
        return (*stack[:-1], grown)

    def _name(self, stack: tuple[_Frame, ...], key: Any, strict: bool) -> tuple[_Frame, ...]:
        """Record a completed key; check it (``propertyNames``, ``maxProperties``) where its object is
        checked as it grows."""
        top, checks = stack[-1], self.checks
        if strict and isinstance(key, str) and checks.grows_checked(top.location):
            if not checks.accepts(top.location, {**top.value(), key: None}, prefix=True):
                raise _Violation
        return (*stack[:-1], replace(top, key=key))

    def _scan(self, data: bytes, strict: bool) -> ValueState:
        mode, stack, text = self.mode, self.stack, self.text
        at, end = 0, len(data)
        while at < end:
            if mode in (_IN_STRING, _IN_KEY):  # the plain run up to the next quote or backslash, at once
                special = _STRING_SPECIAL.search(data, at)
                stop = special.start() if special else end
                text, at = text + data[at:stop], stop
                if at == end:
                    break
            byte = data[at]
            at += 1
            if mode in (_IN_STRING, _IN_KEY):
                text += bytes((byte,))
                if byte == _BACKSLASH:
                    mode = _STRING_ESCAPE if mode == _IN_STRING else _KEY_ESCAPE
                elif byte == _QUOTE and mode == _IN_KEY:
                    stack, mode = self._name(stack, _parse(text), strict), _COLON
                elif byte == _QUOTE:
                    stack, mode = self._complete(stack, _parse(text), strict), _AFTER
                continue
            if mode in (_STRING_ESCAPE, _KEY_ESCAPE):
                text, mode = text + bytes((byte,)), _IN_STRING if mode == _STRING_ESCAPE else _IN_KEY
                continue
            if mode == _SCALAR:
                if byte not in _WHITESPACE and byte not in _CLOSERS:
                    text += bytes((byte,))
                    continue
                stack, mode = self._complete(stack, _parse(text), strict), _AFTER
            if byte in _WHITESPACE:
                continue
            if byte == _QUOTE:
                mode, text = (_IN_KEY if mode == _KEY else _IN_STRING), b'"'
            elif byte in b"{[" and mode == _VALUE:
                stack = (*stack, _Frame(self._location(stack), byte == ord("{")))
                mode = _KEY if byte == ord("{") else _VALUE
            elif byte in b"}]" and stack:
                stack, mode = self._complete(stack[:-1], stack[-1].value(), strict), _AFTER
            elif byte == ord(","):
                mode = _KEY if stack and stack[-1].is_object else _VALUE
            elif byte == ord(":"):
                mode = _VALUE
            elif mode == _VALUE:
                mode, text = _SCALAR, bytes((byte,))
        return ValueState(self.checks, self.vocab, mode, stack, text)

    # -- masking ----------------------------------------------------------------------------
    def _candidates(self) -> tuple[np.ndarray | None, bool]:
        """``[k]`` int64: the token ids whose completion of a value may fail a check (a superset), or
        None when no value that can complete from here is checked; and whether the value being written
        is checked itself (its own location, or its container as it grows)."""
        if "candidates" not in self._memo:
            checks, stack, vocab = self.checks, self.stack, self.vocab
            outer = any(checks.needs(f.location) or checks.grows_checked(f.location) for f in stack)
            here = self.mode in (_VALUE, _IN_STRING, _STRING_ESCAPE, _SCALAR) and (
                checks.needs(self._location(stack)) or bool(stack and checks.grows_checked(stack[-1].location))
            )
            found: np.ndarray | None
            if not (outer or here):
                found = None
            elif self.mode in (_IN_STRING, _STRING_ESCAPE):  # completes the string; then only a closer goes on
                found = vocab.quote if here else vocab.quote_closer
            elif self.mode == _SCALAR:  # completes the scalar at whitespace or a closer
                found = vocab.spaced if here else vocab.closer
            elif self.mode in (_IN_KEY, _KEY_ESCAPE):  # completes the key (checked as its object grows), then a value
                found = vocab.quote if stack and checks.grows_checked(stack[-1].location) else vocab.key_end
            else:
                found = vocab.value_end
            self._memo["candidates"] = found, here
        return self._memo["candidates"]  # type: ignore[no-any-return]

    def forbid_violations(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool] | None = None,
    ) -> int:
        """Clear from ``row`` every token that would complete a value that cannot be valid (EOS too,
        when the output cannot end here).

        ``viable(token)``: whether anything valid can follow ``token`` (the matcher looks ahead through
        the grammar). Where at most :data:`LOOKAHEAD_TOKENS` tokens are allowed, a token that is not
        viable is cleared too (``"g`` where only ``"green"`` can follow, and the array has it already),
        within a checked value only.
        Returns :data:`VIABLE`; or :data:`HEADED_FOR_DEAD_END` when only the look-ahead's tokens were
        left (those stay allowed); or :data:`DEAD_END`, leaving ``row`` as it was, when every allowed
        token completes a value that cannot be valid.
        """
        ids, here = self._candidates()
        if ids is None and self.mode != _SCALAR:
            return VIABLE
        words = row.numpy()  # [ceil(V / 32)] int32, a view: writes go to ``row``
        banned: list[int] = []
        if ids is not None:
            allowed = ids[(words[ids >> 5] >> (ids & 31)) & 1 == 1]  # [k] int64: candidates the grammar allows
            banned += self._violations(allowed.tolist())
        eos = [t for t in eos_token_ids if (int(words[t >> 5]) >> (t & 31)) & 1]
        if eos and not self.can_end():
            banned += eos
        ahead = self._dead_ends(words, set(banned), viable) if viable is not None and here else []
        if not banned and not ahead:
            return VIABLE
        saved = words.copy()
        clear_bits(words, banned + ahead)
        if words.any():
            return VIABLE
        words[:] = saved  # every token leads into a dead end: refuse only those that complete a bad value
        clear_bits(words, banned)
        if words.any():
            return HEADED_FOR_DEAD_END
        words[:] = saved
        return DEAD_END

    def _violations(self, tokens: list[int]) -> list[int]:
        """The ``tokens`` that would complete a value that cannot be valid. Outside strings only the
        structure counts: tokens differing in whitespace runs alone are scanned once."""
        texts, verdicts, found = self.vocab.texts, dict[bytes, bool](), []
        for token in tokens:
            text = texts[token]
            key = text if b'"' in text else _WHITESPACE_RUN.sub(b" ", text)
            bad = verdicts.get(key)
            if bad is None:
                bad = verdicts[key] = self.advance_bytes(key) is None
            if bad:
                found.append(token)
        return found

    def _dead_ends(
        self,
        # [ceil(V / 32)] int32: the row's words
        words: np.ndarray,
        banned: set[int],
        viable: Callable[[int], bool],
    ) -> list[int]:
        """The allowed tokens after which nothing valid can follow (none looked at when more than
        :data:`LOOKAHEAD_TOKENS` are allowed)."""
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # [32 * ceil(V / 32)] uint8
        if int(bits.sum()) > LOOKAHEAD_TOKENS:
            return []
        texts = self.vocab.texts
        return [
            token
            for token in np.flatnonzero(bits).tolist()
            if token < len(texts) and token not in banned and texts[token] and not viable(token)
        ]


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
        """The state before any output, for a tokenizer."""
        return CallValues(self, _vocab(info))


@dataclass(frozen=True, slots=True)
class CallValues:
    """A text with embedded JSON values: the text around them is followed only to find where the next
    value starts (``CallChecks.opener``, once ``trigger`` has appeared); inside one, a
    :class:`ValueState` of its name's checks is ``inner``, and every call goes to it. Immutable."""

    calls: CallChecks
    vocab: _Vocab
    started: bool = False  # the trigger has appeared
    tail: bytes = b""  # the end of the text since the last value (the trigger or an opener may span tokens)
    inner: ValueState | None = None  # the value being written

    def advance(self, token_id: int, *, strict: bool = True) -> CallValues | None:
        """As :meth:`ValueState.advance`."""
        return self.advance_bytes(self.vocab.texts[token_id], strict=strict)

    def advance_bytes(self, data: bytes, *, strict: bool = True) -> CallValues | None:
        """As :meth:`ValueState.advance_bytes`."""
        calls, started, tail, inner = self.calls, self.started, self.tail, self.inner
        at = 0
        while at < len(data):
            if inner is None:  # between values: look for the next one's opener
                text = tail + data[at:]
                start = 0
                if not started:
                    start = text.find(calls.trigger)
                    started = start >= 0
                found = calls.opener.search(text, start) if started else None
                if found is None:
                    tail, at = text[-calls.keep :], len(data)
                    continue
                at += found.end() - len(tail)
                tail = b""
                checks = calls.checks.get(found.group(1).decode("utf-8", "replace"))
                if checks is None:  # a name the grammar would not have allowed
                    return None
                inner = ValueState(checks, self.vocab)
                continue
            for end in range(at + 1, len(data) + 1):  # inside one: byte by byte, to see where it ends
                try:
                    inner = inner._scan(data[end - 1 : end], strict)
                except _Violation:
                    return None
                if inner.mode == _AFTER and not inner.stack:
                    break
            at = end
            if inner.mode == _AFTER and not inner.stack:
                inner = None
        return CallValues(calls, self.vocab, started, tail, inner)

    def can_end(self) -> bool:
        """Whether the output may end here: not inside a value."""
        return self.inner is None

    def digest(self) -> int:
        """As :meth:`ValueState.digest`, for the value being written."""
        return 0 if self.inner is None else hash((id(self.inner.checks), self.inner.digest()))

    def forbid_violations(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool] | None = None,
    ) -> int:
        """As :meth:`ValueState.forbid_violations`, inside a value; between values nothing is checked."""
        return VIABLE if self.inner is None else self.inner.forbid_violations(row, eos_token_ids, viable)


@functools.lru_cache(maxsize=4096)
def _parse(text: bytes) -> Any:
    """The JSON value of a completed string, key or scalar (None if it is not one: not reached on text
    the grammar allowed). Memoized: a mask completes one value with each of its candidate tokens."""
    try:
        return json.loads(text.decode("utf-8", "replace"))
    except ValueError:
        return None
