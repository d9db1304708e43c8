"""Fails on an import that breaks constrain's layering: a cycle, an upward import, or a private name.

Every import of a ``constrain`` module counts, wherever it is written (function-level and
``TYPE_CHECKING`` imports included). A module may import its own folder and the layers below it
(``LAYERS``, bottom first); ``constrain/__init__.py`` (the public API) may import anything. The
repository's ``sampler/`` and ``grammars/`` ship as ``constrain.sampler`` and ``constrain.grammars`` (links
inside ``constrain/``): an import of the top-level names anywhere in the tree is a problem too.
Usage: ``python .ci/check_imports.py`` (exit status 1 and one line per problem).
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys

LAYERS = (
    ("sampler", "grammars"),  # logits -> token (torch only), shipped grammars: they import nothing of constrain
    ("errors", "results", "caches", "jsonscan"),  # leaf modules: imported by every layer
    ("models",),  # loading the packaged models, forward cost, export
    ("backends",),  # the grammar engines behind one protocol; tokenizer facts
    ("constraints",),  # constraint values, JSON Schema preparation
    ("match",),  # per-request grammar state: matcher, bitmasks, key/value checks, closing path
    ("compiler",),  # compiling a constraint (cached, routed to an engine); makes matchers
    ("decode",),  # requests, the decode loop, drafts, KV reuse, stopping, detokenizing, reasoning, beams
    ("tools",),  # function calling: definitions, formats, grammar, parser
    ("generation", "conversation"),  # the public calls
    ("serving",),  # engine thread, OpenAI protocol, HTTP server, CLI
    ("integrations", "testing"),  # constrain inside other engines; helpers for tests and benchmarks
)
ROOT = pathlib.Path(__file__).resolve().parent.parent / "constrain"
SHIPPED_INSIDE = ("sampler", "grammars")
"""Top-level folders of the repository that ship inside the package: imported as ``constrain.<name>`` only."""


def _python_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The ``.py`` files under ``root``, through linked folders (``constrain/sampler``), but hidden or build ones."""
    out = []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s not in ("build", "site", "__pycache__")]
        out += [pathlib.Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(out)


def _top_level_imports(tree: pathlib.Path) -> list[str]:
    """Imports of :data:`SHIPPED_INSIDE` as top-level packages in the repository's Python files."""
    out = []
    for path in _python_files(tree):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in SHIPPED_INSIDE:
                    out.append(f"{path.relative_to(tree)}:{node.lineno}: imports {name}; use constrain.{name}")
    return out


def _module(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself
    for level, names in enumerate(LAYERS):
        if parts[1] in names:
            return level
    raise SystemExit(f"{module}: in no layer of .ci/check_imports.py (add its folder to LAYERS)")


def imports(modules: set[str], root: pathlib.Path) -> dict[str, set[tuple[str, str | None, int]]]:
    """Per module, what it imports of constrain: (module, name or None, line)."""
    found: dict[str, set[tuple[str, str | None, int]]] = {}
    for path in _python_files(root):
        name = _module(path, root)
        out = found.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update((a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "constrain")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                if base.split(".")[0] != "constrain":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    out.add((full, None, node.lineno) if full in modules else (base, alias.name, node.lineno))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def problems(root: pathlib.Path = ROOT) -> list[str]:
    """Every layering problem of the package at ``root`` (named ``constrain``), one line each."""
    modules = {_module(p, root) for p in _python_files(root)}
    found = imports(modules, root)
    out: list[str] = []
    graph: dict[str, set[str]] = {}
    for module, targets in sorted(found.items()):
        here = _layer(module)
        for target, name, line in sorted(targets, key=lambda t: (t[2], t[0], t[1] or "")):
            if target == module:
                continue
            graph.setdefault(module, set()).add(target)
            there = _layer(target)
            if here is not None and there is not None and there > here and f" {target}," not in "".join(out[-1:]):
                out.append(
                    f"{module}:{line}: imports {target}, a layer above it ({LAYERS[there][0]} > {LAYERS[here][0]})"
                )
            if name is not None and name.startswith("_") and module != "constrain":
                out.append(f"{module}:{line}: imports the private name {name} from {target}")
    for cycle in _cycles(graph):
        out.append("import cycle: " + " -> ".join(cycle))
    if root == ROOT:
        out += _top_level_imports(root.parent)
    return out


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "imports: no cycle, no upward import, no private name across modules")
    sys.exit(1 if found else 0)
