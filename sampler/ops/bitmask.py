"""Stage 1: the allowed-token bitmask.

Layout (the one xgrammar uses): ``bitmask`` is int32 ``[n, ceil(V / 32)]``; token
``t`` is allowed in row ``i`` iff bit ``t % 32`` of ``bitmask[i, t // 32]`` is set.
Bits for ids ``>= V`` are ignored. Reference loop::

    for i in range(n):
        for t in range(V):
            if not (bitmask[i, t // 32] >> (t % 32)) & 1:
                logits[rows[i], t] = -inf
"""

from __future__ import annotations

import sys

import torch

__all__ = ["apply_token_bitmask", "apply_token_bitmask_inplace", "bitmask_penalty", "bitmask_size"]

if sys.byteorder != "little":  # pragma: no cover - every torch target is little-endian today
    raise ImportError("sampler.ops.bitmask assumes a little-endian byte order")

_PENALTY_LUT: dict[torch.device, torch.Tensor] = {}
"""Per device, its ``[256, 8]`` penalty table (8 KiB): as many as the devices used, so it needs no bound."""


def bitmask_size(vocab_size: int) -> int:
    """Number of int32 words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def _penalty_lut(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: entry ``[b, j]`` is ``-inf`` when bit ``j`` of byte ``b`` is clear, else 0."""
    lut = _PENALTY_LUT.get(device)
    if lut is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)  # [256, 1]
        bit = torch.arange(8, dtype=torch.int32)  # [8]
        clear = (byte >> bit) & 1 == 0  # [256, 8]
        lut = torch.zeros(256, 8).masked_fill_(clear, float("-inf")).to(device)
        _PENALTY_LUT[device] = lut
    return lut


def bitmask_penalty(
    # [n, ceil(V / 32)] int32
    bitmask: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Return ``[n, vocab_size]`` float32: 0 where allowed, ``-inf`` where disallowed.

    One gather from a 256-entry table per byte of the bitmask (little-endian
    bytes hold tokens 8j..8j+7), no per-bit shifts. Does not mutate ``bitmask``.
    """
    n, words = bitmask.shape
    byte_idx = bitmask.contiguous().view(torch.uint8).view(-1).int()  # [n * 4 * words]
    penalty = torch.index_select(_penalty_lut(bitmask.device), 0, byte_idx).view(n, -1)  # [n, 32 * words]
    return penalty if words * 32 == vocab_size else penalty[:, :vocab_size]


def _check(
    # [B, V] float32
    logits: torch.Tensor,
    # [n, ceil(V / 32)] int32
    bitmask: torch.Tensor,
    # [n] int64 or None
    rows: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` unless ``bitmask`` (and ``rows``) fit ``logits``."""
    if bitmask.dtype != torch.int32:
        raise ValueError(f"token bitmask must be int32 (xgrammar's layout), got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"token bitmask is on {bitmask.device} but logits on {logits.device}: move it first")
    vocab_size = logits.shape[-1]
    if bitmask.shape[-1] < bitmask_size(vocab_size):
        raise ValueError(
            f"token bitmask has {bitmask.shape[-1]} words per row; vocab {vocab_size} needs {bitmask_size(vocab_size)}"
        )
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"token bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows: pass rows=")


def apply_token_bitmask_inplace(
    # [B, V] float32; modified in place
    logits: torch.Tensor,
    # [n, ceil(V / 32)] int32, on logits.device
    bitmask: torch.Tensor,
    # [n] int64: the logits row of each bitmask row; None means row i -> row i (n == B)
    rows: torch.Tensor | None = None,
) -> None:
    """Set every disallowed logit to ``-inf``, in place, on the logits' device.

    Implemented as adding the ``0 / -inf`` penalty of :func:`bitmask_penalty`:
    one contiguous add, cheaper than a boolean ``masked_fill_``. (A ``+inf``
    logit that is disallowed would become NaN; models do not produce ``+inf``.)
    Rows of ``logits`` not named in ``rows`` are untouched.
    """
    _check(logits, bitmask, rows)
    penalty = bitmask_penalty(bitmask, logits.shape[-1])  # [n, V]
    if rows is None:
        logits.add_(penalty)
    else:
        logits.index_add_(0, rows, penalty.to(logits.dtype))


def apply_token_bitmask(
    # [B, V] float32; not modified
    logits: torch.Tensor,
    # [n, ceil(V / 32)] int32, on logits.device
    bitmask: torch.Tensor,
    # [n] int64: the logits row of each bitmask row; None means row i -> row i (n == B)
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``[B, V]``: ``logits`` with every disallowed logit ``-inf``; ``logits`` is left unchanged.

    The same values as :func:`apply_token_bitmask_inplace`, bit for bit, at the same cost when every row is
    constrained: the sum is written into the penalty's own buffer (one pass, as the in-place add); with
    ``rows``, the other rows are copied as well (one more pass).
    """
    _check(logits, bitmask, rows)
    penalty = bitmask_penalty(bitmask, logits.shape[-1])  # [n, V]
    if rows is None:
        if penalty.is_contiguous():  # V a multiple of 32 (else a view of a wider table)
            return penalty.add_(logits)  # [B, V]: x + 0 == 0 + x and x + -inf == -inf + x, exactly
        return logits + penalty  # [B, V]
    return logits.index_add(0, rows, penalty.to(logits.dtype))  # [B, V]
