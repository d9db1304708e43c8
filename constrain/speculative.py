"""Draft proposers for speculative decoding: where the grammar forces nothing, a proposer guesses the
next tokens, and the loop verifies them in the same forward pass as the real next token.

Verification (in :func:`constrain.generate._run`) runs the sampler at every draft position exactly as
plain decoding would and keeps a draft only while the sampled token equals it. Proposers here are
deterministic (a lookup, or a greedy draft model), so that rule accepts a draft with the probability
rejection sampling would (``p(draft)``) and the output keeps plain decoding's distribution; for a
seeded request, its very tokens.

A proposer sees the request's prompt ids, output ids and a fork of its grammar state; it may drop
drafts the grammar rejects (the loop prunes them anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from constrain.matcher import allocate_token_bitmask
from sampler.ops.bitmask import apply_token_bitmask_inplace

if TYPE_CHECKING:
    from constrain.matcher import Matcher
    from constrain.models import ModelHandle

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "ngram_proposal"]


class Proposer(Protocol):
    """Drafts up to ``k`` next tokens of one request (an empty list: no draft this step)."""

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None
    ) -> list[int]:
        """``matcher`` is the request's grammar state after ``output_ids`` (a fork: the proposer may
        advance it), or None for an unconstrained request. Must not mutate the id sequences."""
        ...


NGRAM_MAX = 3
"""Prompt lookup: the longest suffix of the history (in tokens) searched for an earlier occurrence."""


def ngram_proposal(history: Sequence[int], k: int, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the history's last ``n`` tokens
    (``n`` from ``n_max`` down to 1): prompt-lookup drafting, which pays off when the output copies
    the prompt (extraction). Pure."""
    history = list(history)
    for n in range(min(n_max, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start + n - 1] == tail[-1] and history[start : start + n] == tail:
                return history[start + n : start + n + k]
    return []


class NgramProposer:
    """Prompt lookup (:func:`ngram_proposal`) over the prompt and the output so far. Stateless."""

    def __init__(self, n_max: int = NGRAM_MAX) -> None:
        if n_max < 1:
            raise ValueError(f"n_max must be at least 1, got {n_max}")
        self.n_max = n_max

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None
    ) -> list[int]:
        return ngram_proposal([*prompt_ids, *output_ids], k, self.n_max)


class DraftModelProposer:
    """Greedy drafts from a small model that shares the target's vocabulary, masked by the grammar at
    every draft step (so every draft is one the grammar accepts).

    Keeps a KV cache per prompt (at most ``max_cached`` prompts, least recently used dropped) and
    crops it to the longest prefix still valid, so each step feeds the draft model only the tokens
    it has not seen. The draft model runs where its parameters live.

    Parameters
    ----------
    model : ModelHandle, or anything :func:`constrain.load_model` takes
    k : int, default: 4
        Most drafts per step (the loop's own cap, ``MAX_DRAFT``, applies as well).
    max_cached : int, default: 64
        Prompts whose draft KV cache is kept.
    """

    def __init__(self, model: ModelHandle | Any, *, k: int = 4, max_cached: int = 64) -> None:
        from constrain.models import ModelHandle, load_model

        if k < 1 or max_cached < 1:
            raise ValueError(f"k and max_cached must be at least 1, got {k} and {max_cached}")
        self.handle = model if isinstance(model, ModelHandle) else load_model(model)
        self.k = k
        self.max_cached = max_cached
        self._caches: OrderedDict[tuple[int, ...], tuple[list[int], Any]] = OrderedDict()
        self._checked: set[int] = set()  # ids of the target tokenizers found compatible

    def check_vocabulary(self, target: ModelHandle) -> None:
        """Raise ``ValueError`` unless the draft model tokenizes like ``target`` (same vocabulary)."""
        if id(target.tokenizer) in self._checked:
            return
        if self.handle.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(
                f"the draft model {self.handle.name!r} has another vocabulary than {target.name!r}: "
                "a draft model must share the target's tokenizer"
            )
        self._checked.add(id(target.tokenizer))

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None
    ) -> list[int]:
        from transformers import DynamicCache

        model = self.handle.model
        device = next(model.parameters()).device
        ids = [*prompt_ids, *output_ids]
        key = tuple(prompt_ids)
        seen, cache = self._caches.pop(key, ([], None))
        common = 0
        for a, b in zip(seen, ids[:-1], strict=False):  # the last id is fed again: its logits are needed
            if a != b:
                break
            common += 1
        if cache is None or common == 0:
            cache, common = DynamicCache(), 0
        elif cache.get_seq_length() > common:
            cache.crop(common - cache.get_seq_length())  # a negative count: the tokens to remove
        feed, drafts = ids[common:], []
        with torch.inference_mode():
            for _ in range(min(k, self.k)):
                out = model(input_ids=torch.tensor([feed], device=device), past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1].float()  # [1, V_draft]
                if matcher is not None:
                    logits = logits[:, : matcher.compiled.vocab_size]  # [1, V]: padding ids are never drafted
                    bitmask = allocate_token_bitmask(1, logits.shape[-1])  # [1, ceil(V / 32)]
                    matcher.fill_next_token_bitmask(bitmask)
                    apply_token_bitmask_inplace(logits, bitmask.to(device))
                token = int(logits.argmax())
                if token in self.handle.eos_token_ids or (matcher is not None and not matcher.accept_token(token)):
                    break
                drafts.append(token)
                feed = [token]
        self._caches[key] = ([*ids, *drafts][: cache.get_seq_length()], cache)
        while len(self._caches) > self.max_cached:
            self._caches.popitem(last=False)
        return drafts
