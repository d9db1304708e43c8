"""EBNF grammars shipped with constrain, usable by name: ``constrain.grammar("json")``.

Each ``<name>.ebnf`` here is xgrammar's EBNF dialect with start rule ``root``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["GRAMMAR_DIR", "available", "load"]

GRAMMAR_DIR = Path(__file__).resolve().parent
"""The folder holding the ``.ebnf`` files."""


def available() -> list[str]:
    """Names of the shipped grammars."""
    return sorted(p.stem for p in GRAMMAR_DIR.glob("*.ebnf"))


def load(name: str) -> str:
    """The EBNF text of the grammar ``name``; ``KeyError`` listing the names if there is none."""
    path = GRAMMAR_DIR / f"{name}.ebnf"
    if not path.is_file():
        raise KeyError(f"no shipped grammar named {name!r}; available: {', '.join(available())}")
    return path.read_text()
