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

import torch

from .sampling import BLOCK

__all__ = ["block_argmax", "block_max", "block_topk"]


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
    # [B, V] float
    logits: torch.Tensor,
    # [n] int64
    rows: torch.Tensor,
    # [n, m] int64: block indices per row
    blocks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``blocks`` of ``rows``: ``(values [n, m * BLOCK], token ids [n, m * BLOCK])``.

    Copies whole blocks (indexing a ``[B, blocks, BLOCK]`` view: an element-wise gather of the same
    values is several times slower on CPU); a last, shorter block is padded with ``-inf``.
    """
    batch, vocab = logits.shape
    full = vocab // BLOCK
    ids = (blocks.unsqueeze(2) * BLOCK + torch.arange(BLOCK, device=logits.device)).flatten(1)  # [n, m * BLOCK]
    if full:
        grid = logits[:, : full * BLOCK].view(batch, full, BLOCK)  # a view
        values = grid[rows.unsqueeze(1), blocks.clamp(max=full - 1)]  # [n, m, BLOCK]
    else:
        values = torch.empty(rows.numel(), blocks.shape[1], BLOCK, dtype=logits.dtype, device=logits.device)
    if vocab % BLOCK:
        tail = torch.full((rows.numel(), BLOCK), float("-inf"), dtype=logits.dtype, device=logits.device)
        tail[:, : vocab - full * BLOCK] = logits[rows, full * BLOCK :]  # [n, BLOCK]
        values = torch.where((blocks == full).unsqueeze(2), tail.unsqueeze(1), values)  # [n, m, BLOCK]
        ids = ids.clamp(max=vocab - 1)  # a -inf pad may be taken where logits are -inf: keep its id in V
    return values.flatten(1), ids


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
    values, ids = _gather_blocks(logits, rows, block)  # [n, BLOCK] each
    best, pos = values.max(-1)  # [n] each
    return best, ids.gather(1, pos.unsqueeze(1)).squeeze(1)


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
    values, ids = _gather_blocks(logits, rows, blocks)  # [n, m * BLOCK] each
    top, pos = values.topk(width, dim=-1)  # [n, width] each
    return top, ids.gather(1, pos)
