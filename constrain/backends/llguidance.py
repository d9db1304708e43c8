"""The llguidance engine, behind the protocol of :mod:`constrain.backends.base`.

xgrammar precomputes a token-mask cache per grammar position at compile time:
masks are then fast, but a large schema takes seconds to compile. llguidance
computes masks lazily (a lexer over the token trie): compiling costs about a
millisecond, masks a little more. :func:`constrain.compile` with ``engine="auto"``
serves the constraints xgrammar would take long to compile with llguidance (see
:class:`constrain.compiler.routing.AutoLimits`).

:class:`LlgState` is a :class:`~constrain.backends.base.GrammarState` with xgrammar's semantics: a rejected
token returns ``False`` and leaves the state unchanged (llguidance would enter an
error state), and ``is_terminated`` means an EOS token was accepted.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from typing import Any, cast

import llguidance
import torch

from constrain.backends.base import GrammarState, forced_prefix
from constrain.caches import bounded

__all__ = ["UNKNOWN_FORMATS", "LlguidanceBackend", "LlguidanceGrammar", "json_schema_grammar", "regex_grammar"]

_WHITESPACE = r"[ \t\n\r]"


UNKNOWN_FORMATS = frozenset({"json-pointer", "relative-json-pointer", "uri-reference", "uri-template"})
"""Formats the prepared schema keeps (xgrammar enforces them) that llguidance 1.x refuses to compile."""


def regex_grammar(pattern: str) -> str:
    """llguidance's grammar for a regex the whole output must match."""
    return str(llguidance.LLMatcher.grammar_from_regex(pattern))


def json_schema_grammar(schema_json: str, *, separators: tuple[str, str] | None, max_whitespace: int) -> str:
    """llguidance's grammar for a JSON schema (already prepared, less what it refuses: ``UNKNOWN_FORMATS``).

    ``separators``: fixed item and key separators (compact output), or None for free whitespace of at
    most ``max_whitespace`` characters per run.
    """
    options: dict[str, Any] = {"item_separator": ",", "key_separator": ":"}
    if _knows_general_escapes():
        options["json_allow_general_unicode_escapes"] = True
    if separators is not None:
        options["item_separator"], options["key_separator"] = separators
        options["whitespace_flexible"] = False
    else:
        options["whitespace_flexible"] = True
        options["whitespace_pattern"] = f"{_WHITESPACE}{{0,{max_whitespace}}}"
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema_json, overrides=options))  # type: ignore[arg-type]


@bounded("backends.llguidance_escapes", maxsize=1)
def _knows_general_escapes() -> bool:
    """Whether this llguidance takes ``json_allow_general_unicode_escapes`` (1.8 on; vLLM 0.32 pins 1.7,
    whose JSON strings then refuse ``\\u`` escapes of surrogates, a safe subset)."""
    option = {"json_allow_general_unicode_escapes": True}
    grammar = llguidance.LLMatcher.grammar_from_json_schema("{}", overrides=option)  # type: ignore[arg-type]
    return not llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid, else why not


class LlgState:
    """One request's llguidance matcher, with xgrammar's matcher semantics (see the module docstring)."""

    def __init__(self, matcher: Any, tokenizer: Any, eos_token_ids: Collection[int]) -> None:
        self.matcher = matcher
        self._tokenizer = tokenizer  # llguidance.LLTokenizer
        self._eos = frozenset(eos_token_ids)
        self._tokens = 0  # tokens accepted before an EOS, if any
        # the EOS that ended the state: 0 none, 1 EOS, 2 EOS taken when llguidance had already stopped
        # (it then records no step, so a rollback must not undo one for it); nothing is accepted after it
        self._end = 0
        self._bitmask: torch.Tensor | None = None  # the last bitmask filled (its dtype and device checked)

    def fill_next_token_bitmask(
        self,
        # [B, ceil(V / 32)] int32 on the CPU; row ``index`` is written in place by llguidance
        bitmask: torch.Tensor,
        index: int = 0,
    ) -> bool:
        # a row's view and its checks cost 1.7 us a call: dtype and device (fixed) are read once per tensor,
        # the shape and layout (which an in-place resize changes) each time: llguidance writes through the pointer
        if bitmask is not self._bitmask:
            if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
                raise ValueError("fill an int32 bitmask on the CPU (allocate_token_bitmask), then move it")
            self._bitmask = bitmask
        count, words = bitmask.shape
        if not bitmask.is_contiguous():
            raise ValueError("the bitmask must be contiguous, [B, ceil(V / 32)] (allocate_token_bitmask)")
        if not 0 <= index < count:  # (xgrammar's check too)
            raise IndexError(f"row {index} of a bitmask of {count} rows")
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + index * words * 4, words * 4)
        return True

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        if token_id in self._eos:  # llguidance takes EOS through consume_token only, which must not fail
            stopped = self.matcher.is_stopped()
            if not self.matcher.is_accepting() or not self.matcher.consume_token(token_id):
                return False
            self._end = 2 if stopped else 1
        elif self.matcher.try_consume_tokens([token_id]) == 1:
            self._tokens += 1
        else:
            return False
        return True

    def completes(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` (no EOS among them) are all accepted and leave a complete match. Does not
        change the state: llguidance's ``validate_tokens`` with an EOS after them (taken only where the
        match is complete), one call where taking the tokens and rolling them back costs about 12x more
        (a 13-token closing path: 6 against 72 µs on an Intel Xeon, family 6 model 207)."""
        if self.is_terminated() or not self._eos:
            return False
        eos = min(self._eos)
        return bool(self.matcher.validate_tokens([*token_ids, eos]) == len(token_ids) + 1)

    def accept_string(self, text: str) -> bool:
        tokens = self._tokenizer.tokenize_str(text)
        taken = 0 if self.is_terminated() else self.matcher.try_consume_tokens(tokens)
        if taken != len(tokens):
            self.matcher.rollback(taken)
            return False
        if tokens and tokens[-1] in self._eos:  # a special token's text tokenizes to its id: it ends the state
            self._tokens, self._end = self._tokens + len(tokens) - 1, 1
        else:
            self._tokens += len(tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._end:
            self.matcher.rollback(int(self._end == 1))
            self._end = 0
            num_tokens -= 1
        self.matcher.rollback(num_tokens)
        self._tokens -= num_tokens

    def is_terminated(self) -> bool:
        return self._end != 0

    def is_completed(self) -> bool:
        return bool(self.matcher.is_accepting())

    def find_jump_forward_string(self) -> str:
        return forced_prefix(bytes(self.matcher.compute_ff_bytes()))

    def reset(self) -> None:
        self.matcher.reset()
        self._tokens = self._end = 0

    def fork(self) -> LlgState:
        twin = LlgState(self.matcher.deep_copy(), self._tokenizer, self._eos)
        twin._tokens, twin._end = self._tokens, self._end
        return twin


class LlguidanceGrammar:
    """An llguidance grammar for one tokenizer (a :class:`~constrain.backends.base.CompiledGrammar`): a matcher
    in its initial state, which each request copies."""

    engine = "llguidance"

    def __init__(self, template: Any, text: str, backend: LlguidanceBackend) -> None:
        self.template = template  # llguidance.LLMatcher, never advanced
        self.memory_size_bytes = len(text)  # the grammar's text: llguidance builds the rest lazily
        self.backend = backend

    def new_state(self, *, max_rollback_tokens: int = -1) -> GrammarState:
        return LlgState(self.template.deep_copy(), self.backend.tokenizer, self.backend.eos_token_ids)

    def completes(self, state: GrammarState, token_ids: Sequence[int]) -> bool:
        """One llguidance call that changes nothing (:meth:`LlgState.completes`)."""
        return cast(LlgState, state).completes(token_ids)


class LlguidanceBackend:
    """llguidance for one tokenizer: compiles grammars (about a millisecond), fills many masks at once.

    Owns the ``LLTokenizer`` (being built in the background, see :mod:`~constrain.backends.tokenizer`)
    and an executor made on first use. Thread-safe.
    """

    def __init__(self, tokenizer: Future[Any], eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer  # of an llguidance.LLTokenizer
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._executor: Any = None

    @property
    def tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (waits for its build), or None where llguidance cannot read the
        tokenizer (xgrammar alone serves it then)."""
        try:
            return self._tokenizer.result()
        except Exception:
            return None

    def compile(self, grammar: str) -> LlguidanceGrammar:
        """Compile llguidance grammar text (:func:`json_schema_grammar`, :func:`regex_grammar`).

        Raises ``ValueError`` with llguidance's message where it refuses the grammar.
        """
        template = llguidance.LLMatcher(self.tokenizer, grammar)
        if template.is_error():
            raise ValueError(template.get_error())
        return LlguidanceGrammar(template, grammar, self)

    def fill_next_token_bitmasks(
        self,
        states: Sequence[GrammarState],
        # [B, ceil(V / 32)] int32, on the CPU
        bitmask: torch.Tensor,
        rows: Sequence[int],
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``states[i]`` in parallel (llguidance's executor drops the GIL)."""
        if not bitmask.is_contiguous():
            raise ValueError("the bitmask must be contiguous (allocate_token_bitmask)")
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
        # llguidance.torch would do this, but importing it runs torch.compile (seconds)
        batch, words = bitmask.shape
        pairs = [(cast(LlgState, state).matcher, row) for state, row in zip(states, rows, strict=True)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, batch)
