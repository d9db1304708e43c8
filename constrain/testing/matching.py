"""Feeding text through a matcher as MaskBench does: a text's token ids, the walk through the masks,
and the verdicts of several compiled constraints on the same texts.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

from typing import Any

import torch

from constrain.compiler.compiler import CompiledConstraint
from constrain.match.bitmask import allocate_token_bitmask, is_allowed
from constrain.match.bitmask import allowed_ids as row_allowed_ids
from constrain.match.matcher import Matcher

__all__ = ["Verdicts", "accepts", "allowed_ids", "token_ids", "walk"]


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids, without special tokens or a SentencePiece dummy-prefix token."""
    ids: list[int] = list(tokenizer.encode(text, add_special_tokens=False))
    first = tokenizer.convert_ids_to_tokens(ids[:1])
    if first and first[0].startswith("\u2581") and not text[:1].isspace():  # SentencePiece's dummy prefix
        rest = first[0][1:]
        ids = ids[1:] if not rest else [tokenizer.convert_tokens_to_ids(rest), *ids[1:]]
    if tokenizer.decode(ids) != text:
        raise ValueError(f"the tokenizer does not round-trip {text!r}")
    return ids


def walk(compiled: CompiledConstraint, ids: list[int]) -> tuple[bool, Matcher]:
    """Feed ``ids`` as MaskBench does: each token must be allowed by the mask and accepted."""
    matcher = compiled.matcher()
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        if not is_allowed(bitmask[0], token) or not matcher.accept_token(token):
            return False, matcher
    return True, matcher


def accepts(compiled: CompiledConstraint, tokenizer: Any, text: str) -> bool:
    """The whole of ``text`` passes the masks and the grammar can end there."""
    ok, matcher = walk(compiled, token_ids(tokenizer, text))
    return ok and matcher.is_completed()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    """The token ids whose bit is set in one row of a token bitmask (``int32``, 32 ids a word)."""
    return set(row_allowed_ids(bitmask_row, vocab_size).tolist())


class Verdicts:
    """Several compiled constraints' verdicts on the same texts, memoized: ``compiled`` maps a name (an
    engine's, in a differential run) to the constraint it compiled. Calls walk each text once per name."""

    def __init__(self, compiled: dict[str, CompiledConstraint], tokenizer: Any) -> None:
        self.compiled = compiled
        self.tokenizer = tokenizer
        self._seen: dict[str, tuple[dict[str, bool], dict[str, int]]] = {}
        self._refused: dict[tuple[str, str], str] = {}  # (text, engine) -> the token its mask refused

    def __call__(self, text: str) -> tuple[dict[str, bool], dict[str, int]]:
        """Per engine: whether it accepts ``text`` (every token allowed by the mask, then the grammar can
        end), and the character offset where it stopped (``len(text)`` when it took every token).

        Raises ValueError when the tokenizer does not round-trip ``text``."""
        if text not in self._seen:
            ids = token_ids(self.tokenizer, text)
            accepted, stops = {}, {}
            for engine, compiled in self.compiled.items():
                ok, matcher = walk(compiled, ids)
                accepted[engine] = ok and matcher.is_completed()
                stops[engine] = len(text) if ok else len(self.tokenizer.decode(ids[: matcher.num_accepted]))
                if not ok:
                    self._refused[text, engine] = self.tokenizer.decode(
                        ids[matcher.num_accepted : matcher.num_accepted + 1]
                    )
            self._seen[text] = accepted, stops
        return self._seen[text]

    def refused_token(self, text: str, engine: str) -> str:
        """The text of the token ``engine`` refused in ``text`` ("" if it took every token)."""
        return self._refused.get((text, engine), "")

    def grammar_accepts(self, engine: str, text: str) -> bool:
        """Whether ``engine`` takes every token of ``text`` by ``accept_token`` alone (no mask), then can end."""
        matcher = self.compiled[engine].matcher()
        return all(matcher.accept_token(t) for t in token_ids(self.tokenizer, text)) and matcher.is_completed()

    def agree(self, text: str) -> bool | None:
        """Whether every engine gives ``text`` the same verdict; None if it cannot be tokenized."""
        try:
            accepted, _ = self(text)
        except ValueError:
            return None
        return len(set(accepted.values())) == 1
