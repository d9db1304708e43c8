"""Compiling a constraint for a tokenizer: cached, shared, thread-safe.

:func:`compile` turns a constraint into a :class:`CompiledConstraint` (the
tokenizer-bound grammar of one engine, plus what it enforces) once per
(constraint, tokenizer, engine); per-request state lives in
:class:`~constrain.match.matcher.Matcher`, which :meth:`CompiledConstraint.matcher` makes.
What each engine is given is :mod:`~constrain.compiler.json_schema`'s; which engine
``"auto"`` picks is :mod:`~constrain.compiler.routing`'s.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from constrain import caches
from constrain.backends import xgrammar
from constrain.backends.base import CompiledGrammar
from constrain.backends.llguidance import json_schema_grammar, regex_grammar
from constrain.backends.tokenizer import TokenizerInfo, tokenizer_info
from constrain.compiler.background import alongside, at_low_priority, in_background, upgrades
from constrain.compiler.cache import ByteLRU
from constrain.compiler.json_schema import (
    embedded_checks,
    json_schema_ebnf,
    llguidance_schema,
    prepared,
    unique_keys,
    value_checks,
)
from constrain.compiler.routing import AUTO_LIMITS, ENGINES, AutoLimits, auto_engine
from constrain.constraints.constraint import (
    MAX_WHITESPACE,
    SEPARATORS,
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
)
from constrain.constraints.schema import Coverage
from constrain.errors import CompileError
from constrain.match.checks import CallChecks, ValueChecks
from constrain.match.matcher import Matcher
from constrain.match.validate import validate

__all__ = [
    "CACHE_MAX_BYTES", "CACHE_MAX_ENTRIES", "CACHE_SHARE", "CompiledConstraint", "cache_stats", "clear_cache",
    "compile", "default_cache_bytes",
]  # fmt: skip

CACHE_SHARE = 0.01
"""Share of the machine's memory (:func:`constrain.caches.machine_memory`) the compiled-constraint cache
may hold: 235 MiB on a 23.5 GiB machine, about 200 JSON schemas compiled by xgrammar for SmolLM2's
49,152 tokens (1.2 MB each, measured), which a server meeting a new schema per request fills and
then holds (before, 1 GiB: the server's memory grew by 138 MiB over its 300th to 400th such request)."""

CACHE_MAX_BYTES = 1 << 30
"""Ceiling of the compiled-constraint cache's bound: 1 GiB (the floor is 64 MiB)."""

CACHE_MAX_ENTRIES = 1024
"""Most compiled constraints kept, whatever their bytes: an llguidance grammar counts only its text
(it builds the rest lazily, as it is used), so bytes alone would not bound it."""


def default_cache_bytes() -> int:
    """The compiled-constraint cache's bound: :data:`CACHE_SHARE` of the machine's memory, between 64 MiB
    and :data:`CACHE_MAX_BYTES` (the ceiling where the memory cannot be read)."""
    memory = caches.machine_memory()
    return CACHE_MAX_BYTES if memory is None else max(64 << 20, min(int(CACHE_SHARE * memory), CACHE_MAX_BYTES))


@dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer: immutable and shareable across requests and threads.

    ``grammar`` is the engine's compiled grammar (:class:`~constrain.backends.base.CompiledGrammar`;
    ``engine`` names it: xgrammar precomputes masks at compile time, llguidance computes them lazily).
    ``coverage`` (JSON Schema only) says, per JSON pointer and keyword, whether the grammar enforces it,
    or the result is checked afterwards, or it was approximated (lenient) or ignored (annotations): see
    :mod:`constrain.constraints.schema`.
    """

    constraint: Constraint
    tokenizer: TokenizerInfo
    grammar: CompiledGrammar
    coverage: Coverage = field(default_factory=Coverage)
    engine_schema: Any = None  # the schema as rewritten for the engine (JSON Schema only)
    unique_keys: bool = False  # the grammar may admit a key twice: matchers mask that out (constrain.match.keys)
    # keywords beyond the grammar, checked per value (constrain.match.values); CallChecks: a grammar's embedded JSON
    value_checks: ValueChecks | CallChecks | None = None

    @property
    def engine(self) -> str:
        """``"xgrammar"`` or ``"llguidance"``: which grammar engine serves this constraint."""
        return self.grammar.engine

    @property
    def vocab_size(self) -> int:
        """Width of the logits (and of the bitmask, in bits) this constraint serves."""
        return self.tokenizer.vocab_size

    @property
    def memory_size_bytes(self) -> int:
        """Bytes the compiled grammar holds (what the compile cache's bound counts)."""
        return self.grammar.memory_size_bytes

    @property
    def fully_enforced(self) -> bool:
        """True when the mask guarantees every keyword (the grammar, and value checks where a keyword is
        beyond it): nothing is left to post-validation but a reported dead end."""
        return all(entry.status in ("enforced", "ignored") for entry in self.coverage)

    def matcher(self, *, max_rollback_tokens: int = -1) -> Matcher:
        """A fresh per-request :class:`~constrain.match.matcher.Matcher` (``-1``: unbounded rollback)."""
        return Matcher(self, max_rollback_tokens=max_rollback_tokens)

    def validate(self, text: str) -> list[str]:
        """The violations of the whole constraint by the finished ``text``; empty when it satisfies it.

        Includes keywords the grammar cannot enforce. Does not change any state.
        """
        return validate(self, text)


_cache: ByteLRU[CompiledConstraint] = ByteLRU(default_cache_bytes(), lambda c: c.memory_size_bytes, CACHE_MAX_ENTRIES)
"""The compile cache: one per process, bounded in bytes (:func:`default_cache_bytes`) and entries
(:data:`CACHE_MAX_ENTRIES`), reported by ``cache_stats``."""
caches.register(
    "compile.compiled",
    lambda: {"entries": len(_cache), "bytes": _cache.nbytes, "hits": _cache.hits, "misses": _cache.misses,
             "maxsize": _cache.max_bytes, "max_entries": CACHE_MAX_ENTRIES},
)  # fmt: skip


def _build_xgrammar(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    backend = info.xgrammar
    try:
        if isinstance(constraint, JsonSchema):
            ebnf, coverage, tracked = json_schema_ebnf(constraint)
            grammar = backend.compile_ebnf(xgrammar.inline_optional_whitespace(ebnf))
            engine_schema = prepared(constraint)[0]
            checks, coverage = value_checks(constraint, coverage, tracked)
            repeats = unique_keys(constraint, engine_schema, tracked)
            return CompiledConstraint(constraint, info, grammar, coverage, engine_schema, repeats, checks)
        if isinstance(constraint, Regex):
            return CompiledConstraint(constraint, info, backend.compile_regex(constraint.engine_pattern))
        if isinstance(constraint, Grammar):
            grammar = backend.compile_ebnf(constraint.ebnf)
            return CompiledConstraint(constraint, info, grammar, value_checks=embedded_checks(constraint.embedded))
        if isinstance(constraint, Choice):
            return CompiledConstraint(constraint, info, backend.compile_ebnf(xgrammar.choice_ebnf(constraint.options)))
    except RuntimeError as err:
        message = xgrammar.engine_message(err)
        raise CompileError(f"the grammar engine could not compile the constraint: {message}") from err
    raise ValueError(
        f"compile() takes a constraint from constrain.json_schema/regex/grammar/choice, got {type(constraint).__name__}"
    )


def _build_llguidance(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    if not isinstance(constraint, (JsonSchema, Regex)):
        raise CompileError(f"the llguidance engine serves JSON schemas and regexes, not {type(constraint).__name__}")
    backend = info.llguidance()
    if backend is None:
        raise CompileError("the llguidance engine needs a fast Hugging Face tokenizer")
    coverage = Coverage()
    if isinstance(constraint, Regex):
        engine_schema, text = None, regex_grammar(constraint.engine_pattern)
    else:
        engine_schema, coverage = prepared(constraint)
        checked = any(e.status in ("checked", "approximated") for e in coverage)
        engine_schema, refused = llguidance_schema(
            engine_schema, any_order=constraint.property_order == "any", checked=checked
        )
        coverage += refused
        text = json_schema_grammar(
            json.dumps(engine_schema),
            separators=SEPARATORS.get(constraint.whitespace),
            max_whitespace=MAX_WHITESPACE[constraint.whitespace],
        )

    def build() -> CompiledGrammar:
        try:
            return backend.compile(text)
        except ValueError as err:
            raise CompileError(f"llguidance could not compile the constraint: {err}") from err

    if not isinstance(constraint, JsonSchema):
        return CompiledConstraint(constraint, info, build())
    # llguidance compiles without the GIL: the value checks are built meanwhile
    grammar, (checks, coverage) = alongside(build, lambda: value_checks(constraint, coverage))
    return CompiledConstraint(
        constraint, info, grammar, coverage, engine_schema, unique_keys(constraint, engine_schema), checks
    )


def _build_auto(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    """llguidance, or xgrammar where llguidance refuses the constraint (e.g. a format it does not know)."""
    try:
        return _build_llguidance(constraint, info)
    except CompileError:
        return _build_xgrammar(constraint, info)


_BUILDERS = {"xgrammar": _build_xgrammar, "llguidance": _build_llguidance, "auto": _build_auto}


def compile(
    constraint: Constraint,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    eos_token_ids: list[int] | None = None,
    timeout_s: float | None = None,
    engine: str = "auto",
    auto_limits: AutoLimits = AUTO_LIMITS,
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
        Compile-time budget in seconds: the compile runs on a thread of its own, and past the
        budget :class:`CompileError` is raised at once (the engine finishes in the background and
        caches the result). While :data:`~constrain.compiler.background.MAX_RUNAWAY_COMPILES` such
        compiles are still running, a compile with a budget is refused at once (a cache hit is not).
    engine : "auto", "xgrammar" or "llguidance", default: "auto"
        The grammar engine. ``"auto"``: xgrammar (fastest masks), except for JSON
        schemas and regexes it would take long to compile (:class:`AutoLimits`),
        which llguidance serves where it supports them; llguidance also serves one that
        xgrammar refuses, and, while xgrammar's compile of one takes longer than
        ``auto_limits.xgrammar_wait_s``, serves it meanwhile. Both enforce the same
        language but for the differences the schemas guide lists.
    auto_limits : AutoLimits, default: AUTO_LIMITS
        When ``"auto"`` picks llguidance (:class:`~constrain.compiler.routing.AutoLimits`).

    Raises
    ------
    UnsupportedSchemaError, SchemaError
        From the schema preparation (strict mode refusals, dangling ``$ref``).
    CompileError
        The engine failed, or the budget ran out, or too many compiles past theirs are still running.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    start = time.monotonic()
    info = tokenizer_info(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    wait_s = None  # how long xgrammar is waited for before llguidance serves the constraint meanwhile
    either = False  # "auto" left to xgrammar: llguidance serves what xgrammar refuses
    if engine == "auto":  # "auto" served by llguidance keeps its own key: it falls back to xgrammar
        routed = info.llg is not None and auto_engine(constraint, auto_limits) == "llguidance"
        either = info.llg is not None and not routed and isinstance(constraint, (JsonSchema, Regex))
        if either:
            wait_s = auto_limits.xgrammar_wait_s
        if either and isinstance(constraint, JsonSchema):
            try:  # (memoized: what xgrammar compiles) constrain's own refusals hold whatever engine serves
                json_schema_ebnf(constraint)
            except RuntimeError:  # xgrammar's: llguidance may serve it
                pass
        engine = "auto" if routed else "xgrammar"
    key = (constraint, info.fingerprint, engine)
    build = _BUILDERS[engine]

    def work() -> CompiledConstraint:
        return _cache.get_or_create(key, lambda: build(constraint, info))

    def by_llguidance() -> CompiledConstraint:  # what "auto" falls back to from xgrammar
        return _cache.get_or_create(
            (constraint, info.fingerprint, "llguidance"), lambda: _build_llguidance(constraint, info)
        )

    cached = None if timeout_s is None and wait_s is None else _cache.get(key)  # a hit needs no thread
    if cached is not None:
        return _own_type(cached, constraint)
    if wait_s is not None:
        wait_s = max(0.0, start + wait_s - time.monotonic())
        if timeout_s is not None:
            wait_s = min(wait_s, timeout_s)
        try:
            return _own_type(upgrades.run(at_low_priority(work), wait_s), constraint)
        except CompileError:  # past the wait (it goes on, to the cache), too many going on, or xgrammar failed
            pass
        try:
            return _own_type(by_llguidance(), constraint)
        except CompileError:  # llguidance refuses it: xgrammar after all
            if timeout_s is not None:
                timeout_s = max(0.0, start + timeout_s - time.monotonic())
    if not either or timeout_s is not None:
        return _own_type(work() if timeout_s is None else in_background(work, timeout_s), constraint)
    try:
        return _own_type(work(), constraint)
    except CompileError as refused:  # xgrammar's own (constrain's were raised above): llguidance, if it takes it
        try:
            return _own_type(by_llguidance(), constraint)
        except CompileError:
            raise refused from None


def _own_type(compiled: CompiledConstraint, constraint: Constraint) -> CompiledConstraint:
    """``compiled`` for ``constraint``: the cache compares JSON schemas without their Python type, so
    ``schema=Model`` and ``schema=Model.model_json_schema()`` share a grammar, not a type (the result's
    ``value`` is built from it). The copy shares everything else."""
    mine = getattr(constraint, "python_type", None)
    if getattr(compiled.constraint, "python_type", None) is mine:
        return compiled
    return dataclasses.replace(compiled, constraint=constraint)


def clear_cache() -> None:
    """Drop every compiled constraint (the next ``compile`` of each compiles again); counters are kept."""
    _cache.clear()


def cache_stats() -> dict[str, Any]:
    """Entries, bytes held, hits and misses of the compile cache; under ``"caches"``, every cache of
    ``constrain`` by name (entries, maxsize, and hits and misses where counted: :mod:`constrain.caches`)."""
    return {
        "entries": len(_cache), "bytes": _cache.nbytes, "hits": _cache.hits, "misses": _cache.misses,
        "caches": caches.stats(),
    }  # fmt: skip
