"""Compiling a constraint for a tokenizer: cached, shared, thread-safe.

:func:`compile` turns a constraint into a :class:`CompiledConstraint` (the
tokenizer-bound grammar, plus what it enforces) once per (constraint,
tokenizer) pair; per-request state lives in :class:`~constrain.match.matcher.Matcher`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import llguidance
import xgrammar as xgr

from constrain.backends import llguidance as llg
from constrain.backends.tokenizer import TokenizerInfo, tokenizer_info
from constrain.compile.cache import ByteLRU
from constrain.constraints.constraint import (
    MAX_WHITESPACE,
    SEPARATORS,
    Choice,
    Constraint,
    EmbeddedJson,
    Grammar,
    JsonSchema,
    Regex,
    _engine_message,
)
from constrain.constraints.schema import CoverageEntry, prepare
from constrain.errors import CompileError
from constrain.match.keys import may_repeat_keys
from constrain.match.validate import schema_validator
from constrain.match.values import CallChecks, ValueChecks

__all__ = [
    "AUTO_LIMITS",
    "CACHE_MAX_BYTES",
    "ENGINES",
    "AutoLimits",
    "CompiledConstraint",
    "cache_stats",
    "choice_ebnf",
    "compile",
]

CACHE_MAX_BYTES = 1 << 30
"""Default bound of the compiled-constraint cache: 1 GiB of compiled grammars."""


@dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer: immutable and shareable across requests and threads.

    ``engine`` is ``"xgrammar"`` (``grammar`` set: masks precomputed at compile
    time) or ``"llguidance"`` (``llg_template`` set: a matcher each request
    copies; masks computed lazily). ``coverage`` (JSON Schema only) says, per JSON
    pointer and keyword, whether the grammar enforces it, or the result is checked
    afterwards, or it was approximated (lenient) or ignored (annotations): see
    :mod:`constrain.constraints.schema`.
    """

    constraint: Constraint
    tokenizer: TokenizerInfo
    grammar: xgr.CompiledGrammar | None
    coverage: tuple[CoverageEntry, ...] = ()
    engine_schema: Any = None  # the schema as rewritten for the engine (JSON Schema only)
    llg_template: Any = None  # llguidance.LLMatcher in the initial state (engine "llguidance")
    llg_grammar_bytes: int = 0
    unique_keys: bool = False  # the grammar may admit a key twice: matchers mask that out (constrain.match.keys)
    # keywords beyond the grammar, checked per value (constrain.match.values); CallChecks: a grammar's embedded JSON
    value_checks: ValueChecks | CallChecks | None = None
    # closing paths from the initial state, per max_tokens (filled by constrain.match.closing.Budget: every
    # request of this constraint starts there, and the search can take thousands of masks)
    initial_closings: dict[int, list[int] | None] = field(default_factory=dict, repr=False)

    @property
    def engine(self) -> str:
        """``"xgrammar"`` or ``"llguidance"``: which grammar engine serves this constraint."""
        return "xgrammar" if self.grammar is not None else "llguidance"

    @property
    def vocab_size(self) -> int:
        """Width of the logits (and of the bitmask, in bits) this constraint serves."""
        return self.tokenizer.vocab_size

    @property
    def memory_size_bytes(self) -> int:
        if self.grammar is None:
            return self.llg_grammar_bytes
        return int(self.grammar.memory_size_bytes)

    @property
    def fully_enforced(self) -> bool:
        """True when the mask guarantees every keyword (the grammar, and value checks where a keyword is
        beyond it): nothing is left to post-validation but a reported dead end."""
        return all(entry.status in ("enforced", "ignored") for entry in self.coverage)

    def matcher(self, *, max_rollback_tokens: int = -1) -> Any:
        """A fresh per-request :class:`~constrain.match.matcher.Matcher` (``-1``: unbounded rollback)."""
        from constrain.match.matcher import Matcher

        return Matcher(self, max_rollback_tokens=max_rollback_tokens)

    def validate(self, text: str) -> list[str]:
        """The violations of the whole constraint by the finished ``text``; empty when it satisfies it.

        Includes keywords the grammar cannot enforce. Does not change any state.
        """
        from constrain.match.validate import validate

        return validate(self, text)


