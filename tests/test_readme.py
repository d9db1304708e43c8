"""The README's promises: at most 200 lines, the two commands first, and every Python snippet runs.

The snippets run in order in one namespace, on the default model (``real_model``); the server snippet's
client talks to a real server on a loopback port (its address replaces the README's).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import constrain
from constrain.testing.server import LocalServer

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    assert len(TEXT.splitlines()) <= 200
    first = re.search(r"```bash\n(.*?)```", TEXT, flags=re.S)
    assert first is not None
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert commands == ["make demo", "make test"]
    assert TEXT.index("make demo") < TEXT.index("```python")


def test_the_readme_names_no_issue() -> None:
    assert not re.search(r"\bissues? \d+|\(#\d+\)", TEXT, flags=re.I)


@pytest.mark.real_model
def test_every_python_snippet_runs() -> None:
    try:
        handle = constrain.load_model()
    except constrain.ModelNotFoundError as err:
        pytest.skip(f"the default model's package is not installed: {err}")
    assert len(SNIPPETS) >= 3
    server = LocalServer(handle)
    namespace: dict[str, object] = {}
    out = io.StringIO()
    try:
        for snippet in SNIPPETS:
            code = snippet.replace("http://127.0.0.1:8000", server.url)
            with contextlib.redirect_stdout(out):
                exec(compile(code, str(README), "exec"), namespace)
    finally:
        server.stop()
    person = namespace["result"]
    assert type(person.value).__name__ == "Person", person  # type: ignore[attr-defined]
    assert namespace["call"].name == "get_weather"  # type: ignore[attr-defined]
    assert re.search(r'\{"name": ?"[^"]+", ?"age": ?\d+\}', out.getvalue()), out.getvalue()
