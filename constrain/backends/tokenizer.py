"""Tokenizer facts the grammar engine needs, with a stable fingerprint for the compile cache."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from constrain.backends.llguidance import LlguidanceBackend
from constrain.backends.xgrammar import XGrammarBackend
from constrain.caches import register

__all__ = ["TokenizerInfo", "prepare_with", "tokenizer_info"]


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
    xgrammar: XGrammarBackend = field(repr=False)  # compiles and fills masks for this tokenizer
    # llguidance for the same tokenizer (its tokenizer built in the background: ~1 s); None for slow tokenizers
    llg: LlguidanceBackend | None = field(default=None, repr=False)
    # done once the tables of :func:`prepare_with` are built (in the background); None: none were built
    prepared: Future[None] | None = field(default=None, repr=False)

    def llguidance(self) -> LlguidanceBackend | None:
        """llguidance for this tokenizer (waits for its tokenizer's build), or None where it cannot serve it."""
        return self.llg if self.llg is not None and self.llg.tokenizer is not None else None

    def llg_tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (waits for its background build), or None if unavailable."""
        backend = self.llguidance()
        return None if backend is None else backend.tokenizer

    def wait_prepared(self) -> None:
        """Wait for what is built in the background for this tokenizer: llguidance's tokenizer and the tables
        of :func:`prepare_with` (0.3 s after the info is made, for SmolLM2's 49,152 tokens)."""
        self.llg_tokenizer()
        if self.prepared is not None:
            self.prepared.result()


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Future[Any]:
    """llguidance's tokenizer, built on a thread of its own (about a second) that ends with the build.

    Not a daemon thread: Python's exit waits for it. A daemon thread still inside llguidance when the
    interpreter finalizes is ended by unwinding through llguidance's frames, a segfault (the CLI after a
    schema refused at once crashed so in 3 runs of 8)."""
    import llguidance.hf

    future: Future[Any] = Future()

    def build() -> None:
        try:
            future.set_result(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids))
        except Exception as err:
            future.set_exception(err)

    threading.Thread(target=build, name="constrain-llg-tokenizer").start()
    return future


_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], TokenizerInfo]] = weakref.WeakKeyDictionary()
"""Per tokenizer object (held as long as the tokenizer lives), its infos by (vocab_size, eos ids)."""
_LOCK = threading.Lock()
register("backends.tokenizer_info", lambda: {"entries": sum(map(len, list(_CACHE.values()))), "maxsize": -1})


_PREPARERS: list[Callable[[TokenizerInfo], object]] = []


def prepare_with(build: Callable[[TokenizerInfo], object]) -> None:
    """Have every :class:`TokenizerInfo` created from now on run ``build(info)`` on a thread of its own: a
    per-tokenizer table (cached by ``build`` itself) that the first request would otherwise wait for. The
    layers above register theirs (the JSON scanners' tables: 50 to 60 ms for SmolLM2's vocabulary)."""
    _PREPARERS.append(build)


def _prepare(info: TokenizerInfo, done: Future[None]) -> None:
    """Build the tables of :func:`prepare_with` for ``info`` on a thread of its own, then set ``done`` (not a
    daemon thread: see :func:`_llg_tokenizer`). A table that fails to build here is built again where it is
    used, and raises there."""
    builds = tuple(_PREPARERS)

    def run() -> None:
        for build in builds:
            try:
                build(info)
            except Exception:  # its user builds it again, and meets the error there
                continue
        done.set_result(None)

    threading.Thread(target=run, name="constrain-tables").start()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a Hugging Face tokenizer calls special (its special tokens, and its added tokens marked
    ``special``): a detokenizer skips them, so no grammar may take their text as output."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


def _without_special_text(info: xgr.TokenizerInfo, vocab: dict[str, int], special: frozenset[int]) -> xgr.TokenizerInfo:
    """``info`` with the ``special`` ids made special for xgrammar too (an empty text: never allowed but
    as a stop token). xgrammar's own detection takes a special token's name as text when it decodes
    to it (SmolLM2's ``<|im_start|>``), so the mask would allow it inside a JSON string."""
    missing = special - set(info.special_token_ids)
    if not missing:
        return info
    encoded: list[str] = [""] * info.vocab_size
    for token, token_id in vocab.items():
        if token_id < info.vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded, info.vocab_type, vocab_size=info.vocab_size, stop_token_ids=list(info.stop_token_ids),
        add_prefix_space=info.add_prefix_space,
    )  # fmt: skip


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
    info = _without_special_text(info, vocab, special_token_ids(tokenizer))
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    digest.update(repr((info.vocab_size, info.stop_token_ids, info.vocab_type, info.special_token_ids)).encode())
    eos = tuple(info.stop_token_ids)
    llg = None
    if getattr(tokenizer, "is_fast", False):
        llg = LlguidanceBackend(_llg_tokenizer(tokenizer, info.vocab_size, list(info.stop_token_ids)), eos)
    prepared: Future[None] = Future()
    result = TokenizerInfo(info, info.vocab_size, eos, digest.hexdigest(), XGrammarBackend(info, eos), llg, prepared)
    _prepare(result, prepared)
    with _LOCK:
        per_tokenizer[key] = result
    return result
