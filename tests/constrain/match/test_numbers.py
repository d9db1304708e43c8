"""Number prefixes against bounds and multipleOf (constrain.match.numbers), against a brute force."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from constrain.match.numbers import NumberBounds, bounds_of, number_prefix_viable

DIGITS = "0123456789"


def _completions(prefix: str, depth: int) -> list[str]:
    """Every JSON number (no exponent) that ``prefix`` becomes with at most ``depth`` more characters."""
    found, frontier = [], [prefix]
    for _ in range(depth + 1):
        following = []
        for text in frontier:
            body = text.lstrip("-")
            if body and body[-1].isdigit():
                found.append(text)
            for char in DIGITS + ".":
                if char == "." and ("." in body or not body):
                    continue
                if char.isdigit() and body == "0":
                    continue  # no leading zero
                following.append(text + char)
        frontier = following
    return found


def _allowed(value: Fraction, bounds: NumberBounds) -> bool:
    if bounds.low is not None and (value < bounds.low or (bounds.low_open and value == bounds.low)):
        return False
    if bounds.high is not None and (value > bounds.high or (bounds.high_open and value == bounds.high)):
        return False
    return all(value % step == 0 for step in bounds.steps)


PREFIXES = ["-", "0", "-0", "0.", "0.2", "0.25", "0.28", "1", "12", "12.", "12.7", "-3.", "-3.75", "99", "100.0", "7"]


def test_the_verdicts_agree_with_a_brute_force() -> None:
    """False only where no completion is valid (checked to 3 more characters), and True, within finite
    bounds, where a completion of at most 3 more characters is valid, on seeded random bounds and steps."""
    rng = random.Random(27)
    values = {prefix: [Fraction(text) for text in _completions(prefix, 3)] for prefix in PREFIXES}
    refused = 0
    for _ in range(150):
        step = Fraction(rng.choice(["0.25", "0.5", "0.1", "3", "0.3", "2.5", "0.05"]))
        low = Fraction(rng.randint(-20, 20)) if rng.random() < 0.7 else None
        high = None if low is None and rng.random() < 0.3 else Fraction(rng.randint(0, 120))
        if low is not None and high is not None and low > high:
            low, high = high, low
        bounds = NumberBounds(low, high, rng.random() < 0.3, rng.random() < 0.3, (step,))
        for prefix in PREFIXES:
            exists = any(_allowed(value, bounds) for value in values[prefix])
            if not number_prefix_viable(prefix, bounds):
                assert not exists, (prefix, bounds)
                refused += 1
            elif low is not None and high is not None:
                assert exists, (prefix, bounds)
    assert refused > 100  # the refusals are exercised


@pytest.mark.parametrize(
    ("prefix", "viable"),
    [("0.2", True), ("0.25", True), ("0.28", False), ("0.5", True), ("0.", True), ("1", True), ("100", True),
     ("100.", True), ("100.5", False), ("101", False), ("1000", False), ("-", True), ("-0", True), ("-0.2", False)],
)  # fmt: skip
def test_a_price_in_quarters(prefix: str, viable: bool) -> None:
    bounds = bounds_of({"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100})
    assert bounds is not None and number_prefix_viable(prefix, bounds) is viable


def test_what_asks_nothing_of_a_prefix() -> None:
    assert bounds_of({"type": "number", "minimum": 0}) is None  # the grammar bounds it exactly
    assert bounds_of({"type": "integer", "multipleOf": 3}) == NumberBounds(steps=(Fraction(3), Fraction(1)))
    assert number_prefix_viable("1e", NumberBounds(steps=(Fraction(7),)))  # an exponent: judged at the end
    exclusive = bounds_of({"multipleOf": 0.5, "exclusiveMinimum": 1, "exclusiveMaximum": 2})
    assert exclusive is not None
    verdicts = [number_prefix_viable(p, exclusive) for p in ("1", "1.", "1.5", "1.0", "2")]
    assert verdicts == [True, True, True, False, False]
    assert list(itertools.islice(_completions("0.", 1), 3)) == ["0.0", "0.1", "0.2"]
