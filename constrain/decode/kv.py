"""The batch's KV cache: reusing prompt prefixes, grouping prefills, merging joining rows, appending in place.

A :class:`~constrain.decode.loop.DecodeLoop` prefills joining prompts in groups of similar length
(:func:`prefill_groups`), or alone after a prefix another prompt left in the :class:`PrefixCache`,
then appends their rows to the running batch's cache (:func:`merge_rows`), which only caches of
full-attention layers allow (:func:`mergeable`). Its full-attention layers append each step's keys and
values in place (:class:`GrowingLayer`), where transformers' would copy the whole cache.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

try:  # transformers' caches made of layers (4.54 on)
    from transformers.cache_utils import DynamicLayer
except ImportError:  # an older transformers: no layer is a DynamicLayer, so none grows in place
    DynamicLayer = object  # type: ignore[assignment,misc]

from constrain import caches
from constrain.decode.request import InFlight

__all__ = [
    "GROWTH",
    "GROW_FROM",
    "MIN_PREFIX",
    "PREFILL_PADDING",
    "PREFIX_CACHE_CAP",
    "PREFIX_CACHE_SHARE",
    "GrowingLayer",
    "PrefixCache",
    "default_prefix_cache_bytes",
    "device_memory",
    "growing",
    "kv_bytes_per_token",
    "longest_prefix",
    "merge_rows",
    "mergeable",
    "prefill_groups",
]

MIN_PREFIX = 16
"""Shortest shared prompt prefix (tokens) worth prefilling from the :class:`PrefixCache`."""

PREFIX_CACHE_SHARE = 0.05
"""Share of the memory the KV lives in (:func:`device_memory`) that a default :class:`PrefixCache` may hold."""

PREFIX_CACHE_CAP = 512 << 20
"""Ceiling of a default :class:`PrefixCache`'s bound, in bytes (512 MiB)."""


def kv_bytes_per_token(model_or_config: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of KV cache one token takes in every layer (keys and values), for a decoder-only model
    with full attention in every layer: ``2 * layers * kv_heads * head_dim * dtype's size``.

    Parameters
    ----------
    model_or_config : a Hugging Face model (its ``config``) or a ``PretrainedConfig``
    dtype : torch.dtype or None, default: None (the model's parameters' dtype; float32 for a config)

    SmolLM2-135M (30 layers, 3 KV heads of 64) in float32, this project's default on a CPU:
    ``2 * 30 * 3 * 64 * 4`` = 46,080 bytes (45 KiB) a token, so 65,536 tokens take 3.0 GB.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if dtype is None:
        parameters = getattr(model_or_config, "parameters", None)
        dtype = next(parameters()).dtype if callable(parameters) else torch.float32
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * int(config.num_hidden_layers) * int(kv_heads) * int(head_dim) * dtype.itemsize


def device_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes of memory tensors on ``device`` share: a CUDA device's own; elsewhere (the CPU, or an
    accelerator with unified memory such as MPS) the machine's physical memory, or the container's
    memory limit where smaller. None where it cannot be read. Reads no state it changes."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return caches.machine_memory()


def default_prefix_cache_bytes(device: torch.device | str | None = None) -> int:
    """The bound of a :class:`PrefixCache` made with ``max_bytes=None`` whose KV lives on ``device``
    (default: None, the CPU): :data:`PREFIX_CACHE_SHARE` of :func:`device_memory`, at most
    :data:`PREFIX_CACHE_CAP` (the cap alone where the memory cannot be read)."""
    memory = device_memory(device)
    return PREFIX_CACHE_CAP if memory is None else min(int(PREFIX_CACHE_SHARE * memory), PREFIX_CACHE_CAP)


