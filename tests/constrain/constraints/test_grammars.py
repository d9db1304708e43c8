"""The shipped grammars, each with sentences it must accept and reject (``FINAL_REJECT:`` = a valid prefix only)."""

from __future__ import annotations

import pytest
import xgrammar as xgr

import constrain
from constrain import grammars

grammar__accepted__rejected = {
    "json": (
        ['{"a": [1, -2.5e3, true, null, "x\\n"]}', "[]", '  "s"  ', "0"],
        ["{'a': 1}", "[1,]", "01", "FINAL_REJECT:[1, 2", "NaN"],
    ),
    "arithmetic": (
        ["1 + 2 * (3 - 4)", "-(2^3)^2 / 7.5", "42"],
        ["1 +* 2", "FINAL_REJECT:(1", "FINAL_REJECT:1 +", "1..2", "a + 1"],
    ),
    "sql_select": (
        [
            "SELECT * FROM users",
            "SELECT name, COUNT(*) AS n FROM users u LEFT JOIN orders o ON u.id = o.user_id WHERE age >= 18 AND "
            "city IN ('Oslo', 'Rome') GROUP BY name ORDER BY n DESC LIMIT 10;",
            "SELECT DISTINCT a.b FROM t WHERE x IS NOT NULL",
        ],
        [
            "SELECT FROM users",
            "DELETE FROM users",
            "FINAL_REJECT:SELECT * FROM",
            "FINAL_REJECT:SELECT a FROM t WHERE x =",
        ],
    ),
    "csv": (
        ['name,age\nAnn,3\n"Lee, Jr.",40\n', "a", 'x,"he said ""hi"""'],
        ['FINAL_REJECT:a,"b', 'a"b,c'],
    ),
    "function_call": (
        ["get_weather(city=\"Paris\", units='metric', days=3)", "f()", "outer(inner(1, [2, 3]), flag=True)"],
        ["get weather()", "FINAL_REJECT:f(", "f(x=)", "1f()", "FINAL_REJECT:f(1"],
    ),
}


def _check(ebnf: str, text: str) -> str:
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(ebnf), terminate_without_stop_token=True
    )
    if not matcher.accept_string(text):
        return "reject"
    return "accept" if matcher.is_completed() else "prefix"


@pytest.mark.parametrize("name", sorted(grammar__accepted__rejected))
def test_shipped_grammar(name):
    ebnf = grammars.load(name)
    accepted, rejected = grammar__accepted__rejected[name]
    for text in accepted:
        assert _check(ebnf, text) == "accept", text
    for text in rejected:
        if text.startswith("FINAL_REJECT:"):
            assert _check(ebnf, text.removeprefix("FINAL_REJECT:")) == "prefix", text
        else:
            assert _check(ebnf, text) == "reject", text


def test_every_shipped_grammar_is_tested_and_loads_by_name(smol_tokenizer):
    assert grammars.available() == sorted(grammar__accepted__rejected)
    for name in grammars.available():
        compiled = constrain.compile(constrain.grammar(name), smol_tokenizer)
        assert compiled.constraint.name == name
        accepted = grammar__accepted__rejected[name][0][0]
        assert compiled.validate(accepted) == []