_compilers: dict[str, xgr.GrammarCompiler] = {}
_compilers_lock = threading.Lock()
_cache: ByteLRU[CompiledConstraint] = ByteLRU(CACHE_MAX_BYTES, lambda c: c.memory_size_bytes)
_budget_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="constrain-compile")


def _compiler(info: TokenizerInfo) -> xgr.GrammarCompiler:
    with _compilers_lock:
        compiler = _compilers.get(info.fingerprint)
        if compiler is None:
            # our own cache sits in front; xgrammar's would hold a second copy of every grammar
            compiler = xgr.GrammarCompiler(info.xgr_info, cache_enabled=False)
            _compilers[info.fingerprint] = compiler
        return compiler


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(options: tuple[str, ...]) -> str:
    """The EBNF grammar of a :class:`~constrain.constraints.constraint.Choice`."""
    alternatives = " | ".join(_ebnf_string(o) if o else '""' for o in options)
    return f"root ::= {alternatives}\n"


OPEN_KEY_RULES_MAX = 16
"""An open object (extra keys allowed) makes the engine spell out "any key but the declared
ones" as a trie of rules, one per prefix of a declared name; past this many such rules
in a schema, extra keys become any string instead. Measured on a 20-property object
with the SmolLM2 tokenizer: 251 ms to compile exactly, 9 ms with any-string keys."""

AT_BOUNDARIES = "enforced by the mask at value boundaries (a dead end, where no valid value is left, is reported)"
"""The coverage note of a keyword beyond the grammar that :mod:`constrain.match.values` enforces."""

_OPEN_KEYS_NOTE = (
    "extra keys of open objects are any string (a declared key may take that path with another value); "
    "values are validated afterwards"
)
_ANY_ORDER_REQUIRED_NOTE = (
    "xgrammar with properties in any order can skip a required key beside optional or extra keys; validated afterwards"
)
_SCHEMA_WIDE = {"properties": _OPEN_KEYS_NOTE, "required": _ANY_ORDER_REQUIRED_NOTE}
"""Schema-wide looseness: the keyword checked wherever it appears, when coverage has the note."""
_EXCLUDED_KEY_RULE = re.compile(r"^(\S+_addl_key) ::= ")
_EXCLUDED_KEY_PART = re.compile(r"^\S+_addl_key_\d+ ::= ")


_CHARACTERS_RULE = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTER = r"(([^\"\\\0-\x1f]))"
"""xgrammar spells one character of a string with a length bound as ``[^"\\\r\n]``, which lets raw
control characters through (invalid JSON): this is JSON's unescaped character. (Escapes stay out: an
alternation here makes xgrammar's masks 300x slower, 14 ms instead of 49 µs, measured.)"""


_ANY_SEPARATOR = re.compile(r'^((?:basic_array_items|basic_object_properties) ::= \(\()", "', re.MULTILINE)
"""xgrammar 0.2.8 writes the separator of untyped values (``{}``, an open object's extra values) as
``", "`` whatever ``separators`` says, so compact output of ``{"type": "object"}`` rejected
``{"a":[1,2]}`` where llguidance accepted it: compact means ``","`` there too."""


def _open_extra_keys(ebnf: str) -> str | None:
    """The grammar with extra-key exclusion tries replaced by ``basic_string``, or None to keep it exact."""
    lines = ebnf.split("\n")
    if sum(bool(_EXCLUDED_KEY_PART.match(line)) for line in lines) <= OPEN_KEY_RULES_MAX:
        return None
    if not any(line.startswith("basic_string ::= ") for line in lines):
        return None
    kept = []
    for line in lines:
        if _EXCLUDED_KEY_PART.match(line):
            continue
        found = _EXCLUDED_KEY_RULE.match(line)
        kept.append(f"{found.group(1)} ::= basic_string" if found else line)
    return "\n".join(kept)


