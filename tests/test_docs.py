"""The documentation names only what the package has: every ``constrain.…`` reference and every
``from constrain… import …`` in README.md and docs/ resolves, and a top-level name it uses is in
``constrain.__all__`` (the documented API). `make docs` builds the site strictly (links, references)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import constrain

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"(?<![\w./-])constrain(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (constrain(?:\.\w+)*) import (?:\(([^)]*)\)|([^\n#]*))", re.M)


def _module(name: str) -> object | None:
    """The module ``name``; for one that needs an optional dependency not installed here (vLLM), the set
    of names its source defines at top level; None when there is no such module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] == "constrain":
            return None
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a name inside such a module, not a module
            return None
        if spec is None or spec.origin is None:
            return None
        tree = ast.parse(Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
        return defined | {
            t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
        }
    except ImportError:
        return None


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package or an attribute of one; a top-level name must be
    in ``constrain.__all__``."""
    parts = dotted.split(".")
    if len(parts) > 1 and parts[1] not in constrain.__all__ and _module(".".join(parts[:2])) is None:
        return False
    for cut in range(len(parts), 0, -1):
        value = _module(".".join(parts[:cut]))
        if value is None:
            continue
        if isinstance(value, set):  # a module not importable here: its top-level names
            return len(parts) == cut or (len(parts) == cut + 1 and parts[cut] in value)
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    return False


def references(text: str) -> set[str]:
    found = set(DOTTED.findall(text))
    for module, grouped, names in FROM_IMPORT.findall(text):
        for name in (grouped or names).replace("\n", ",").split(","):
            if name.split(" as ")[0].strip():
                found.add(f"{module}.{name.split(' as ')[0].strip()}")
    return {ref.rstrip(".") for ref in found}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_page_names_only_what_the_package_has(page: Path) -> None:
    missing = sorted(ref for ref in references(page.read_text()) if not resolves(ref))
    assert not missing, f"{page.relative_to(ROOT)} names what the package does not export: {missing}"


def test_the_check_catches_a_missing_or_internal_name() -> None:
    text = "`constrain.generate`\n```python\nfrom constrain import Request, chat\n"
    text += "from constrain.sampler import (\n  sample,\n)\n\nx = 1\n```"
    expected = {
        "constrain.generate",
        "constrain.Request",
        "constrain.chat",
        "constrain.sampler",
        "constrain.sampler.sample",
    }
    assert references(text) == expected
    assert resolves("constrain.generate") and resolves("constrain.sampler.SamplingParams")
    assert resolves("constrain.decode.loop.DecodeLoop")
    assert not resolves("constrain.IncrementalDetokenizer")  # internal: not in __all__
    assert not resolves("constrain.generate.admit")  # a function, not the module
    assert not resolves("constrain.nonexistent")


def test_all_is_sorted_and_every_name_exists() -> None:
    assert list(constrain.__all__) == sorted(constrain.__all__)
    assert [name for name in constrain.__all__ if not hasattr(constrain, name)] == []