class PrefixCache:
    """The KV cache of recently prefilled prompts, so that a prompt sharing a prefix with one of them
    (the chat template's system prompt, a tool list, a few-shot preamble) is prefilled from there.

    Keeps whole prompts, matched by longest common prefix, least recently used dropped past
    ``max_bytes`` of KV (keys and values of every layer, as kept); only for caches of full-attention
    layers (see :func:`mergeable`). Keys already carry their rotary positions, which a prompt sharing
    the prefix shares too. A prompt shorter than :data:`MIN_PREFIX` (it could never be matched), or
    whose KV alone exceeds ``max_bytes``, is not kept. Not thread-safe: one per decode loop, used from
    its stepping thread; the figures :mod:`constrain.caches` reads are plain counters.

    Parameters
    ----------
    max_bytes : int or None, default: None (sized to the machine: :func:`default_prefix_cache_bytes`)
        The bound on the KV kept, in bytes; 0 keeps nothing. The default is 5% of the memory the KV
        lives in (learnt at the first :meth:`add`: a CUDA device's memory, else the machine's), at most
        512 MiB. It sits beside the model's weights and the running batch's own KV, so it takes a small
        share, and a reuse cache pays only for prefixes recent prompts share: 512 MiB holds 11,650
        tokens of SmolLM2-135M in float32 (46,080 bytes a token, :func:`kv_bytes_per_token`), 58
        prompts of 200 tokens, or 4,096 tokens of an 8B model with 8 KV heads of 128 in bfloat16.
        The bound it replaced, 65,536 tokens, was 3.0 GB for SmolLM2.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (or None: sized to the machine), got {max_bytes}")
        self._sized = max_bytes is not None  # with the default: whether sized to the KV's device yet
        self._max_bytes = default_prefix_cache_bytes() if max_bytes is None else max_bytes
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._sizes: dict[tuple[int, ...], int] = {}  # per entry, its bytes
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        with _live_lock:
            _live.add(self)

    @property
    def max_bytes(self) -> int:
        """The bound in bytes: as given, else sized to the device of the first KV added (to the CPU's
        memory until then)."""
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of KV held now (keys and values of every layer)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> int:
        """Length of the longest prefix of ``prompt`` cached (0 below :data:`MIN_PREFIX`), at most all
        tokens but the last (whose logits the prefill must compute). Counts a hit or a miss; changes
        no entry."""
        found = longest_prefix(self._entries, prompt)
        if found:
            self.hits += 1
        else:
            self.misses += 1
        return found

    def cache(self, prompt: Sequence[int], length: int) -> Any:
        """A fresh ``DynamicCache`` holding the KV of ``prompt[:length]`` (which :meth:`match` found);
        the entry it comes from becomes the most recently used."""
        from transformers import DynamicCache

        head = tuple(prompt[:length])
        key = next(k for k in self._entries if k[:length] == head)
        self._entries.move_to_end(key)
        out = DynamicCache()
        for layer, (keys, values) in enumerate(self._entries[key]):
            out.update(keys[:, :, :length], values[:, :, :length], layer)  # views: the forward appends by copy
        return out

    def add(self, prompts: list[list[int]], cache: Any) -> None:
        """Keep the KV of each of ``prompts``, the rows of ``cache`` (left-padded to the longest; not
        changed: the rows are copied), then drop the least recently used entries past :attr:`max_bytes`."""
        width = max(len(p) for p in prompts)
        if not self._sized and cache.layers:
            self._max_bytes = default_prefix_cache_bytes(cache.layers[0].keys.device)
            self._sized = True
        bound = self._max_bytes
        for row, prompt in enumerate(prompts):
            key, start = tuple(prompt), width - len(prompt)
            if key in self._entries or len(prompt) < MIN_PREFIX:
                continue
            rows = [
                (layer.keys[row : row + 1, :, start:], layer.values[row : row + 1, :, start:]) for layer in cache.layers
            ]  # [1, heads, len(prompt), head_dim] each
            size = sum(_nbytes(keys) + _nbytes(values) for keys, values in rows)
            if size > bound:
                continue
            self._entries[key] = [(keys.clone(), values.clone()) for keys, values in rows]  # contiguous: ``size`` bytes
            self._sizes[key] = size
            self._bytes += size
        while self._bytes > bound:
            key, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(key)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.nelement() * tensor.element_size()


_live: weakref.WeakSet[PrefixCache] = weakref.WeakSet()
"""Every :class:`PrefixCache` alive (one per decode loop): reported together, and dropped with their loops."""
_live_lock = threading.Lock()


def _figures() -> dict[str, int]:
    """The live prefix caches together: entries, bytes held, their bounds' sum (``max_bytes``), hits and
    misses; ``maxsize`` is ``max_bytes``, or one default cache's bound while none lives."""
    with _live_lock:
        live = list(_live)
    bound = sum(c.max_bytes for c in live)
    return {
        "instances": len(live), "entries": sum(len(c) for c in live), "bytes": sum(c.nbytes for c in live),
        "max_bytes": bound, "maxsize": bound if live else default_prefix_cache_bytes(),
        "hits": sum(c.hits for c in live), "misses": sum(c.misses for c in live),
    }  # fmt: skip


