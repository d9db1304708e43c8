"""constrain's layering, as `.ci/check_imports.py` checks it: no cycle, no upward import, no private name."""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_imports", HERE / ".ci" / "check_imports.py")
assert spec is not None and spec.loader is not None
check_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_imports)


def test_the_package_has_no_layering_problem() -> None:
    assert check_imports.problems() == []


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "constrain"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a cycle hidden in a function, inside one layer
            {"match/__init__.py": "", "match/a.py": "def f():\n    from constrain.match import b\n",
             "match/b.py": "from constrain.match.a import f\n"},
            "import cycle: constrain.match.a -> constrain.match.b",
        ),
        (  # a module importing its own package's __init__, which imports it
            {"match/__init__.py": "from constrain.match.a import f\n", "match/a.py": "from constrain.match import g\n"},
            "import cycle: constrain.match -> constrain.match.a",
        ),
        (  # an upward import, even under TYPE_CHECKING
            {"match/__init__.py": "", "compiler/__init__.py": "", "compiler/c.py": "X = 1\n",
             "match/m.py": "import typing\nif typing.TYPE_CHECKING:\n    from constrain.compiler.c import X\n"},
            "constrain.match.m:3: imports constrain.compiler.c, a layer above it (compiler > match)",
        ),
        (  # a private name across modules
            {"match/__init__.py": "", "match/a.py": "_x = 1\n", "match/b.py": "from constrain.match.a import _x\n"},
            "constrain.match.b:1: imports the private name _x from constrain.match.a",
        ),
    ],
)  # fmt: skip
def test_each_kind_of_problem_is_found(tmp_path: pathlib.Path, files: dict[str, str], expected: str) -> None:
    assert expected in check_imports.problems(_package(tmp_path, files))


def test_a_clean_package_passes(tmp_path: pathlib.Path) -> None:
    files = {
        "match/__init__.py": "from constrain.match.a import f\n",
        "match/a.py": "from constrain.errors import E\n",
        "errors.py": "class E(Exception): ...\n",
        "compiler/__init__.py": "from constrain.match.a import f\n",
    }
    assert check_imports.problems(_package(tmp_path, files)) == []