@functools.lru_cache(maxsize=256)
def _prepared(constraint: JsonSchema) -> tuple[Any, tuple[CoverageEntry, ...]]:
    """The schema rewritten for the engines, and its coverage (both engines start from it; do not mutate)."""
    return prepare(constraint.schema_value, lenient=constraint.lenient, closed=constraint.closed)


@functools.lru_cache(maxsize=64)
def _json_schema_grammar(constraint: JsonSchema) -> tuple[str, tuple[CoverageEntry, ...]]:
    """xgrammar's EBNF for a JSON schema constraint, and the coverage; pure, memoized."""
    engine_schema, coverage = _prepared(constraint)
    fixed = SEPARATORS.get(constraint.whitespace)
    ebnf = str(
        xgr.Grammar.from_json_schema(
            json.dumps(engine_schema, ensure_ascii=False),
            any_whitespace=fixed is None,
            separators=fixed,
            strict_mode=False,  # closing is written into the prepared schema, the same for both engines
            max_whitespace_cnt=None if fixed else MAX_WHITESPACE[constraint.whitespace],
            any_order=constraint.property_order == "any",
        )
    )
    ebnf = _CHARACTERS_RULE.sub(lambda found: f"{found.group(1)} ::= {_JSON_CHARACTER}", ebnf)
    if fixed is not None:
        ebnf = _ANY_SEPARATOR.sub(rf'\1"{fixed[0]}"', ebnf)
    if constraint.property_order == "any" and '"required"' in json.dumps(engine_schema):
        coverage += (CoverageEntry("", "required", "checked", _ANY_ORDER_REQUIRED_NOTE),)
    opened = None if constraint.closed else _open_extra_keys(ebnf)  # closed: extra keys are declared, kept exact
    if opened is not None:
        ebnf = opened
        coverage += (CoverageEntry("", "additionalProperties", "checked", _OPEN_KEYS_NOTE),)
    return ebnf, coverage


