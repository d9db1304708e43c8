"""Whether a JSON number being written can still end valid: its prefix against bounds and ``multipleOf``.

A grammar can bound a number but cannot say "a multiple of 0.25". Checked only once the number ends,
``0.28`` would be a dead end: no digit written after it makes a multiple of 0.25, and a host that
samples from the mask with no way back (vLLM) would write digits until ``max_tokens``. So the value
scanner asks :func:`number_prefix_viable` of each number prefix where ``multipleOf`` applies, and the
mask refuses a digit after which no valid number can follow.

The numbers a prefix can still become, written without an exponent (the grammars of bounded numbers
have none; a prefix holding one is taken as viable):

- ``-``: every negative number, and zero;
- ``0`` (or ``-0``): ``[0, 1)`` (``(-1, 0]``);
- an integer part ``N`` not starting with 0: ``[N·10^j, (N+1)·10^j)`` for every ``j >= 0``;
- ``N.d₁…d_f``: ``[v, v + 10^-f)`` where ``v`` is the prefix's value (mirrored for a negative number).

Exact rational arithmetic (``fractions.Fraction``). A verdict of False is a proof; where a rule does not
apply, the answer is True (the check at the number's end still runs).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["NumberBounds", "bounds_of", "number_prefix_viable", "viable_under"]

_PREFIX = re.compile(r"(-?)(0|[1-9][0-9]*)?(?:(\.)([0-9]*))?")
_MAX_SCALES = 400
"""How many ``10^j`` scales of an integer prefix are tried before answering True (never reached with a
finite bound: the scales pass it first)."""


@dataclass(frozen=True, slots=True)
class NumberBounds:
    """What one subschema asks of a number: its bounds (None: unbounded; ``*_open``: exclusive) and the
    steps it must be a multiple of (``multipleOf``; 1 for ``"type": "integer"``)."""

    low: Fraction | None = None
    high: Fraction | None = None
    low_open: bool = False
    high_open: bool = False
    steps: tuple[Fraction, ...] = ()


def number_prefix_viable(text: str, bounds: NumberBounds) -> bool:
    """Whether the JSON number prefix ``text`` can still become a number that ``bounds`` allows: within
    both bounds and a multiple of each step (each step on its own: two steps together are not proven)."""
    found = _PREFIX.fullmatch(text)
    if found is None or not text:
        return True  # an exponent, or not a number: judged when it ends
    sign, whole, dot, fraction = found.groups()
    negative = sign == "-"
    if whole is None:
        if dot:
            return True  # not JSON ("-." or "."): the grammar refuses it
        return _any_in(None, Fraction(0), False, False, bounds)  # "-": any negative number, or zero
    if dot or whole == "0":
        digits = fraction or ""
        start = Fraction(int(whole + digits), 10 ** len(digits))
        width = Fraction(1, 10 ** len(digits))
        return _mirrored(start, start + width, negative, bounds)
    value = int(whole)
    for scale in range(_MAX_SCALES):
        low, high = Fraction(value * 10**scale), Fraction((value + 1) * 10**scale)
        limit = bounds.low if negative else bounds.high
        if limit is not None and (-limit if negative else limit) < low:
            return False  # every longer integer part is past the bound
        if _mirrored(low, high, negative, bounds):
            return True
    return True


def _mirrored(low: Fraction, high: Fraction, negative: bool, bounds: NumberBounds) -> bool:
    """Whether ``[low, high)`` (positive magnitudes; negated when ``negative``: ``(-high, -low]``) holds an
    allowed number."""
    if negative:
        return _any_in(-high, -low, True, False, bounds)
    return _any_in(low, high, False, True, bounds)


def _any_in(low: Fraction | None, high: Fraction, low_open: bool, high_open: bool, bounds: NumberBounds) -> bool:
    """Whether the interval from ``low`` (None: unbounded) to ``high`` meets the bounds in a multiple of
    every step (each on its own)."""
    if bounds.low is not None and (low is None or bounds.low > low or (bounds.low == low and bounds.low_open)):
        low, low_open = bounds.low, bounds.low_open
    if bounds.high is not None and (bounds.high < high or (bounds.high == high and bounds.high_open)):
        high, high_open = bounds.high, bounds.high_open
    if low is not None and (low > high or (low == high and (low_open or high_open))):
        return False
    return all(_multiple_in(low, high, low_open, high_open, step) for step in bounds.steps)


def _multiple_in(low: Fraction | None, high: Fraction, low_open: bool, high_open: bool, step: Fraction) -> bool:
    if step <= 0:
        return True  # not a valid multipleOf: the schema's validator judges it
    top = high // step  # the largest multiple at or below ``high``
    if high_open and top * step == high:
        top -= 1
    if low is None:
        return True
    bottom = -((-low) // step)  # the smallest multiple at or above ``low``
    if low_open and bottom * step == low:
        bottom += 1
    return bool(bottom <= top)


def bounds_of(node: object) -> NumberBounds | None:
    """The :class:`NumberBounds` of one subschema (a dict), or None where it asks nothing of a number's
    value that a prefix could break (no ``multipleOf`` beyond integers)."""
    if not isinstance(node, dict):
        return None
    steps: list[Fraction] = []
    step = node.get("multipleOf")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0:
        steps.append(Fraction(str(step)))
    if not steps:
        return None
    if node.get("type") == "integer":
        steps.append(Fraction(1))

    def number(key: str) -> Fraction | None:
        value = node.get(key)
        return Fraction(str(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    low, high = number("minimum"), number("maximum")
    low_open = high_open = False
    for key, bound in (("exclusiveMinimum", low), ("exclusiveMaximum", high)):
        exclusive = number(key)
        if exclusive is None:
            continue
        if key == "exclusiveMinimum" and (bound is None or exclusive >= bound):
            low, low_open = exclusive, True
        if key == "exclusiveMaximum" and (bound is None or exclusive <= bound):
            high, high_open = exclusive, True
    return NumberBounds(low, high, low_open, high_open, tuple(steps))


def viable_under(text: str, alternatives: Sequence[Sequence[NumberBounds]]) -> bool:
    """Whether ``text`` can still become a valid number under some alternative (each a conjunction of
    subschemas' bounds; an empty conjunction asks nothing)."""
    return any(all(number_prefix_viable(text, bounds) for bounds in conjunction) for conjunction in alternatives)
