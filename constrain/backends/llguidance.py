"""The llguidance engine behind the same per-request calls as xgrammar's ``GrammarMatcher``.

xgrammar precomputes a token-mask cache per grammar position at compile time:
masks are then fast, but a large schema takes seconds to compile. llguidance
computes masks lazily (a lexer over the token trie): compiling costs about a
millisecond, masks a little more. :func:`constrain.compile` with ``engine="auto"``
serves the constraints xgrammar would take long to compile with llguidance (see
:class:`constrain.compile.compiler.AutoLimits`).

:class:`LlgState` mirrors the subset of ``xgr.GrammarMatcher`` that
:class:`~constrain.match.matcher.Matcher` uses, with xgrammar's semantics: a rejected
token returns ``False`` and leaves the state unchanged (llguidance would enter an
error state), and ``is_terminated`` means an EOS token was accepted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import torch

from constrain.constraints.constraint import MAX_WHITESPACE, SEPARATORS, JsonSchema, Regex
from constrain.constraints.schema import SCHEMA_LISTS, SCHEMA_MAPS, SINGLE_SCHEMAS, CoverageEntry

__all__ = ["UNKNOWN_FORMATS", "LlgState", "fill_next_token_bitmasks", "grammar_for", "llguidance_schema"]

_WHITESPACE = r"[ \t\n\r]"


UNKNOWN_FORMATS = frozenset({"json-pointer", "relative-json-pointer", "uri-reference", "uri-template"})
"""Formats the prepared schema keeps (xgrammar enforces them) that llguidance 1.x refuses to compile."""


def llguidance_schema(schema: Any) -> tuple[Any, tuple[CoverageEntry, ...]]:
    """The prepared ``schema`` less what llguidance refuses, and coverage entries saying so.

    Dropped (the grammar then accepts a superset; ``validate`` checks the finished output):
    formats in :data:`UNKNOWN_FORMATS`, and ``minProperties``/``maxProperties`` of objects
    with optional keys. Returns ``schema`` itself when nothing is dropped; never mutates it.
    """
    dropped: dict[str, set[str]] = {}

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        if out.get("format") in UNKNOWN_FORMATS:
            dropped.setdefault("format", set()).add(out.pop("format"))
        if not set(out.get("properties", ())) <= set(out.get("required", ())):
            for key in ("minProperties", "maxProperties"):
                if out.pop(key, None) is not None:
                    dropped.setdefault(key, set()).add("beside optional keys")
        for key in SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: walk(sub) for name, sub in out[key].items()}
        for key in SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [walk(sub) for sub in out[key]]
        for key in SINGLE_SCHEMAS:
            if key in out:
                out[key] = walk(out[key])
        return out

    adapted = walk(schema)
    if not dropped:
        return schema, ()
    note = "llguidance serves this schema and refuses {} ({}): validated afterwards"
    entries = tuple(
        CoverageEntry("", key, "checked", note.format(key, ", ".join(sorted(what))))
        for key, what in sorted(dropped.items())
    )
    return adapted, entries


def grammar_for(constraint: JsonSchema | Regex, engine_schema: Any = None) -> str:
    """llguidance's grammar for a JSON Schema (already prepared: ``engine_schema``) or a regex."""
    if isinstance(constraint, Regex):
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.pattern))
    options: dict[str, Any] = {"item_separator": ",", "key_separator": ":"}
    if _knows_general_escapes():
        options["json_allow_general_unicode_escapes"] = True
    if constraint.whitespace in SEPARATORS:
        options["item_separator"], options["key_separator"] = SEPARATORS[constraint.whitespace]
        options["whitespace_flexible"] = False
    else:
        options["whitespace_flexible"] = True
        options["whitespace_pattern"] = f"{_WHITESPACE}{{0,{MAX_WHITESPACE[constraint.whitespace]}}}"
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(engine_schema), overrides=options))  # type: ignore[arg-type]


@functools.cache
def _knows_general_escapes() -> bool:
    """Whether this llguidance takes ``json_allow_general_unicode_escapes`` (1.8 on; vLLM 0.32 pins 1.7,
    whose JSON strings then refuse ``\\u`` escapes of surrogates, a safe subset)."""
    option = {"json_allow_general_unicode_escapes": True}
    grammar = llguidance.LLMatcher.grammar_from_json_schema("{}", overrides=option)  # type: ignore[arg-type]
    return not llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid, else why not


class LlgState:
    """One request's llguidance matcher, with xgrammar's matcher semantics (see the module docstring)."""

    def __init__(self, matcher: Any, tokenizer: Any, eos_token_ids: Collection[int]) -> None:
        self._m = matcher
        self._tokenizer = tokenizer  # llguidance.LLTokenizer
        self._eos = frozenset(eos_token_ids)
        # per accepted token: 0 a token, 1 EOS, 2 EOS taken when llguidance had already stopped
        # (it then records no step, so a rollback must not undo one for it)
        self._history: list[int] = []

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        row = bitmask[index]  # [ceil(V / 32)] int32, written in place by llguidance
        if not row.is_contiguous():
            raise ValueError("the bitmask rows must be contiguous (allocate_token_bitmask)")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        return True

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        if token_id in self._eos:  # llguidance takes EOS through consume_token only, which must not fail
            stopped = self._m.is_stopped()
            if not self._m.is_accepting() or not self._m.consume_token(token_id):
                return False
            self._history.append(2 if stopped else 1)
        elif self._m.try_consume_tokens([token_id]) == 1:
            self._history.append(0)
        else:
            return False
        return True

    def accept_string(self, text: str) -> bool:
        tokens = self._tokenizer.tokenize_str(text)
        taken = 0 if self.is_terminated() else self._m.try_consume_tokens(tokens)
        if taken != len(tokens):
            self._m.rollback(taken)
            return False
        self._history.extend(int(t in self._eos) for t in tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        undone = self._history[len(self._history) - num_tokens :]
        self._m.rollback(sum(step != 2 for step in undone))
        del self._history[len(self._history) - num_tokens :]

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1] != 0

    def is_completed(self) -> bool:
        return bool(self._m.is_accepting())

    def find_jump_forward_string(self) -> str:
        forced = bytes(self._m.compute_ff_bytes())
        for cut in range(len(forced), max(len(forced) - 4, -1), -1):  # drop a split UTF-8 tail
            try:
                return forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def reset(self) -> None:
        self._m.reset()
        self._history.clear()

    def fork(self) -> LlgState:
        twin = LlgState(self._m.deep_copy(), self._tokenizer, self._eos)
        twin._history = list(self._history)
        return twin


@functools.cache
def _executor() -> Any:
    return llguidance.LLExecutor()


def fill_next_token_bitmasks(
    states: Sequence[LlgState],
    # [B, ceil(V / 32)] int32, on the CPU
    bitmask: torch.Tensor,
    indices: Sequence[int],
) -> None:
    """Fill ``bitmask[indices[i]]`` for ``states[i]`` in parallel (llguidance's executor drops the GIL)."""
    if not bitmask.is_contiguous():
        raise ValueError("the bitmask must be contiguous (allocate_token_bitmask)")
    # llguidance.torch would do this, but importing it runs torch.compile (seconds)
    batch, words = bitmask.shape
    pairs = [(s._m, i) for s, i in zip(states, indices, strict=True)]
    _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, batch)
