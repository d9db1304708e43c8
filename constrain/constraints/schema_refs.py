"""Local ``$ref`` resolution for JSON Schema preparation: JSON pointers, anchors, aliases for references
the engine cannot follow, and ``allOf`` branches with their references inlined.

Only references inside the schema (``#``, ``#/...``, ``#anchor``) resolve; a remote one is left to
the caller (:mod:`constrain.constraints.schema` refuses it, or approximates it when lenient).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from constrain.constraints.schema_rewrites import combine, merge_into
from constrain.errors import SchemaError, UnsatisfiableSchemaError

__all__ = ["References", "pointer_token", "resolve_from_resources", "resolve_local"]


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
        part = unquote(raw).replace("~1", "/").replace("~0", "~") if "%" in raw or "~" in raw else raw
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise LookupError(ref)
    return node


def pointer_token(key: str | int) -> str:
    """``key`` as one RFC 6901 JSON pointer reference token: ``~`` becomes ``~0``, ``/`` becomes ``~1``."""
    return str(key).replace("~", "~0").replace("/", "~1")


def resolve_from_resources(root: Any) -> Any:
    """``root`` with every local ``$ref`` inside a nested schema resource made absolute (a copy; ``root``
    when there is none to rewrite).

    A subschema whose ``$id`` has more than a fragment starts a resource of its own: inside it, ``#/a``
    and ``#anchor`` name the resource's ``/a`` and anchor, not the root's. The rest of preparation
    resolves references against the root, so each such reference becomes the root's pointer to its
    target (``#`` + the resource's pointer + ``/a``); other references are left as written.
    """

    def rewrite(node: Any, path: str, resource: str | None) -> Any:
        if isinstance(node, list):
            return [rewrite(v, f"{path}/{i}", resource) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        own = node.get("$id")
        if path and isinstance(own, str) and own.split("#")[0]:
            resource = path
        out = {}
        for key, value in node.items():
            if key in ("const", "enum", "default", "examples"):  # values, not schemas
                out[key] = value
            elif key == "$ref" and resource is not None and isinstance(value, str) and value.startswith("#"):
                out[key] = _absolute(root, resource, value)
            else:
                out[key] = rewrite(value, f"{path}/{pointer_token(key)}", resource)
        return out

    return rewrite(root, "", None) if '"$id"' in json.dumps(root) else root


def _absolute(root: Any, resource: str, ref: str) -> str:
    """The reference ``ref`` (``#``, ``#/...`` or ``#anchor``) made inside the resource at ``resource``, as
    the root's pointer; an anchor the resource does not define is left for preparation to report."""
    if ref == "#" or ref.startswith("#/"):
        return "#" + resource + ref[1:]
    found = _anchor(resolve_local(root, "#" + resource), unquote(ref[1:]), resource)
    return ref if found is None else "#" + found


def _anchor(node: Any, name: str, path: str, depth: int = 0) -> str | None:
    """The pointer (from ``path``, ``node``'s own) of the subschema under ``node`` with ``$anchor: name``."""
    if isinstance(node, dict):
        if node.get("$anchor") == name:
            return path
        inner = node.get("$id")
        if depth and isinstance(inner, str) and inner.split("#")[0]:
            return None  # a resource of its own: its anchors are its own
        items: Any = (
            (pointer_token(k), v) for k, v in node.items() if k not in ("const", "enum", "default", "examples")
        )
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return None
    for key, value in items:
        found = _anchor(value, name, f"{path}/{key}", depth + 1)
        if found is not None:
            return found
    return None


_SIMPLE_REF = re.compile(r"#/(\$defs|definitions)/[A-Za-z0-9_.-]+")
"""References the engine follows itself; others get an alias (see :meth:`References.engine_ref`)."""


class References:
    """The local references of one root schema, as its preparation meets them.

    ``prepare(node, pointer)`` prepares a subschema (the preparer's walk): an alias's definition is the
    prepared target. State that grows as preparation goes on: ``aliases`` (``$ref`` -> its name under
    the root's ``$defs``), ``alias_defs`` (name -> prepared definition, to add to the root's ``$defs``)
    and ``expanding`` (references inlined by the ``allOf`` merges enclosing the node being prepared: the
    preparer pushes and pops them).
    """

    def __init__(self, root: Any, prepare: Callable[[Any, str], Any]) -> None:
        self.root = root
        self.prepare = prepare
        self.aliases: dict[str, str] = {}
        self.alias_defs: dict[str, Any] = {}
        self.expanding: list[str] = []

    def resolve(self, ref: str, pointer: str) -> Any:
        """The subschema a local ``$ref`` (``#/...``) names; ``SchemaError`` at ``pointer`` if none."""
        try:
            return resolve_local(self.root, ref)
        except LookupError as err:
            raise SchemaError(f"$ref {ref!r} does not resolve", pointer) from err

    def local(self, ref: str) -> tuple[str | None, str]:
        """``ref`` as a JSON pointer reference (``#`` or ``#/...``; an anchor ``#name`` looked up), and
        ``""``; or None and why it cannot be resolved here."""
        if ref.startswith("#") and not ref.startswith("#/") and ref != "#":
            anchor = self.find_anchor(ref[1:])
            if anchor is None:
                return None, f"anchor {ref!r} is not defined in this schema"
            return anchor, ""
        if not (ref.startswith("#/") or ref == "#"):
            return None, f"reference {ref!r} cannot be resolved offline"
        return ref, ""

    def engine_ref(self, ref: str, pointer: str) -> str:
        """The local reference ``ref`` as the engine reads it: itself where the engine follows it (a name
        under ``$defs`` or ``definitions``), else an alias (into arrays, escaped names, the root).

        An alias is prepared once, on first use (it may recurse here: a placeholder stands meanwhile)."""
        if _SIMPLE_REF.fullmatch(ref):
            return ref
        if ref not in self.aliases:
            name = f"constrain_ref{len(self.aliases)}"
            self.aliases[ref] = name
            self.alias_defs[name] = {}  # placeholder while the target (which may recurse here) is prepared
            prepared = self.prepare(self.resolve(ref, pointer), ref[1:])
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

    def merge_all_of(self, node: dict[str, Any], pointer: str) -> tuple[dict[str, Any], list[str], bool]:
        """Fold ``node``'s ``allOf`` branches (references inlined) into a copy of it, exactly where
        :func:`~constrain.constraints.schema_rewrites.merge_into` can, else into a superset.

        Returns the merged node, the references inlined into it, and whether the merge is exact.
        ``node`` does not change. Raises ``SchemaError`` for a malformed ``allOf``,
        ``UnsatisfiableSchemaError`` when a branch is ``false`` or branches contradict each other.
        """
        branches = node.get("allOf")
        if not isinstance(branches, list) or not branches:
            raise SchemaError("allOf must be a non-empty array", pointer)
        merged = {k: v for k, v in node.items() if k != "allOf"}
        exact = True
        inlined: list[str] = []
        for i, raw in enumerate(branches):
            try:
                branch = self.inline(raw, f"{pointer}/allOf/{i}", inlined)
                if branch is None:
                    exact = False
                    continue
                if branch is False:
                    raise UnsatisfiableSchemaError("the schema is `false`", f"{pointer}/allOf/{i}")
                exact &= merge_into(merged, branch)
            except UnsatisfiableSchemaError as err:
                if err.pointer:
                    raise
                why = f"{err.reason}, between branch {i} and the keywords before it"
                raise UnsatisfiableSchemaError(why, f"{pointer}/allOf") from None
        return merged, inlined, exact

    def inline(self, branch: Any, pointer: str, inlined: list[str]) -> Any:
        """A branch with its top-level local ``$ref`` chain inlined (appended to ``inlined``); None if
        recursive (a reference met twice, or one of :attr:`expanding`)."""
        seen: list[str] = []
        while isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and branch["$ref"].startswith("#"):
            ref = branch["$ref"]
            if ref in seen or ref in self.expanding:
                return None
            seen.append(ref)
            inlined.append(ref)
            target = self.resolve(ref, pointer)
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            if rest:
                return combine(target, rest) if isinstance(target, dict) else None
            branch = target
        return {} if branch is True else branch  # a reference may name a boolean schema
