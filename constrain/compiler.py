"""Compiling a constraint for a tokenizer: cached, shared, thread-safe.

:func:`compile` turns a constraint into a :class:`CompiledConstraint` (the
tokenizer-bound grammar, plus what it enforces) once per (constraint,
tokenizer) pair; per-request state lives in :class:`~constrain.matcher.Matcher`.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from constrain.cache import ByteLRU
from constrain.constraints import MAX_WHITESPACE, Choice, Constraint, Grammar, JsonSchema, Regex, _engine_message
from constrain.errors import CompileError
from constrain.schema import CoverageEntry, prepare
from constrain.tokenizer import TokenizerInfo, tokenizer_info

__all__ = ["CACHE_MAX_BYTES", "CompiledConstraint", "cache_stats", "choice_ebnf", "compile"]

CACHE_MAX_BYTES = 1 << 30
"""Default bound of the compiled-constraint cache: 1 GiB of compiled grammars."""


@dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer: immutable and shareable across requests and threads.

    ``coverage`` (JSON Schema only) says, per JSON pointer and keyword, whether
    the grammar enforces it, or the result is checked afterwards, or it was
    approximated (lenient) or ignored (annotations): see :mod:`constrain.schema`.
    """

    constraint: Constraint
    tokenizer: TokenizerInfo
    grammar: xgr.CompiledGrammar
    coverage: tuple[CoverageEntry, ...] = ()
    engine_schema: Any = None  # the schema as rewritten for the engine (JSON Schema only)

    @property
    def vocab_size(self) -> int:
        """Width of the logits (and of the bitmask, in bits) this constraint serves."""
        return self.tokenizer.vocab_size

    @property
    def memory_size_bytes(self) -> int:
        return int(self.grammar.memory_size_bytes)

    @property
    def fully_enforced(self) -> bool:
        """True when the grammar alone guarantees every keyword (nothing left to post-validation)."""
        return all(entry.status in ("enforced", "ignored") for entry in self.coverage)

    def matcher(self, *, max_rollback_tokens: int = -1) -> Any:
        """A fresh per-request :class:`~constrain.matcher.Matcher` (``-1``: unbounded rollback)."""
        from constrain.matcher import Matcher

        return Matcher(self, max_rollback_tokens=max_rollback_tokens)

    def validate(self, text: str) -> list[str]:
        """The violations of the whole constraint by the finished ``text``; empty when it satisfies it.

        Includes keywords the grammar cannot enforce. Does not change any state.
        """
        from constrain.validate import validate

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
    """The EBNF grammar of a :class:`~constrain.constraints.Choice`."""
    alternatives = " | ".join(_ebnf_string(o) if o else '""' for o in options)
    return f"root ::= {alternatives}\n"


OPEN_KEY_RULES_MAX = 16
"""An open object (extra keys allowed) makes the engine spell out "any key but the declared
ones" as a trie of rules, one per prefix of a declared name; past this many such rules
in a schema, extra keys become any string instead. Measured on a 20-property object
with the SmolLM2 tokenizer: 251 ms to compile exactly, 9 ms with any-string keys."""

_OPEN_KEYS_NOTE = (
    "extra keys of open objects are any string (a declared key may take that path with another value); "
    "values are validated afterwards"
)
_EXCLUDED_KEY_RULE = re.compile(r"^(\S+_addl_key) ::= ")
_EXCLUDED_KEY_PART = re.compile(r"^\S+_addl_key_\d+ ::= ")


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


def _build(constraint: Constraint, info: TokenizerInfo) -> CompiledConstraint:
    compiler = _compiler(info)
    try:
        if isinstance(constraint, JsonSchema):
            engine_schema, coverage = prepare(constraint.schema_value, lenient=constraint.lenient)
            compact = constraint.whitespace == "compact"
            grammar: xgr.Grammar | str = xgr.Grammar.from_json_schema(
                json.dumps(engine_schema, ensure_ascii=False),
                any_whitespace=not compact,
                separators=(",", ":") if compact else None,
                strict_mode=constraint.closed,  # xgrammar's name: absent additionalProperties/items mean none
                max_whitespace_cnt=None if compact else MAX_WHITESPACE[constraint.whitespace],
                any_order=constraint.property_order == "any",
            )
            opened = _open_extra_keys(str(grammar))
            if opened is not None:
                grammar = opened
                coverage += (CoverageEntry("", "additionalProperties", "checked", _OPEN_KEYS_NOTE),)
            return CompiledConstraint(constraint, info, compiler.compile_grammar(grammar), coverage, engine_schema)
        if isinstance(constraint, Regex):
            return CompiledConstraint(constraint, info, compiler.compile_regex(constraint.pattern))
        if isinstance(constraint, Grammar):
            return CompiledConstraint(constraint, info, compiler.compile_grammar(constraint.ebnf))
        if isinstance(constraint, Choice):
            return CompiledConstraint(constraint, info, compiler.compile_grammar(choice_ebnf(constraint.options)))
    except RuntimeError as err:
        raise CompileError(f"the grammar engine could not compile the constraint: {_engine_message(err)}") from err
    raise ValueError(
        f"compile() takes a constraint from constrain.json_schema/regex/grammar/choice, got {type(constraint).__name__}"
    )


def compile(
    constraint: Constraint,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    eos_token_ids: list[int] | None = None,
    timeout_s: float | None = None,
) -> CompiledConstraint:
    """Compile ``constraint`` for ``tokenizer``; cached (a repeat costs a dictionary lookup).

    Parameters
    ----------
    constraint : a value from ``constrain.json_schema``, ``regex``, ``grammar``, ``choice``
    tokenizer : a Hugging Face tokenizer, or a :class:`~constrain.tokenizer.TokenizerInfo`
    vocab_size : int or None, default: None
        The model's vocabulary size, if padded beyond the tokenizer.
    eos_token_ids : list of int or None, default: None
        Every id that ends generation (default: the engine's detection).
    timeout_s : float or None, default: None (no limit)
        Compile-time budget in seconds: past it, :class:`CompileError` is
        raised at once (the engine finishes in the background and caches the result).

    Raises
    ------
    UnsupportedSchemaError, SchemaError
        From the schema preparation (strict mode refusals, dangling ``$ref``).
    CompileError
        The engine failed, or the budget ran out.
    """
    info = tokenizer_info(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    key = (constraint, info.fingerprint)
    if timeout_s is None:
        return _cache.get_or_create(key, lambda: _build(constraint, info))
    future = _budget_pool.submit(_cache.get_or_create, key, lambda: _build(constraint, info))
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout as err:
        raise CompileError(f"compiling took longer than the budget of {timeout_s:g} s") from err


def cache_stats() -> dict[str, int]:
    """Entries, bytes held, hits and misses of the compile cache."""
    return {"entries": len(_cache), "bytes": _cache.nbytes, "hits": _cache.hits, "misses": _cache.misses}
