"""Stage 1: the allowed-token bitmask.

Layout (the one xgrammar uses): ``bitmask`` is int32 ``[n, ceil(V / 32)]``; token
``t`` is allowed in row ``i`` iff bit ``t % 32`` of ``bitmask[i, t // 32]`` is set.
Bits for ids ``>= V`` are ignored. Reference loop::

    for i in range(n):
        for t in range(V):
            if not (bitmask[i, t // 32] >> (t % 32)) & 1:
                logits[rows[i], t] = -inf

Every op builds the ``0 / -inf`` penalty of :func:`bitmask_penalty` and adds it. Two kernels build it,
with the same values bit for bit (``kernel=``, as xgrammar's ``backend=``): ``"lut"`` gathers one
``[8]`` row of a 256-entry table per byte of the bitmask; ``"shifts"`` shifts each word by 0..31 and
selects. ``"auto"`` takes ``"lut"``, but ``"shifts"`` on a CUDA device for a mask of at least
:data:`SHIFTS_FROM` entries.

Measured by ``bench/sampler.py --bitmask-only`` (µs per call, medians; NVIDIA H100, torch 2.11; the
CPU: Intel Xeon family 6 model 207, AVX-512/AMX, 2 cores, torch 2.13):

| device | B x V | lut | shifts | xgrammar's kernel |
|---|---|---|---|---|
| H100 | 1 x 128,256 | 70 | 166 | 69 |
| H100 | 64 x 49,152 | 287 | 114 | 51 |
| H100 | 64 x 128,256 | 695 | 152 | 71 |
| CPU | 1 x 128,256 | 73 | 677 | 457 |
| CPU | 64 x 128,256 | 6,237 | 42,276 | 27,370 |

A small mask on a GPU costs its kernel launches, fewest for the table's gather; a large one costs the
gather's narrow ``[8]`` rows, where one shift and one select per entry run at the GPU's bandwidth. The
same gather through ``torch.nn.functional.embedding`` timed as ``index_select`` on both devices (within 2%).
"""

from __future__ import annotations

import sys
from typing import Literal

import torch

__all__ = [
    "SHIFTS_FROM", "Kernel", "apply_token_bitmask", "apply_token_bitmask_inplace", "auto_kernel", "bitmask_penalty",
    "bitmask_size",
]  # fmt: skip

Kernel = Literal["auto", "lut", "shifts"]
"""How :func:`bitmask_penalty` builds the penalty (see the module docstring)."""

SHIFTS_FROM = 1 << 20
"""Mask entries (rows x 32 x words) from which ``"auto"`` shifts on a CUDA device: between the sizes
measured (128K entries: the gather 2.4x faster; 3.1M: shifting 2.5x faster)."""

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


def auto_kernel(
    # [n, ceil(V / 32)] int32
    bitmask: torch.Tensor,
) -> Kernel:
    """The kernel ``"auto"`` runs for ``bitmask``: ``"shifts"`` on a CUDA device from :data:`SHIFTS_FROM`
    entries, else ``"lut"``."""
    return "shifts" if bitmask.device.type == "cuda" and bitmask.numel() * 32 >= SHIFTS_FROM else "lut"


def bitmask_penalty(
    # [n, ceil(V / 32)] int32
    bitmask: torch.Tensor,
    vocab_size: int,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Return ``[n, vocab_size]`` float32: 0 where allowed, ``-inf`` where disallowed.

    ``kernel`` (default ``"auto"``: :func:`auto_kernel`) picks how (the module docstring); every kernel gives
    the same values. Does not mutate ``bitmask``.
    """
    if kernel not in ("auto", "lut", "shifts"):
        raise ValueError(f"kernel must be one of auto, lut, shifts; got {kernel!r}")
    n, words = bitmask.shape
    if (auto_kernel(bitmask) if kernel == "auto" else kernel) == "shifts":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]: bit j of word w is token 32w + j
        penalty = torch.where(bits.view(n, -1) != 0, 0.0, float("-inf"))  # [n, 32 * words] float32
    else:  # little-endian bytes hold tokens 8j..8j+7: one [8] row of the table per byte
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
    kernel: Kernel = "auto",
) -> None:
    """Set every disallowed logit to ``-inf``, in place, on the logits' device (``kernel``: see
    :func:`bitmask_penalty`).

    Implemented as adding the ``0 / -inf`` penalty of :func:`bitmask_penalty`:
    one contiguous add, cheaper than a boolean ``masked_fill_``. (A ``+inf``
    logit that is disallowed would become NaN; models do not produce ``+inf``.)
    Rows of ``logits`` not named in ``rows`` are untouched.
    """
    _check(logits, bitmask, rows)
    penalty = bitmask_penalty(bitmask, logits.shape[-1], kernel)  # [n, V]
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
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Return ``[B, V]``: ``logits`` with every disallowed logit ``-inf``; ``logits`` is left unchanged.

    The same values as :func:`apply_token_bitmask_inplace`, bit for bit, at the same cost when every row is
    constrained: the sum is written into the penalty's own buffer (one pass, as the in-place add); with
    ``rows``, the other rows are copied as well (one more pass). ``kernel``: see :func:`bitmask_penalty`.
    """
    _check(logits, bitmask, rows)
    penalty = bitmask_penalty(bitmask, logits.shape[-1], kernel)  # [n, V]
    if rows is None:
        if penalty.is_contiguous():  # V a multiple of 32 (else a view of a wider table)
            return penalty.add_(logits)  # [B, V]: x + 0 == 0 + x and x + -inf == -inf + x, exactly
        return logits + penalty  # [B, V]
    return logits.index_add(0, rows, penalty.to(logits.dtype))  # [B, V]
