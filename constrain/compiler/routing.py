"""Which engine serves a constraint under ``engine="auto"``: a pure function of the constraint and the limits."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from constrain.backends.xgrammar import excluded_key_rules
from constrain.caches import bounded
from constrain.compiler.json_schema import json_schema_ebnf, prepared
from constrain.constraints.constraint import Constraint, JsonSchema, Regex

__all__ = ["AUTO_LIMITS", "ENGINES", "RULES", "AutoLimits", "auto_engine", "default_xgrammar_wait", "slow_for_xgrammar"]

ENGINES = ("auto", "xgrammar", "llguidance")
"""What ``compile(engine=...)`` takes."""


def default_xgrammar_wait() -> float | None:
    """0.05 s where this process may run on 4 CPUs or more; None (no background compile) on fewer.

    On 2 cores a background compile slows everything else the process does (Intel Xeon family 6 model
    207, 2 cores, 2026-11-27): a large schema's preparation took 1.3 to 1.8 times its CPU time alone in 2
    trials of 3 while one went on at the lowest priority, and on MaskBench's 400-schema sample, waits
    of 20 and 50 ms brought the time to first mask at p99 no gain over none (104 and 117 ms, against 151
    ms in a run as noisy) while a drawn token's check at p99 grew (1,058 and 1,001 µs, against 850)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0.05 if cores >= 4 else None


RULES = 120
"""Default :attr:`AutoLimits.rules`, lowered from 450 on 2026-11-27 (SmolLM2's tokenizer, Intel Xeon family 6
model 207, 2 cores; xgrammar's compile alone, one run each). Of the schemas xgrammar serves under the
default limits, in MaskBench's 400-schema sample and in 500 other dev schemas, 2 of 246 and 2 of 296 took
it over 40 ms in specification mode, where keys in any order make large grammars (with 450 rules: 20 and
12), and 0 of 295 and 7 of 355 in generation mode. Of the 63 and 91 specification-mode schemas that the
limits move to llguidance, 1 and 8 had compiled in under 15 ms."""


@dataclass(frozen=True, slots=True)
class AutoLimits:
    """When ``engine="auto"`` serves a JSON schema or regex with llguidance instead of xgrammar.

    xgrammar precomputes a token-mask cache per grammar position, so its masks are the fastest,
    but some grammars take it 50 ms to seconds to compile; llguidance computes masks lazily and
    compiles in about a millisecond. Any limit reached sends the constraint to llguidance. Fitted
    on 1,996 MaskBench schemas with SmolLM2's tokenizer (xgrammar 0.2.8, 2 CPU cores): 405 go to
    llguidance, and 13 of the rest took xgrammar over 45 ms to compile (73 with the previous rule:
    450 rules or repetitions adding up to 120); ``excluded_keys``, ``rules`` and ``string_repeat``
    were set since (see each). Pass other limits as ``compile(..., auto_limits=)``.

    Where no limit is reached, xgrammar still may take long: ``xgrammar_wait_s`` bounds the wait.
    """

    schema_chars: int = 10_000
    """Characters of the prepared schema (annotations dropped): past it, xgrammar's grammar is not even built."""
    any_order_schema_chars: int = 3_000
    """:attr:`schema_chars` where keys may come in any order (``property_order="any"``, the default of
    specification mode), whose grammars xgrammar spells out with many more rules. On MaskBench's
    400-schema sample in specification mode, all 57 schemas of 3,000 characters or more went to llguidance
    by the other limits anyway (2026-11-27); building the grammar that says so took 3 to 18 ms each below
    10,000 characters."""
    rules: int = RULES
    """Rules of xgrammar's grammar (its EBNF's lines): see :data:`RULES`."""
    string_repeat: int = 10
    """A string's length bounds (``maxLength``, and ``minLength`` twice), added up over the distinct pairs
    of bounds. xgrammar spells a bounded string as a repetition of one broad character class, whose compile
    grows faster than the bound (SmolLM2's tokenizer, Intel Xeon family 6 model 207, 2 cores, fastest of
    3): ``maxLength`` 5, 8, 10, 15 and 30 took 7, 18, 31, 60 and 145 to 253 ms; ``minLength`` 1, 3, 5
    and 10 took 14, 20, 32 and 53 ms (a plain string: 5 ms). Strings with the same bounds share their
    rule: four with ``minLength: 1`` took 14 ms, one 13.5 ms."""
    repeat: int = 40
    """Upper bounds of the other bounded repetitions added up (``maxItems``; each counted up to 300), those
    inside a ``pattern`` twice (``^[A-Za-z]{1,32}$`` alone: 107 ms)."""
    patterns: int = 3
    """Regular expressions in xgrammar's grammar (its ``Regex(...)`` rules: strings' ``pattern`` s, keys'
    ``patternProperties``). Set on 2026-11-28 over the 3,350 MaskBench dev schemas the other limits gave
    xgrammar in specification mode (SmolLM2's tokenizer, Intel Xeon family 6 model 167, 2 cores, beside other
    work): of the 32 with 3 or more, 5 took xgrammar over 35 ms to compile and 11 over 25 ms (median 19.6 ms),
    and llguidance at most 8.2 ms; of all 3,350, 16 took xgrammar over 35 ms."""
    repeat_min: int = 40
    """Lower bounds of the other repetitions added up (``minItems``, required-key counts)."""
    excluded_keys: int = 6
    """Rules of the "any key but the declared ones" tries of open objects (one rule per prefix of a declared
    key, and one for the whitespace after it: a single key ``increment`` makes 11, which cost xgrammar 90 to
    110 ms). Lowered from 12 on 2026-11-27 (Intel Xeon family 6 model 207, 2 cores): over the whole dev
    set, 213 (schema, mode) pairs moved to llguidance; their TTFM fell from 12.98 s to 0.55 s in all, and
    they passed alike but for two (specification mode: one more passing, where xgrammar's mask let an
    invalid instance through; generation mode: one fewer, a valid instance in another key order)."""
    xgrammar_wait_s: float | None = field(default_factory=default_xgrammar_wait)
    """Seconds, counted from the ``compile`` call, that a JSON schema or regex routed to xgrammar is waited
    for. Past them, the compile returns the constraint served by llguidance, which compiles in a few
    milliseconds, and xgrammar's compile goes on in the background, at the lowest CPU priority: once it
    ends, ``compile`` returns xgrammar's for the same constraint (a matcher keeps the engine it was made
    with). The two engines enforce the same language but for the differences listed in the schemas guide,
    so which one serves a request then depends on timing. At most
    :data:`~constrain.compiler.background.MAX_UPGRADES` such compiles run at once; past that, llguidance
    serves the constraint and xgrammar is not started. None: wait for xgrammar, however long it takes (a
    fixed engine per constraint). Default: :func:`default_xgrammar_wait`."""

    def __post_init__(self) -> None:
        if self.xgrammar_wait_s is not None and not self.xgrammar_wait_s >= 0:
            raise ValueError(f"xgrammar_wait_s must be None or seconds >= 0, got {self.xgrammar_wait_s!r}")


