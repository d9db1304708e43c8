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

__all__ = ["AUTO_LIMITS", "ENGINES", "AutoLimits", "auto_engine", "default_xgrammar_wait"]

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


@dataclass(frozen=True, slots=True)
class AutoLimits:
    """When ``engine="auto"`` serves a JSON schema or regex with llguidance instead of xgrammar.

    xgrammar precomputes a token-mask cache per grammar position, so its masks are the fastest,
    but some grammars take it 50 ms to seconds to compile; llguidance computes masks lazily and
    compiles in about a millisecond. Any limit reached sends the constraint to llguidance. Fitted
    on 1,996 MaskBench schemas with SmolLM2's tokenizer (xgrammar 0.2.8, 2 CPU cores): 405 go to
    llguidance, and 13 of the rest took xgrammar over 45 ms to compile (73 with the previous rule:
    450 rules or repetitions adding up to 120); ``excluded_keys`` was lowered since (see there).
    Pass other limits as ``compile(..., auto_limits=)``.

    Where no limit is reached, xgrammar still may take long: ``xgrammar_wait_s`` bounds the wait.
    """

    schema_chars: int = 10_000
    """Characters of the prepared schema (annotations dropped): past it, xgrammar's grammar is not even built."""
    rules: int = 450
    """Rules of xgrammar's grammar."""
    repeat: int = 40
    """Upper bounds of bounded repetitions added up (``maxLength``, ``maxItems``; each counted up to 300),
    those inside a ``pattern`` twice (``^[A-Za-z]{1,32}$`` alone: 107 ms). ``maxLength: 1024`` alone: 0.8 s."""
    repeat_min: int = 40
    """Lower bounds of repetitions added up (``minLength``, ``minItems``, required-key counts)."""
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
        if len(json.dumps(prepared(constraint)[0])) > limits.schema_chars:
            return "llguidance"
        ebnf = json_schema_ebnf(constraint)[0]  # what xgrammar would compile
    except Exception:  # the build reports it
        return "xgrammar"
    repeats = _REPEAT.findall(ebnf)
    lines = ebnf.split("\n")
    in_patterns = [int(hi or lo) for line in lines if "Regex(" in line for lo, hi in _PATTERN_REPEAT.findall(line)]
    heavy = (
        len(lines) > limits.rules
        or _repeat_sum([int(hi) for _, hi in repeats]) + 2 * _repeat_sum(in_patterns) >= limits.repeat
        or _repeat_sum([int(lo) for lo, _ in repeats]) >= limits.repeat_min
        or excluded_key_rules(ebnf) >= limits.excluded_keys
    )
    return "llguidance" if heavy else "xgrammar"
