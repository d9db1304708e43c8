"""Checking finished output against the whole constraint (what the grammar cannot enforce included)."""

from __future__ import annotations

import json
from typing import Any, cast

import jsonschema
import regex as regex_module
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from constrain.caches import bounded
from constrain.constraints.constraint import Choice, Grammar, JsonSchema, Regex
from constrain.constraints.formats import FORMATS
from constrain.match.matcher import Compiled

__all__ = ["parse_json", "schema_validator", "schema_violations", "validate"]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def parse_json(text: str) -> Any:
    """Strict JSON: NaN, Infinity, duplicate keys and trailing garbage are errors."""
    return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)


@bounded("match.schema_validator", maxsize=256)
def schema_validator(schema_text: str, *, approximate_remote: bool = False) -> jsonschema.protocols.Validator:
    """The validator of a JSON schema (its own draft, formats asserted, no reference fetched); memoized.

    A reference outside the document does not resolve (``referencing``'s ``Unresolvable``), or, with
    ``approximate_remote``, stands for ``true``: what a lenient compile reports as approximated, and
    what the value checks then take it to mean (they never meet an error there)."""
    schema = json.loads(schema_text)
    cls = _unicode_patterns(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
    # No $ref is ever fetched over the network.
    registry: Registry[Any] = Registry(retrieve=_anything) if approximate_remote else Registry()  # type: ignore[call-arg]
    return cast(jsonschema.protocols.Validator, cls(schema, registry=registry, format_checker=FORMATS))


@bounded("match.unicode_patterns", maxsize=8)
def _unicode_patterns(cls: Any) -> Any:
    """``cls`` with ``pattern`` and ``patternProperties`` searched by the ``regex`` module: Python's ``re``
    cannot read ECMA 262's ``\\p{L}``, which the metaschema check lets through."""

    def pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "string") and not regex_module.search(pattern, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    def pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "object"):
            for found, subschema in patterns.items():
                for key, value in instance.items():
                    if regex_module.search(found, key):
                        yield from validator.descend(value, subschema, path=key, schema_path=found)

    keywords = {"pattern": pattern, "patternProperties": pattern_properties}
    extended = jsonschema.validators.extend(cls, keywords)  # type: ignore[no-untyped-call]
    extended.__name__ = extended.__qualname__ = cls.__name__  # its draft's name (the value checks read it)
    return extended


def _anything(uri: str) -> Resource[Any]:
    """A remote reference, approximated: the schema ``true``."""
    return DRAFT202012.create_resource(True)


def _pointer(path: Any) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else "/"


def schema_violations(constraint: JsonSchema, text: str) -> list[str]:
    """The violations of ``text`` against a JSON Schema constraint (formats included); empty when valid. Pure."""
    try:
        value = parse_json(text)
    except ValueError as err:
        return [f"not valid JSON: {err}"]
    try:
        errors = sorted(schema_validator(constraint.schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    except Unresolvable as err:
        return [f"cannot check: reference {err} does not resolve offline"]
    return [f"{_pointer(e.absolute_path)}: {e.message}" for e in errors]


def validate(compiled: Compiled, text: str) -> list[str]:
    """Return the violations of ``text``; empty when it satisfies the constraint. Pure."""
    constraint = compiled.constraint
    if isinstance(constraint, JsonSchema):
        return schema_violations(constraint, text)
    if isinstance(constraint, Regex):
        if regex_module.fullmatch(constraint.pattern, text) is None:
            return [f"does not match the regex {constraint.pattern!r}"]
        return []
    if isinstance(constraint, Choice):
        return [] if text in constraint.options else [f"{text!r} is not one of the {len(constraint.options)} choices"]
    if isinstance(constraint, Grammar):
        state = compiled.grammar.new_state()
        if not state.accept_string(text) or not state.is_completed():
            return ["is not a complete sentence of the grammar"]
        return []
    raise ValueError(f"unknown constraint type {type(constraint).__name__}")