def _build(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    compiler = _compiler(info)
    try:
        if isinstance(constraint, JsonSchema):
            ebnf, coverage = _json_schema_grammar(constraint)
            grammar = compiler.compile_grammar(ebnf)
            prepared = _prepared(constraint)[0]
            checks, coverage = _value_checks(constraint, coverage)
            return CompiledConstraint(
                constraint, info, grammar, coverage, prepared, unique_keys=_unique_keys(constraint, prepared),
                value_checks=checks,
            )  # fmt: skip
        if isinstance(constraint, Regex):
            return CompiledConstraint(constraint, info, compiler.compile_regex(constraint.pattern))
        if isinstance(constraint, Grammar):
            compiled = compiler.compile_grammar(constraint.ebnf)
            return CompiledConstraint(constraint, info, compiled, value_checks=_embedded_checks(constraint.embedded))
        if isinstance(constraint, Choice):
            return CompiledConstraint(constraint, info, compiler.compile_grammar(choice_ebnf(constraint.options)))
    except RuntimeError as err:
        raise CompileError(f"the grammar engine could not compile the constraint: {_engine_message(err)}") from err
    raise ValueError(
        f"compile() takes a constraint from constrain.json_schema/regex/grammar/choice, got {type(constraint).__name__}"
    )


def _build_llguidance(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    if not isinstance(constraint, (JsonSchema, Regex)):
        raise CompileError(f"the llguidance engine serves JSON schemas and regexes, not {type(constraint).__name__}")
    tokenizer = info.llg_tokenizer()
    if tokenizer is None:
        raise CompileError("the llguidance engine needs a fast Hugging Face tokenizer")
    engine_schema, coverage = _prepared(constraint) if isinstance(constraint, JsonSchema) else (None, ())
    if engine_schema is not None:
        engine_schema, refused = llg.llguidance_schema(engine_schema)
        coverage += refused
    text = llg.grammar_for(constraint, engine_schema)
    try:
        template = llguidance.LLMatcher(tokenizer, text)
    except ValueError as err:
        raise CompileError(f"llguidance could not compile the constraint: {err}") from err
    if template.is_error():
        raise CompileError(f"llguidance could not compile the constraint: {template.get_error()}")
    unique_keys = isinstance(constraint, JsonSchema) and _unique_keys(constraint, engine_schema)
    checks, coverage = _value_checks(constraint, coverage) if isinstance(constraint, JsonSchema) else (None, ())
    return CompiledConstraint(
        constraint, info, None, coverage, engine_schema, template, len(text), unique_keys=unique_keys,
        value_checks=checks,
    )  # fmt: skip


def _unique_keys(constraint: JsonSchema, prepared: Any) -> bool:
    return may_repeat_keys(prepared, any_order=constraint.property_order == "any")


def _value_checks(
    constraint: JsonSchema, coverage: tuple[CoverageEntry, ...]
) -> tuple[ValueChecks | None, tuple[CoverageEntry, ...]]:
    """The value checks of a schema whose grammar is not exact somewhere (None where it is exact), and
    the coverage with what they enforce marked so."""
    validator = schema_validator(constraint.schema)
    notes = {e.note for e in coverage if e.pointer == ""}
    everywhere = [key for key, note in _SCHEMA_WIDE.items() if note in notes]
    checks = ValueChecks(validator.schema, validator, coverage, everywhere)
    if not checks.needs(checks.root_location):
        return None, coverage
    enforced = tuple(
        replace(e, status="enforced", note=f"{AT_BOUNDARIES} ({e.note})" if e.note else AT_BOUNDARIES)
        if e.status == "checked"
        else e
        for e in coverage
    )
    return checks, enforced


def _embedded_checks(embedded: EmbeddedJson | None) -> CallChecks | None:
    """The checks of a grammar's embedded JSON values (tool arguments), or None where every one of their
    grammars is exact (the others are followed only to see where they end)."""
    if embedded is None:
        return None
    found = {name: _value_checks(schema, _json_schema_grammar(schema)[1])[0] for name, schema in embedded.schemas}
    if all(checks is None for checks in found.values()):
        return None
    plain = ValueChecks({}, schema_validator("{}"), ())
    return CallChecks(embedded, {name: checks or plain for name, checks in found.items()})


def _build_auto(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    """llguidance, or xgrammar where llguidance refuses the constraint (e.g. a format it does not know)."""
    try:
        return _build_llguidance(constraint, info)
    except CompileError:
        return _build(constraint, info)


ENGINES = ("auto", "xgrammar", "llguidance")


@dataclass(frozen=True, slots=True)
class AutoLimits:
    """When ``engine="auto"`` serves a JSON schema or regex with llguidance instead of xgrammar.

    xgrammar precomputes a token-mask cache per grammar position, so its masks are the fastest,
    but some grammars take it 50 ms to seconds to compile; llguidance computes masks lazily and
    compiles in about a millisecond. Any limit reached sends the constraint to llguidance. Fitted
    on 1,996 MaskBench schemas with SmolLM2's tokenizer (xgrammar 0.2.8, 2 CPU cores): 405 go to
    llguidance, and 13 of the rest took xgrammar over 45 ms to compile (73 with the previous rule:
    450 rules or repetitions adding up to 120). The choice is a pure function of the constraint.
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
    excluded_keys: int = 12
    """Rules of the "any key but the declared ones" tries of open objects (12 to 16 cost about 60 ms; 3 keys
    make 9 rules, which cost about 40 ms)."""


AUTO_LIMITS = AutoLimits()

_REPEAT = re.compile(r"\{(\d+),\s*(-?\d+)\}")
_PATTERN_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def _repeat_sum(bounds: list[int]) -> int:
    return sum(min(b, 300) for b in bounds if b >= 0)


@functools.lru_cache(maxsize=1024)
def _auto_engine(constraint: Constraint) -> str:
    """The engine ``"auto"`` picks for ``constraint`` (see :class:`AutoLimits`); pure, memoized."""
    limits = AUTO_LIMITS
    if isinstance(constraint, Regex):
        bounds = [int(hi or lo) for lo, hi in _PATTERN_REPEAT.findall(constraint.pattern)]
        return "llguidance" if 2 * _repeat_sum(bounds) >= limits.repeat else "xgrammar"
    if not isinstance(constraint, JsonSchema):
        return "xgrammar"
    try:
        if len(json.dumps(_prepared(constraint)[0])) > limits.schema_chars:
            return "llguidance"
        ebnf = _json_schema_grammar(constraint)[0]  # what xgrammar would compile
    except Exception:  # the build reports it
        return "xgrammar"
    repeats = _REPEAT.findall(ebnf)
    lines = ebnf.split("\n")
    in_patterns = [int(hi or lo) for line in lines if "Regex(" in line for lo, hi in _PATTERN_REPEAT.findall(line)]
    heavy = (
        len(lines) > limits.rules
        or _repeat_sum([int(hi) for _, hi in repeats]) + 2 * _repeat_sum(in_patterns) >= limits.repeat
        or _repeat_sum([int(lo) for lo, _ in repeats]) >= limits.repeat_min
        or sum(bool(_EXCLUDED_KEY_PART.match(line)) for line in lines) >= limits.excluded_keys
    )
    return "llguidance" if heavy else "xgrammar"


def compile(
    constraint: Constraint,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    eos_token_ids: list[int] | None = None,
    timeout_s: float | None = None,
    engine: str = "auto",
) -> CompiledConstraint:
    """Compile ``constraint`` for ``tokenizer``; cached (a repeat costs a dictionary lookup).

    Parameters
    ----------
    constraint : a value from ``constrain.json_schema``, ``regex``, ``grammar``, ``choice``
    tokenizer : a Hugging Face tokenizer, or a :class:`~constrain.backends.tokenizer.TokenizerInfo`
    vocab_size : int or None, default: None
        The model's vocabulary size, if padded beyond the tokenizer.
    eos_token_ids : list of int or None, default: None
        Every id that ends generation (default: the engine's detection).
    timeout_s : float or None, default: None (no limit)
        Compile-time budget in seconds: past it, :class:`CompileError` is
        raised at once (the engine finishes in the background and caches the result).
    engine : "auto", "xgrammar" or "llguidance", default: "auto"
        The grammar engine. ``"auto"``: xgrammar (fastest masks), except for JSON
        schemas and regexes it would take long to compile (:class:`AutoLimits`),
        which llguidance serves where it supports them. Both enforce the same
        language, except that llguidance takes properties in the schema's order only.

    Raises
    ------
    UnsupportedSchemaError, SchemaError
        From the schema preparation (strict mode refusals, dangling ``$ref``).
    CompileError
        The engine failed, or the budget ran out.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    info = tokenizer_info(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    if engine == "auto":  # "auto" served by llguidance keeps its own key: it falls back to xgrammar
        engine = "auto" if info.llg_future is not None and _auto_engine(constraint) == "llguidance" else "xgrammar"
    key = (constraint, info.fingerprint, engine)
    build = {"xgrammar": _build, "llguidance": _build_llguidance, "auto": _build_auto}[engine]
    if timeout_s is None:
        return _own_type(_cache.get_or_create(key, lambda: build(constraint, info)), constraint)
    future = _budget_pool.submit(_cache.get_or_create, key, lambda: build(constraint, info))
    try:
        return _own_type(future.result(timeout=timeout_s), constraint)
    except FutureTimeout as err:
        raise CompileError(f"compiling took longer than the budget of {timeout_s:g} s") from err


def _own_type(compiled: CompiledConstraint, constraint: Constraint) -> CompiledConstraint:
    """``compiled`` for ``constraint``: the cache compares JSON schemas without their Python type, so
    ``schema=Model`` and ``schema=Model.model_json_schema()`` share a grammar, not a type (the result's
    ``value`` is built from it). The copy shares everything else, its closing cache included."""
    mine = getattr(constraint, "python_type", None)
    if getattr(compiled.constraint, "python_type", None) is mine:
        return compiled
    return dataclasses.replace(compiled, constraint=constraint)


def cache_stats() -> dict[str, int]:
    """Entries, bytes held, hits and misses of the compile cache."""
    return {"entries": len(_cache), "bytes": _cache.nbytes, "hits": _cache.hits, "misses": _cache.misses}
