"""Which subschemas apply where in a JSON value: through ``$ref``, ``anyOf``, ``oneOf``, ``allOf``, members
and items; and a value's keys put in the order its schema declares them.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from constrain.constraints.schema_refs import resolve_local

__all__ = ["alternatives", "member_schemas", "schema_ordered", "subtree", "walk_values"]


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` names in ``root``, or None."""
    try:
        return resolve_local(root, ref)
    except LookupError:
        return None


def alternatives(node: Any, root: Any) -> list[dict[str, Any]]:
    """``node`` and every subschema that applies at the same place: ``$ref`` targets and the branches of
    ``anyOf``, ``oneOf`` and ``allOf``, recursively, each once."""
    found: list[dict[str, Any]] = []
    seen: set[int] = set()
    pending = [node]
    while pending:
        current = pending.pop(0)
        if not isinstance(current, dict) or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        if isinstance(current.get("$ref"), str):
            pending.append(_resolve(root, current["$ref"]))
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(current.get(key), list):
                pending.extend(current[key])
    return found


def member_schemas(candidates: list[dict[str, Any]], part: str | int, root: Any) -> list[dict[str, Any]]:
    """The subschemas that apply to member ``part`` (a key or an index) of a value ``candidates`` describe."""
    found: list[Any] = []
    for candidate in candidates:
        if isinstance(part, str):
            properties = candidate.get("properties")
            if isinstance(properties, dict) and part in properties:
                found.append(properties[part])
                continue
            patterns = candidate.get("patternProperties")
            for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
                try:
                    if re.search(pattern, part):
                        found.append(sub)
                except re.error:
                    continue
            if isinstance(candidate.get("additionalProperties"), dict):
                found.append(candidate["additionalProperties"])
        else:
            prefix = candidate.get("prefixItems")
            items = candidate.get("items")
            if isinstance(prefix, list) and part < len(prefix):
                found.append(prefix[part])
            elif isinstance(items, list) and part < len(items):  # draft 4 tuples
                found.append(items[part])
            elif isinstance(items, dict):
                found.append(items)
    return [alt for sub in found for alt in alternatives(sub, root)]


def schema_ordered(data: Any, schema: Any) -> Any:
    """``data`` with each object's keys in the order ``schema`` declares them (generation's order).

    Per object, the subschema (through ``$ref``, ``anyOf``, ``oneOf``, ``allOf``) that declares most of
    its keys gives the order; keys it does not declare follow in their own order. Use the prepared
    schema (``compiled.engine_schema``): its order is the one both engines force.
    """

    def order(value: Any, candidates: list[dict[str, Any]]) -> Any:
        if isinstance(value, list):
            return [order(item, member_schemas(candidates, i, schema)) for i, item in enumerate(value)]
        if not isinstance(value, dict):
            return value
        best: list[str] = []
        for candidate in candidates:
            declared = [k for k in candidate.get("properties") or () if k in value]
            if len(declared) > len(best):
                best = declared
        keys = best + [k for k in value if k not in best]
        return {k: order(value[k], member_schemas(candidates, k, schema)) for k in keys}

    return order(data, alternatives(schema, schema))


def walk_values(
    value: Any, candidates: list[dict[str, Any]], root: Any, path: tuple[str | int, ...] = ()
) -> Iterator[tuple[tuple[str | int, ...], Any, list[dict[str, Any]]]]:
    """Every value inside ``value`` in document order: its path, itself, the subschemas that apply."""
    yield path, value, candidates
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk_values(item, member_schemas(candidates, key, root), root, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk_values(item, member_schemas(candidates, index, root), root, (*path, index))


def subtree(candidates: list[dict[str, Any]], root: Any, limit: int = 500) -> list[dict[str, Any]]:
    """The subschemas nested in ``candidates`` (members, items, branches, references), up to ``limit``."""
    found: list[dict[str, Any]] = []
    seen = {id(c) for c in candidates}
    pending = list(candidates)
    while pending and len(found) < limit:
        node = pending.pop()
        nested: list[Any] = []
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                nested += node[key].values()
        for key in ("items", "additionalProperties", "not"):
            nested.append(node.get(key))
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                nested += node[key]
        if isinstance(node.get("$ref"), str):
            nested.append(_resolve(root, node["$ref"]))
        for sub in nested:
            if isinstance(sub, dict) and id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
                pending.append(sub)
    return found