caches.register("decode.kv.prefix_cache", _figures)


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


GROWTH = 0.25
"""Room a :class:`GrowingLayer` makes when it runs out: this share of the tokens it then holds (at least 64 more)."""
GROW_FROM = 512
"""Tokens of all rows together from which a :class:`GrowingLayer` keeps buffers (below, it concatenates, as
``DynamicLayer`` does: an update of its views cost 9.7 µs against 4 µs for concatenating 40 tokens of one row,
and 20 µs for 1,000, SmolLM2-135M's shapes in bfloat16 on an Intel Xeon)."""


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # (transformers' __init_subclass__)
    """transformers' full-attention ``DynamicLayer``, its keys and values held at the front of buffers with room
    to spare, so that a step writes its new tokens in place. ``DynamicLayer`` concatenates: every step copies
    the whole cache of every layer (SmolLM2-135M in bfloat16, 8 rows of 1,000 tokens: 30 layers' keys and values,
    184 MB a step). A full buffer is replaced by one :data:`GROWTH` larger (each token copied a few times in
    all, not once a step); keys put in place by something else (a merge, a row selection; a crop keeps the
    buffers) move into a new buffer at the next :meth:`update`. The keys and values are the same numbers; they are
    views of the buffers (``[b, heads, tokens, head_dim]``, a stride of the buffer's length), which attention
    takes as they are. At most :data:`GROWTH` of the cache's memory (64 tokens at least) is spare. A layer holding
    fewer than :data:`GROW_FROM` tokens over all its rows concatenates, as ``DynamicLayer`` does."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self,
        key_states: torch.Tensor,  # [b, heads, n, head_dim]
        value_states: torch.Tensor,  # [b, heads, n, head_dim]
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [b, heads, T + n, head_dim] each, views of the buffers
        """Append the step's keys and values (``DynamicLayer.update``); mutates the layer, never its inputs."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # (initialized)
        held = keys.shape[-2] if keys.dim() == 4 else 0
        total = held + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None and key_states.shape[0] * total < GROW_FROM:
            return super().update(key_states, value_states)  # a small cache: concatenating costs less
        if (
            buffers is None
            or not (  # the keys are no longer the buffers' front, or the buffers are full
                held
                and keys.data_ptr() == buffers[0].data_ptr()
                and keys.stride() == buffers[0].stride()
                and keys.shape[:-2] == buffers[0].shape[:-2]
                and buffers[0].shape[-2] >= total
                and values.data_ptr() == buffers[1].data_ptr()
            )
        ):
            spare = total + max(int(total * GROWTH), 64)
            buffers = (
                key_states.new_empty(*key_states.shape[:-2], spare, key_states.shape[-1]),  # [b, heads, spare, d]
                value_states.new_empty(*value_states.shape[:-2], spare, value_states.shape[-1]),
            )
            if held:
                buffers[0].narrow(-2, 0, held).copy_(keys)
                buffers[1].narrow(-2, 0, held).copy_(values)
            self._buffers = buffers
        buffers[0].narrow(-2, held, total - held).copy_(key_states)
        buffers[1].narrow(-2, held, total - held).copy_(value_states)
        self.keys, self.values = buffers[0].narrow(-2, 0, total), buffers[1].narrow(-2, 0, total)
        return self.keys, self.values

    def reset(self) -> None:
        """``DynamicLayer.reset``, the buffers dropped."""
        self._buffers = None
        super().reset()


def growing(cache: Any) -> Any:
    """``cache`` (a transformers ``Cache``) with its plain full-attention layers made :class:`GrowingLayer`, in
    place (their class swapped: what they hold is unchanged); others (sliding windows) are left as they are.
    Returns ``cache``."""
    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache


def mergeable(cache: Any) -> bool:
    """Whether rows can join ``cache``: every layer a plain (full attention) dynamic layer."""
    return cache is not None and all(
        type(layer) in (DynamicLayer, GrowingLayer) for layer in getattr(cache, "layers", [None])
    )


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
