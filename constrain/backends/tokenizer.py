"""Tokenizer facts the grammar engine needs, with a stable fingerprint for the compile cache."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

__all__ = ["TokenizerInfo", "tokenizer_info"]


@dataclass(frozen=True, slots=True, eq=False)
class TokenizerInfo:
    """One tokenizer as the grammar engine sees it.

    ``vocab_size`` is the model's (the logits' width), which may exceed the
    tokenizer's own vocabulary (padded embeddings): ids past the tokenizer are
    never allowed. ``eos_token_ids`` are every id that ends generation.
    """

    xgr_info: xgr.TokenizerInfo
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str  # sha256 of the vocabulary, the special ids and vocab_size
    # llguidance's view of the same tokenizer (built in the background: ~1 s); None for slow tokenizers
    llg_future: Future[Any] | None = field(default=None, repr=False)

    def llg_tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (waits for its background build), or None if unavailable."""
        if self.llg_future is None:
            return None
        try:
            return self.llg_future.result()
        except Exception:  # a tokenizer llguidance cannot read: the xgrammar engine alone serves it
            return None


_llg_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constrain-llg-tokenizer")


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)


_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], TokenizerInfo]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def tokenizer_info(
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> TokenizerInfo:
    """Build (or fetch, cached per tokenizer object) the engine's view of a Hugging Face tokenizer.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase, or a TokenizerInfo (returned as is)
    vocab_size : int or None, default: None (the tokenizer's length)
        The model's vocabulary size when it is padded beyond the tokenizer.
    eos_token_ids : sequence of int or None, default: None (the engine's detection)
        Every id that ends generation (a model may have several).
    """
    if isinstance(tokenizer, TokenizerInfo):
        return tokenizer
    if not hasattr(tokenizer, "get_vocab"):
        raise ValueError(f"expected a Hugging Face tokenizer (with get_vocab()), got {type(tokenizer).__name__}")
    key = (vocab_size, tuple(eos_token_ids) if eos_token_ids is not None else None)
    with _LOCK:
        try:
            per_tokenizer = _CACHE.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: no caching
            per_tokenizer = {}
        if key in per_tokenizer:
            return per_tokenizer[key]
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) if eos_token_ids is not None else None
    )
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    digest.update(repr((info.vocab_size, info.stop_token_ids, info.vocab_type)).encode())
    llg = None
    if getattr(tokenizer, "is_fast", False):
        llg = _llg_pool.submit(_llg_tokenizer, tokenizer, info.vocab_size, list(info.stop_token_ids))
    result = TokenizerInfo(info, info.vocab_size, tuple(info.stop_token_ids), digest.hexdigest(), llg)
    with _LOCK:
        per_tokenizer[key] = result
    return result
