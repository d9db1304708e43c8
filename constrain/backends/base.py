"""The protocol every grammar engine serves: a compiled grammar (shared) and a grammar state (per request).

In the shape of vLLM's ``structured_output/backend_types.py``. Each engine module
(:mod:`~constrain.backends.xgrammar`, :mod:`~constrain.backends.llguidance`) has a
:class:`Backend` per tokenizer that turns engine-neutral input (EBNF text, a regex,
a JSON schema's text) into a :class:`CompiledGrammar`; each request takes a fresh
:class:`GrammarState` from it. Only ``constrain.compiler`` calls an engine by name (to
build grammars); the layers above speak these protocols alone, and never ask
which engine they have but through :attr:`CompiledGrammar.engine`.

Semantics every engine keeps (xgrammar's):

1. a rejected token returns ``False`` and leaves the state unchanged, nothing raises;
2. EOS ids are allowed exactly when the grammar can end; accepting one terminates the state;
3. bitmasks are int32 rows of ``ceil(V / 32)`` words on the CPU, bit ``i % 32`` of word
   ``i // 32`` set when token ``i`` is allowed (:mod:`constrain.match.bitmask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["Backend", "CompiledGrammar", "GrammarState", "forced_prefix"]


class GrammarState(Protocol):
    """One request's position in a grammar. Not thread-safe (one request, one thread)."""

    def fill_next_token_bitmask(
        self,
        # [B, ceil(V / 32)] int32, on the CPU; row ``index`` is overwritten
        bitmask: torch.Tensor,
        index: int = 0,
    ) -> bool:
        """Write the allowed next tokens into ``bitmask[index]``; whether the row restricts anything.
        Does not change the state."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) if the grammar rejects it."""
        ...

    def accept_string(self, text: str) -> bool:
        """Advance by raw text; ``False`` (state unchanged) if rejected. Cannot be rolled back."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """Whether an EOS token was accepted."""
        ...

    def is_completed(self) -> bool:
        """Whether the text so far is a complete match (EOS would be accepted now)."""
        ...

    def find_jump_forward_string(self) -> str:
        """The longest text every continuation starts with ("" if the next character is free), whole
        characters only (:func:`forced_prefix`). Does not change the state."""
        ...

    def reset(self) -> None:
        """Back to the initial state."""
        ...

    def fork(self) -> GrammarState:
        """An independent copy in the same state."""
        ...


class Backend(Protocol):
    """One engine for one tokenizer: compiles grammars (engine-specific calls) and fills masks in batches."""

    def fill_next_token_bitmasks(
        self,
        states: Sequence[GrammarState],
        # [B, ceil(V / 32)] int32, on the CPU
        bitmask: torch.Tensor,
        rows: Sequence[int],
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``states[i]`` (states of grammars of this backend), all at once
        where the engine can (the GIL is released). Does not change the states."""
        ...


class CompiledGrammar(Protocol):
    """A grammar compiled for one tokenizer: immutable, shareable across requests and threads."""

    @property
    def engine(self) -> str:
        """The engine's name: ``"xgrammar"`` or ``"llguidance"``."""
        ...

    @property
    def backend(self) -> Backend:
        """The engine for this grammar's tokenizer: states of grammars with one backend fill their masks
        in one call."""
        ...

    @property
    def memory_size_bytes(self) -> int:
        """Bytes held (what the compile cache's bound counts)."""
        ...

    def new_state(self, *, max_rollback_tokens: int = -1) -> GrammarState:
        """A fresh per-request state at the grammar's start (``-1``: unbounded rollback)."""
        ...

    def completes(self, state: GrammarState, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` (no EOS among them) take ``state``, one of this grammar's, to a complete
        match. Leaves ``state`` as it was (the check of a closing path, once per vetted token)."""
        ...


def forced_prefix(forced: bytes) -> str:
    """The whole characters that forced bytes begin with: a character split at their end is left out (the
    next step forces it again), and bytes that begin inside a character (the output stands in the middle
    of one: a token ended on its first byte) give "", as no text can say them."""
    for cut in range(len(forced), max(len(forced) - 4, -1), -1):
        try:
            return forced[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
