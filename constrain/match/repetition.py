"""Loops inside JSON: a guard that forbids the separator after an item repeated ``copies`` times.

:class:`RepetitionGuard` spots a model looping inside a JSON array or object (the same item or
member repeated ``copies`` times) and forbids the separator that would start another repeat, so
the grammar's closing path is taken. The decode loop applies it to each filled mask row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded
from constrain.match.bitmask import allowed_among, clear_bits, count_allowed
from constrain.match.vocab import TOKENIZERS_KEPT, token_texts

__all__ = ["CommaTokens", "RepetitionGuard", "comma_tokens"]


@dataclass(frozen=True, slots=True)
class CommaTokens:
    """The tokens whose text holds a ``,`` (the separators a guard may forbid)."""

    ids: np.ndarray  # [n] int64: their ids, ascending
    texts: dict[int, str]  # per id, its text


@bounded("match.repetition.comma_tokens", maxsize=TOKENIZERS_KEPT)
def comma_tokens(info: TokenizerInfo) -> CommaTokens:
    """The comma tokens of ``info``'s tokenizer, special and EOS tokens aside (cached per tokenizer)."""
    vocab = token_texts(info)
    skip = vocab.special | set(info.eos_token_ids)
    texts = {
        token_id: raw.decode("utf-8", errors="replace")
        for token_id, raw in enumerate(vocab.pieces[: info.vocab_size])
        if token_id not in skip and b"," in raw
    }
    return CommaTokens(np.array(sorted(texts), dtype=np.int64), texts)


class RepetitionGuard:
    """Forbids the separator after a JSON array item (or member) repeated ``copies`` times in a row.

    A token is forbidden when it would put a ``,`` right after ``copies`` identical items that span at
    least ``min_span`` characters (items up to ``max_period`` characters): whether the ``,`` comes
    alone or fused with the item's closing quote (``",``), as tokenizers often do.
    """

    def __init__(self, info: TokenizerInfo, *, copies: int = 3, min_span: int = 24, max_period: int = 256) -> None:
        if copies < 2:
            raise ValueError(f"copies must be at least 2, got {copies}")
        self.commas = comma_tokens(info)
        self.copies, self.min_span, self.max_period = copies, min_span, max_period
        self.steps = 0  # decode steps at which the guard forbade a separator

    def repeating(self, text: str) -> bool:
        """Whether ``text`` ends with ``copies`` identical items (``X, X, X``) spanning ``min_span``."""
        t = text.rstrip()
        for period in range(2, min(self.max_period, len(t) // (self.copies - 1)) + 1):
            unit = t[-period:]  # ", X"
            item = unit.lstrip()[1:].lstrip() if unit.lstrip().startswith(",") else ""
            if not item:
                continue
            units = 1
            while t[len(t) - (units + 1) * period : len(t) - units * period] == unit:
                units += 1
            items = units + t[: len(t) - units * period].endswith(item)
            if items >= self.copies and units * period + len(item) >= self.min_span:
                return True
        return False

    def _periodic(self, text: str) -> bool:
        """A cheap filter: some period repeats over the end of ``text`` (wherever the items start)."""
        t = text.rstrip()
        for period in range(2, min(self.max_period, len(t) // (self.copies - 1)) + 1):
            span = (self.copies - 2) * period + period // 2  # the last item may be half written
            if span + period <= len(t) and t[-span:] == t[-span - period : -period]:
                return True
        return False

    def apply(
        self,
        text: str,
        # [ceil(V / 32)] int32 on the CPU: this request's filled mask; updated in place
        row: torch.Tensor,
    ) -> bool:
        """Clear from ``row`` the tokens that would add a separator after ``copies`` identical items at
        the end of ``text``, unless nothing would be left. Returns whether it cleared any."""
        if not self._periodic(text):
            return False
        texts = self.commas.texts
        banned = [
            token
            for token in allowed_among(row, self.commas.ids).tolist()
            if self.repeating(text + texts[token][: texts[token].index(",")])
        ]
        if not banned or len(banned) == count_allowed(row):
            return False
        clear_bits(row, banned)
        self.steps += 1
        return True
