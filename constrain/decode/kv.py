"""The batch's KV cache: reusing prompt prefixes, grouping prefills, merging joining rows.

A :class:`~constrain.decode.loop.DecodeLoop` prefills joining prompts in groups of similar length
(:func:`prefill_groups`), or alone after a prefix another prompt left in the :class:`PrefixCache`,
then appends their rows to the running batch's cache (:func:`merge_rows`), which only caches of
full-attention layers allow (:func:`mergeable`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from constrain.decode.request import InFlight

__all__ = [
    "MIN_PREFIX",
    "PREFILL_PADDING",
    "PrefixCache",
    "longest_prefix",
    "merge_rows",
    "mergeable",
    "prefill_groups",
]

MIN_PREFIX = 16
"""Shortest shared prompt prefix (tokens) worth prefilling from the :class:`PrefixCache`."""


class PrefixCache:
    """The KV cache of recently prefilled prompts, so that a prompt sharing a prefix with one of them
    (the chat template's system prompt, a tool list, a few-shot preamble) is prefilled from there.

    Keeps whole prompts (least recently used dropped past ``max_tokens`` tokens in all), matched by
    longest common prefix; only for caches of full-attention layers (see :func:`mergeable`).
    Keys already carry their rotary positions, which a prompt sharing the prefix shares too.
    """

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._tokens = 0

    def match(self, prompt: Sequence[int]) -> int:
        """Length of the longest prefix of ``prompt`` cached (0 below :data:`MIN_PREFIX`), at most all
        tokens but the last (whose logits the prefill must compute)."""
        return longest_prefix(self._entries, prompt)

    def cache(self, prompt: Sequence[int], length: int) -> Any:
        """A fresh ``DynamicCache`` holding the KV of ``prompt[:length]`` (which :meth:`match` found)."""
        from transformers import DynamicCache

        head = tuple(prompt[:length])
        key = next(k for k in self._entries if k[:length] == head)
        self._entries.move_to_end(key)
        out = DynamicCache()
        for layer, (keys, values) in enumerate(self._entries[key]):
            out.update(keys[:, :, :length], values[:, :, :length], layer)  # views: the forward appends by copy
        return out

    def add(self, prompts: list[list[int]], cache: Any) -> None:
        """Keep the KV of each of ``prompts``, the rows of ``cache`` (left-padded to the longest)."""
        width = max(len(p) for p in prompts)
        for row, prompt in enumerate(prompts):
            key = tuple(prompt)
            if key in self._entries or len(prompt) > self.max_tokens:
                continue
            start = width - len(prompt)
            self._entries[key] = [
                (layer.keys[row : row + 1, :, start:].clone(), layer.values[row : row + 1, :, start:].clone())
                for layer in cache.layers
            ]  # [1, heads, len(prompt), head_dim] each
            self._tokens += len(prompt)
        while self._tokens > self.max_tokens:
            key, _ = self._entries.popitem(last=False)
            self._tokens -= len(key)


PREFILL_PADDING = 0.25
"""A prefill group's longest prompt exceeds its shortest by at most this share (plus 8 tokens)."""


def longest_prefix(keys: Iterable[tuple[int, ...]], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix of ``prompt`` but its last token with any of ``keys``
    (0 below :data:`MIN_PREFIX`)."""
    head, best = tuple(prompt[: len(prompt) - 1]), 0
    for key in keys:
        low, high = MIN_PREFIX, min(len(key), len(head))  # the common length, by bisection on slices
        if high < low or key[:low] != head[:low]:
            continue
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if key[:mid] == head[:mid] else (low, mid - 1)
        best = max(best, low)
    return best if best >= MIN_PREFIX else 0


def prefill_groups(joining: list[InFlight]) -> list[list[InFlight]]:
    """``joining`` (sorted by prompt length) cut into runs of similar lengths, each prefilled in one
    forward pass: padding a 40-token prompt to a 200-token neighbour would cost 5x its compute, and on
    a compute-bound device one pass per group costs about what one padded pass would."""
    groups: list[list[InFlight]] = []
    for r in joining:
        if groups and len(r.prompt_ids) <= len(groups[-1][0].prompt_ids) * (1 + PREFILL_PADDING) + 8:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def mergeable(cache: Any) -> bool:
    """Whether rows can join ``cache``: every layer a plain (full attention) dynamic layer."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def merge_rows(
    cache: Any,
    # [b, T] long: the running rows' attention mask, as long as ``cache``
    mask: torch.Tensor,
    joining: Any,
    # [n, T'] long: the joining rows' attention mask, as long as ``joining``
    joining_mask: torch.Tensor,
) -> torch.Tensor:  # [b + n, max(T, T')]
    """Append ``joining``'s rows to ``cache`` (mutated), left-padding the shorter side; returns the
    merged attention mask. Keys already carry their rotary positions, so padding shifts nothing."""
    width = max(mask.shape[1], joining_mask.shape[1])

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if not missing:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    for layer, new in zip(cache.layers, joining.layers, strict=True):
        layer.keys = torch.cat([pad(layer.keys, 2), pad(new.keys, 2)])  # [b + n, heads, width, head_dim]
        layer.values = torch.cat([pad(layer.values, 2), pad(new.values, 2)])
    return torch.cat([pad(mask, 1), pad(joining_mask, 1)])
