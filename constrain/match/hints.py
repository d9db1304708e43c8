"""Hints for the closing search: short texts worth trying inside free text, from the constraint itself.

Where a string must match a pattern, the masks alone may not show which character leads out (the
suffix of ``[A-Z_]+(_DEVICE|_LAYOUT)``, an unanchored pattern): the closing search
(:mod:`constrain.match.closing`) would be blind. :func:`hints` gives it the shortest examples of the
constraint's regexes (a JSON Schema's ``pattern`` strings, as JSON string content) and of its
``format`` strings; :func:`example` builds one from a pattern. Both are guesses the matcher checks.
:func:`required_keys` names the keys an object may have to hold: an open object's keys are free text,
where the search tells a required name from any other key (the masks do not).
"""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Iterator
from typing import Any

import regex

from constrain.constraints.constraint import Grammar, JsonSchema, Regex
from constrain.match.matcher import Matcher

__all__ = ["FORMATS", "MAX_HINTS", "example", "hints", "required_keys"]

FORMATS = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z", "duration": "P1D",
    "email": "a@a.aa", "idn-email": "a@a.aa", "hostname": "a", "idn-hostname": "a", "ipv4": "0.0.0.0",
    "ipv6": "::1", "uri": "a:a", "iri": "a:a", "uri-reference": "a", "iri-reference": "a",
    "uuid": "00000000-0000-0000-0000-000000000000",
}  # fmt: skip
"""A short valid string per JSON Schema ``format`` (a hint for the search, checked by the matcher)."""

MAX_HINTS = 32
"""The most hints :func:`hints` gives for one constraint."""

_CANDIDATES = "a0A_-.:/@ " + string.printable


_PROPERTY = regex.compile(r"\\[pP]\{[^}]*\}")
"""A Unicode property (``\\p{Lu}``, ``\\P{L}``), which Python's ``re`` cannot parse."""


def _property_example(found: regex.Match[str]) -> str:
    """A character of the property ``found`` names, as a literal ``re`` parses ("" where none is met)."""
    test = regex.compile(found.group(0))
    return next((re.escape(ch) for ch in _CANDIDATES + "éÉ" if test.fullmatch(ch)), "")


def example(pattern: str) -> str | None:
    """A short string that ``pattern`` matches (the fewest repeats, the shortest branch), or None.

    Built from the pattern's syntax tree as Python's ``re`` parses it (lookarounds ignored): a guess
    the matcher checks, not a proof.
    """
    try:
        from re import _parser  # type: ignore[attr-defined,unused-ignore]  # the stdlib's regex parser (3.11+)

        tree = _parser.parse(_PROPERTY.sub(_property_example, pattern))
    except Exception:  # a pattern Python cannot parse, or another Python: no example
        return None
    groups: dict[int, str] = {}

    def matches(ch: str, items: list[tuple[Any, Any]]) -> bool:
        found, negate = False, False
        for op, arg in items:
            kind = str(op)
            if kind == "NEGATE":
                negate = True
            elif kind == "LITERAL":
                found |= ord(ch) == arg
            elif kind == "RANGE":
                found |= arg[0] <= ord(ch) <= arg[1]
            elif kind == "CATEGORY":
                name = str(arg)
                test = (
                    ch.isdigit() if "DIGIT" in name else ch.isspace() if "SPACE" in name else ch.isalnum() or ch == "_"
                )
                found |= test != ("NOT" in name)
        return found != negate

    def walk(seq: Any) -> str | None:
        out: list[str] = []
        for op, arg in seq:
            kind = str(op)
            piece: str | None = ""
            if kind == "LITERAL":
                piece = chr(arg)
            elif kind in ("NOT_LITERAL", "ANY", "IN", "CATEGORY"):
                items = {"NOT_LITERAL": [("NEGATE", None), ("LITERAL", arg)], "ANY": [("NEGATE", None)]}.get(
                    kind, arg if kind == "IN" else [(op, arg)]
                )
                piece = next((ch for ch in _CANDIDATES if ch != "\n" and matches(ch, items)), None)
            elif kind.endswith("_REPEAT"):
                sub = walk(arg[2])
                piece = None if sub is None else sub * arg[0]
            elif kind == "SUBPATTERN":
                piece = walk(arg[3])
                if piece is not None and arg[0] is not None:
                    groups[arg[0]] = piece
            elif kind == "ATOMIC_GROUP":
                piece = walk(arg)
            elif kind == "BRANCH":
                options = [text for text in map(walk, arg[1]) if text is not None]
                piece = min(options, key=len) if options else None
            elif kind == "GROUPREF":
                piece = groups.get(arg, "")
            elif kind not in ("AT", "ASSERT", "ASSERT_NOT"):
                return None
            if piece is None:
                return None
            out.append(piece)
        return "".join(out)

    return walk(tree)


def hints(matcher: Matcher) -> list[str]:
    """Texts worth trying inside free text, from ``matcher``'s constraint (see the module docstring), at
    most :data:`MAX_HINTS`, each once: a regex's, a schema's, and those of the schemas a grammar embeds
    (tool calls' arguments); ``[]`` for other grammars and choices. Does not change ``matcher``."""
    compiled = matcher.compiled
    constraint = compiled.constraint
    if isinstance(constraint, Regex):
        found = example(constraint.pattern)
        return [found] if found else []
    if isinstance(constraint, Grammar):
        schemas = [schema.schema_value for _, schema in constraint.embedded.schemas] if constraint.embedded else []
        return list(itertools.islice(dict.fromkeys(text for text in _texts(schemas) if text), MAX_HINTS))
    if not isinstance(constraint, JsonSchema):
        return []

    # the schema as the engine was given it (its patterns and formats as prepared) where the compiled
    # constraint keeps one (CompiledConstraint.engine_schema: not part of what a matcher needs), then the
    # user's (the patterns the value checks match, left out of the engine's)
    schemas = [getattr(compiled, "engine_schema", None), constraint.schema_value]
    return list(itertools.islice(dict.fromkeys(text for text in _texts(schemas) if text), MAX_HINTS))


def required_keys(matcher: Matcher) -> list[str]:
    """The keys an object of ``matcher``'s JSON schema may have to hold, as JSON string content, each once
    (at most :data:`MAX_HINTS`): every ``required`` list's, and those another key requires
    (``dependentRequired``, draft 7's ``dependencies`` lists); ``[]`` for other constraints. Does not
    change ``matcher``."""
    constraint = matcher.compiled.constraint
    if not isinstance(constraint, JsonSchema):
        return []
    return list(itertools.islice(dict.fromkeys(_required_names(constraint.schema_value)), MAX_HINTS))


def _required_names(node: Any) -> Iterator[str]:
    """:func:`required_keys` of a schema, or of a list of them."""
    if isinstance(node, dict):
        lists = [node.get("required")]
        for key in ("dependentRequired", "dependencies"):
            if isinstance(node.get(key), dict):
                lists.extend(node[key].values())
        for names in lists:
            if isinstance(names, list):
                yield from (json.dumps(name)[1:-1] for name in names if isinstance(name, str))
        for value in node.values():
            yield from _required_names(value)
    elif isinstance(node, list):
        for value in node:
            yield from _required_names(value)


def _texts(node: Any) -> Iterator[str]:
    """The examples of the patterns (as JSON string content) and formats in a schema, or in a list of them."""
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            found = example(node["pattern"])
            if found is not None:
                yield json.dumps(found)[1:-1]
        if isinstance(node.get("format"), str) and node["format"] in FORMATS:
            yield FORMATS[node["format"]]
        for value in node.values():
            yield from _texts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _texts(value)