AUTO_LIMITS = AutoLimits()
"""The default limits."""

_REPEAT = re.compile(r"\{(\d+),\s*(-?\d+)\}")
_CHARACTER_RULE = re.compile(r"^(\w+) ::= \(\(\[\^(?:[^\]\\]|\\.)*\]\)\)$", re.MULTILINE)
"""A rule that is one negated character class (any character but a few): what xgrammar repeats to bound
a string's length. Most tokens fit it, hence the cost; a narrow class repeated (a format's ``[0-9]{4}``)
compiles in about a millisecond."""
_PATTERN_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def _repeat_sum(bounds: list[int]) -> int:
    return sum(min(b, 300) for b in bounds if b >= 0)


@bounded("compile.auto_engine", maxsize=1024)
def auto_engine(constraint: Constraint, limits: AutoLimits = AUTO_LIMITS) -> str:
    """The engine ``"auto"`` picks for ``constraint``: ``"llguidance"`` where a limit is reached, else
    ``"xgrammar"``. Pure, memoized."""
    if isinstance(constraint, Regex):
        bounds = [int(hi or lo) for lo, hi in _PATTERN_REPEAT.findall(constraint.pattern)]
        return "llguidance" if 2 * _repeat_sum(bounds) >= limits.repeat else "xgrammar"
    if not isinstance(constraint, JsonSchema):
        return "xgrammar"
    try:
        chars = limits.any_order_schema_chars if constraint.property_order == "any" else limits.schema_chars
        if len(json.dumps(prepared(constraint)[0])) > chars:
            return "llguidance"
        ebnf = json_schema_ebnf(constraint)[0]  # what xgrammar would compile
    except Exception:  # the build reports it
        return "xgrammar"
    return "llguidance" if slow_for_xgrammar(ebnf, limits) else "xgrammar"


def _repeated(ebnf: str, at: int) -> str:
    """What the repetition whose ``{`` is at ``at`` repeats: a rule's name, or a group's text (from its last
    space or parenthesis: no rule's name)."""
    return ebnf[max(ebnf.rfind(" ", 0, at), ebnf.rfind("(", 0, at)) + 1 : at]


def slow_for_xgrammar(ebnf: str, limits: AutoLimits = AUTO_LIMITS) -> bool:
    """Whether xgrammar's grammar ``ebnf`` reaches one of ``limits``' (long to compile)."""
    characters = {rule for rule in _CHARACTER_RULE.findall(ebnf) if not rule.startswith("basic_")}  # not digits
    repeats = [
        (_repeated(ebnf, found.start()) in characters, int(found[1]), int(found[2])) for found in _REPEAT.finditer(ebnf)
    ]
    strings = {(lo, hi) for is_string, lo, hi in repeats if is_string}
    others = [(lo, hi) for is_string, lo, hi in repeats if not is_string]
    lines = ebnf.split("\n")
    regexes = [line for line in lines if "Regex(" in line]
    in_patterns = [int(hi or lo) for line in regexes for lo, hi in _PATTERN_REPEAT.findall(line)]
    return (
        len(lines) > limits.rules
        or len(regexes) >= limits.patterns
        or _repeat_sum([hi for _, hi in strings]) + 2 * _repeat_sum([lo for lo, _ in strings]) >= limits.string_repeat
        or _repeat_sum([hi for _, hi in others]) + 2 * _repeat_sum(in_patterns) >= limits.repeat
        or _repeat_sum([lo for lo, _ in others]) >= limits.repeat_min
        or excluded_key_rules(ebnf) >= limits.excluded_keys
    )
