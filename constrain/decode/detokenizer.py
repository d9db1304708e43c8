"""Incremental detokenization: text deltas as tokens arrive, O(1) work per token.

The decoder keeps two offsets into the ids (as vLLM and TGI do): text is decoded
from a short window ``ids[prefix_offset:]`` and diffed against the window's
already-emitted part ``ids[prefix_offset:read_offset]``. Decoding a window with a
token before the new ones keeps SentencePiece's leading spaces right; a window
whose new text holds U+FFFD (a UTF-8 sequence split across tokens, or invalid
bytes) emits nothing until the sequence completes, and a run of byte-fallback
tokens emits nothing until it ends. :meth:`finish` flushes what is held back, so the
deltas always concatenate to ``tokenizer.decode(all ids)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas. One per request; not thread-safe.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    skip_special_tokens : bool, default: True
        Whether special tokens (EOS, chat markers) appear in the text.
    context_ids : iterable of int, default: ()
        Ids before the output (the prompt's last few): they are decoded for
        context only, never emitted, so the first output token gets its
        leading space right.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, context_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids)[-4:]
        self._context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        if _BYTE_PIECE.fullmatch(str(self.tokenizer.convert_ids_to_tokens(int(token_id)))):
            # Byte-fallback decoders turn a whole run of byte tokens into U+FFFD if any of it is
            # invalid UTF-8: the run's text is final only once a non-byte token ends it.
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        if not delta or delta.endswith(_REPLACEMENT) or not new_text.startswith(prefix_text):
            return ""  # an incomplete UTF-8 sequence at the end: wait until it resolves, or finish()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several tokens; return their text."""
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """Flush: the rest of the text, so that ``self.text == tokenizer.decode(output ids)``."""
        full = self._decode(self.ids[self._context :])
        if not full.startswith(self.text):  # only possible with invalid UTF-8 mid-stream
            raise RuntimeError("the emitted text is no prefix of the full decode; report this tokenizer")
        delta = full[len(self.text) :]
        self.text = full
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta
