"""Stages 5 and 7 on CPU-friendly terms: the argmax and a small top-k from per-block maxima.

``torch.argmax`` and ``torch.topk`` over a whole vocabulary are several times slower on a CPU
than a plain reduction (measured at 64 x 128,256 on AVX2: ``argmax`` 3.5 ms and ``topk(50)``
5.4 ms against 0.4 ms for ``amax``). So both read the logits once, as maxima of blocks of
``BLOCK`` tokens (:func:`block_max`), and then work only inside the few blocks that can hold
the answer:

- the argmax lies in the first block whose maximum is the row's maximum;
- the ``m`` largest logits lie in the ``m`` blocks with the largest maxima: if a block left out
  held one of them, the ``m`` blocks taken would each hold a larger or equal logit (their
  maximum), so the ``m`` largest values of the blocks taken are the row's ``m`` largest values.

Both give exactly what ``argmax`` and ``topk(...).values`` give (the first maximal index; the
same values), on any device. Ids past the vocabulary (a last, shorter block) count as ``-inf``.
"""

from __future__ import annotations

import math

import torch

from .sampling import BLOCK

__all__ = ["LANES", "TWO_LEVEL", "block_argmax", "block_max", "block_topk"]

LANES = 16
"""Groups per block in :func:`block_topk`'s second level (each of ``BLOCK // LANES`` logits)."""
TWO_LEVEL = frozenset({"cpu"})
"""Device types on which :func:`block_topk` narrows the blocks to groups before its ``topk``: on a CPU,
``topk`` costs about 100 ns a value (2.6 ms at 24 x 101 blocks on an AMD EPYC, AVX2; the two levels 1.3 ms),
on a GPU the extra launches would cost more than they save."""


def block_max(
    # [n, V] float
    logits: torch.Tensor,
) -> torch.Tensor:
    """``[n, ceil(V / BLOCK)]`` maxima of consecutive blocks of ``BLOCK`` tokens (one read)."""
    n, vocab = logits.shape
    full = vocab // BLOCK
    parts = []
    if full:
        parts.append(logits[:, : full * BLOCK].reshape(n, full, BLOCK).amax(-1))  # a view, no copy
    if vocab % BLOCK:
        parts.append(logits[:, full * BLOCK :].amax(-1, keepdim=True))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _gather_blocks(
    # [B, V] float, contiguous
    logits: torch.Tensor,
    # [n] int64
    rows: torch.Tensor,
    # [n, m] int64: block indices per row
    blocks: torch.Tensor,
) -> torch.Tensor:
    """``[n, m * BLOCK]``: the logits of ``blocks`` of ``rows``; :func:`_block_ids` names their tokens.

    Copies whole blocks with one ``index_select`` of a view whose rows are the blocks (advanced indexing
    of a ``[B, blocks, BLOCK]`` view took 1.8 ms at 24 x 101 blocks on an AMD EPYC, AVX2, against 0.2 ms);
    a last, shorter block is padded with ``-inf``.
    """
    vocab = logits.shape[1]
    full = vocab // BLOCK
    n, m = blocks.shape
    if full:
        # [*, BLOCK]: every run of BLOCK logits starting at a multiple of `step` (a view; runs may overlap)
        step = math.gcd(vocab, BLOCK)
        runs = logits.reshape(-1).unfold(0, BLOCK, step)
        starts = (rows.unsqueeze(1) * vocab + blocks.clamp(max=full - 1) * BLOCK) // step  # [n, m]
        values = runs.index_select(0, starts.flatten()).view(n, m, BLOCK)
    else:
        values = torch.empty(n, m, BLOCK, dtype=logits.dtype, device=logits.device)
    if vocab % BLOCK:
        tail = torch.full((n, BLOCK), float("-inf"), dtype=logits.dtype, device=logits.device)
        tail[:, : vocab - full * BLOCK] = logits[rows, full * BLOCK :]  # [n, BLOCK]
        values = torch.where((blocks == full).unsqueeze(2), tail.unsqueeze(1), values)  # [n, m, BLOCK]
    return values.flatten(1)


def _block_ids(
    # [n, m] int64: the block indices given to _gather_blocks
    blocks: torch.Tensor,
    # [n, k] int64: positions in its [n, m * BLOCK] values
    pos: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """``[n, k]`` token ids at ``pos``, worked out only there (all ``m * BLOCK`` ids cost a pass).

    A ``-inf`` pad of a last, shorter block may be taken where logits are ``-inf``: its id is kept below ``vocab``.
    """
    return (blocks.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK).clamp_(max=vocab - 1)


def block_argmax(
    # [B, V] float
    logits: torch.Tensor,
    # [n] int64
    rows: torch.Tensor,
    # [B, ceil(V / BLOCK)]: block_max(logits)
    maxima: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max [n], argmax [n])`` of ``logits[rows]``: the first index of the maximum, as ``argmax``."""
    block = maxima[rows].argmax(-1, keepdim=True)  # [n, 1]: the first block holding the maximum
    best, pos = _gather_blocks(logits, rows, block).max(-1)  # [n] each
    return best, _block_ids(block, pos.unsqueeze(1), logits.shape[1]).squeeze(1)


def block_topk(
    # [B, V] float
    logits: torch.Tensor,
    # [n] int64
    rows: torch.Tensor,
    # [B, ceil(V / BLOCK)]: block_max(logits)
    maxima: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [n, width], token ids [n, width])``, descending: ``logits[rows].topk(width)``.

    The values equal ``topk``'s; among tied values the ids may be others of the same value, and
    where a value is ``-inf`` the id may be any id below ``V``. ``width`` must be at most ``V``.
    """
    num_blocks = maxima.shape[1]
    blocks = maxima[rows].topk(min(width, num_blocks), dim=-1).indices  # [n, m]
    values = _gather_blocks(logits, rows, blocks)  # [n, m * BLOCK]
    if logits.device.type in TWO_LEVEL:
        # the same argument one level down: the `width` largest values lie in the `width` groups with the
        # largest maxima; group j * LANES + l of `values` holds j * BLOCK + l + LANES * s, s < BLOCK // LANES
        n, m = blocks.shape
        lanes = values.view(n, m, BLOCK)
        while lanes.shape[-1] > LANES:  # halving, elementwise: a reduction over a short dim is slow on CPU
            half = lanes.shape[-1] // 2
            lanes = torch.maximum(lanes[..., :half], lanes[..., half:])  # [n, m, half]
        groups = lanes.reshape(n, m * LANES).topk(min(width, m * LANES), dim=-1).indices  # [n, g]
        first = groups // LANES * BLOCK + groups % LANES  # [n, g]
        at = (first.unsqueeze(2) + torch.arange(0, BLOCK, LANES, device=logits.device)).flatten(1)  # [n, g * 16]
        top, pos = values.gather(1, at).topk(width, dim=-1)  # [n, width] each
        return top, _block_ids(blocks, at.gather(1, pos), logits.shape[1])
    top, pos = values.topk(width, dim=-1)  # [n, width] each
    return top, _block_ids(blocks, pos, logits.shape[1])
