"""The token bitmask on the host: allocating it, reading a row, clearing and setting tokens.

Layout (xgrammar's, which :mod:`constrain.sampler.ops.bitmask` applies to the logits): a bitmask is int32
``[B, ceil(V / 32)]``; token ``t`` is allowed in row ``i`` iff bit ``t % 32`` of word
``bitmask[i, t // 32]`` is set (bit 31 is the sign bit: a word with token ``32w + 31`` allowed is
negative). Bits for ids ``>= V`` are padding. Reference loop::

    allowed = [
        t for t in range(V)
        if (int(bitmask[i, t // 32]) >> (t % 32)) & 1
    ]

Every function here takes a row's words (``[ceil(V / 32)]`` int32) as a NumPy array or a CPU
tensor: ``tensor.numpy()`` shares the tensor's memory, so the functions that update a row in place
(:func:`clear_bits`, :func:`set_bits`) update the tensor. They are vectorized: no Python loop over
tokens or words.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np
import torch

__all__ = [
    "allocate_token_bitmask",
    "allowed_among",
    "allowed_ids",
    "bitmask_size",
    "clear_bits",
    "count_allowed",
    "is_allowed",
    "pack",
    "set_bits",
    "unpack",
]

if sys.byteorder != "little":  # pragma: no cover - every torch target is little-endian today
    raise ImportError("constrain.match.bitmask assumes a little-endian byte order")

Words = np.ndarray | torch.Tensor
"""A bitmask row's words, ``[ceil(V / 32)]`` int32: a NumPy array, or a CPU tensor (read through a view)."""


def bitmask_size(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``[batch_size, ceil(vocab_size / 32)]`` int32 bitmask with every token allowed (every bit set).

    Fill it on the CPU (the matchers write host memory), then move it to the
    logits' device for the sampler.
    """
    if batch_size < 1 or vocab_size < 1:
        raise ValueError(f"batch_size and vocab_size must be positive, got {batch_size} and {vocab_size}")
    return torch.full((batch_size, bitmask_size(vocab_size)), -1, dtype=torch.int32, device=device)


def _words(
    # [..., ceil(V / 32)] int32, NumPy or a CPU tensor
    row: Words,
) -> np.ndarray:
    """``row`` as an int32 NumPy array sharing its memory."""
    words = row.numpy() if isinstance(row, torch.Tensor) else row
    if words.dtype != np.int32:
        raise ValueError(f"a bitmask is int32 (xgrammar's layout), got {words.dtype}")
    return words


def unpack(
    # [..., ceil(V / 32)] int32
    row: Words,
) -> np.ndarray:
    """``[..., 32 * ceil(V / 32)]`` bool: per token id, whether it is allowed (padding ids included).

    The inverse of :func:`pack`. A new array: writing to it does not change ``row``.
    """
    words = np.ascontiguousarray(_words(row))  # [..., W] int32
    flags = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # [..., 32 * W] uint8, 0 or 1
    return flags.view(np.bool_)


def pack(
    # [..., 32 * W] bool: per token id, whether it is allowed
    flags: np.ndarray,
) -> np.ndarray:
    """``[..., W]`` int32: the bitmask words of ``flags`` (the inverse of :func:`unpack`)."""
    if flags.shape[-1] % 32:
        raise ValueError(f"pack takes whole words: 32 * W flags per row, got {flags.shape[-1]}")
    grouped = flags.reshape(*flags.shape[:-1], -1, 32)  # [..., W, 32]
    packed = np.packbits(grouped, axis=-1, bitorder="little")  # [..., W, 4] uint8: bit i of byte j is token 8j + i
    return np.ascontiguousarray(packed).view(np.int32).squeeze(-1)  # [..., W]


def is_allowed(
    # [ceil(V / 32)] int32
    row: Words,
    token: int,
) -> bool:
    """Whether ``token``'s bit is set in ``row``."""
    return bool((int(_words(row)[token >> 5]) >> (token & 31)) & 1)


def allowed_among(
    # [ceil(V / 32)] int32
    row: Words,
    # [n] int64: token ids, each below 32 * ceil(V / 32)
    tokens: np.ndarray,
) -> np.ndarray:
    """``[k]`` int64: the ``tokens`` allowed in ``row``, in their order."""
    words = _words(row)
    found: np.ndarray = tokens[(words[tokens >> 5] >> (tokens & 31)) & 1 == 1]  # [k] int64
    return found


def allowed_ids(
    # [ceil(V / 32)] int32
    row: Words,
    vocab_size: int | None = None,
) -> np.ndarray:
    """``[k]`` int64: the allowed token ids, ascending; below ``vocab_size`` (None: padding ids too)."""
    ids = np.flatnonzero(unpack(row))  # [k] int64
    return ids if vocab_size is None else ids[ids < vocab_size]


def count_allowed(
    # [ceil(V / 32)] int32
    row: Words,
) -> int:
    """How many bits ``row`` has set (padding ids included)."""
    return int(np.bitwise_count(_words(row).view(np.uint32)).sum())


_FEW = 6
"""Up to this many tokens, :func:`clear_bits` and :func:`set_bits` loop in Python (a vectorized call
costs more than a few word updates)."""


def _update(
    # [ceil(V / 32)] int32; updated in place
    row: Words,
    tokens: Iterable[int] | np.ndarray,
    *,
    clear: bool,
) -> None:
    words = _words(row).view(np.uint32)  # [ceil(V / 32)] uint32, a view: the same bits, no sign
    ids = tokens if isinstance(tokens, np.ndarray) else list(tokens)
    if len(ids) <= _FEW:
        for token in ids:
            bit = 1 << (int(token) & 31)
            word = int(words[token >> 5])
            words[token >> 5] = word & ~bit if clear else word | bit
        return
    index = np.asarray(ids, dtype=np.int64)  # [n]
    bits = np.left_shift(np.uint32(1), (index & 31).astype(np.uint32))  # [n] uint32
    if clear:
        np.bitwise_and.at(words, index >> 5, ~bits)  # unbuffered: one word may take several
    else:
        np.bitwise_or.at(words, index >> 5, bits)


def clear_bits(
    # [ceil(V / 32)] int32; updated in place
    row: Words,
    tokens: Iterable[int] | np.ndarray,
) -> None:
    """Clear the bits of ``tokens`` in ``row``, in place (repeated tokens and tokens of one word are fine)."""
    _update(row, tokens, clear=True)


def set_bits(
    # [ceil(V / 32)] int32; updated in place
    row: Words,
    tokens: Iterable[int] | np.ndarray,
) -> None:
    """Set the bits of ``tokens`` in ``row``, in place (the other bits are kept: zero the row first to
    allow ``tokens`` only)."""
    _update(row, tokens, clear=False)
