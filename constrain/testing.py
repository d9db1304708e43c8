"""Helpers for tests and benchmarks: feeding text through a matcher as MaskBench does.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

from typing import Any

import torch

from constrain.compiler import CompiledConstraint
from constrain.matcher import Matcher, allocate_token_bitmask

__all__ = ["accepts", "allowed_ids", "token_ids", "walk"]


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
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1 or not matcher.accept_token(token):
            return False, matcher
    return True, matcher


def accepts(compiled: CompiledConstraint, tokenizer: Any, text: str) -> bool:
    """The whole of ``text`` passes the masks and the grammar can end there."""
    ok, matcher = walk(compiled, token_ids(tokenizer, text))
    return ok and matcher.is_completed()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = [(int(bitmask_row[t // 32]) >> (t % 32)) & 1 for t in range(vocab_size)]
    return {t for t, b in enumerate(bits) if b}
