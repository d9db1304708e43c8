"""Stages 2 and 3: logit bias and the repetition / frequency / presence penalties.

All of them touch only the tokens they name: O(batch x tokens seen), never a
pass over the vocabulary.

Token-id tensors are padded per row. A pad repeats a real id of its row (so a
``scatter_`` that sets a value writes the same value twice, which is
deterministic) and carries a zero weight in ``valid``; rows with no ids are
padded with id 0 and their penalty is made a no-op by the caller.
"""

from __future__ import annotations

import torch

__all__ = ["apply_logit_bias_inplace", "apply_penalties_inplace"]


def apply_logit_bias_inplace(
    # [B, V] float; modified in place
    logits: torch.Tensor,
    # [n] int64
    rows: torch.Tensor,
    # [n] int64
    token_ids: torch.Tensor,
    # [n] float32
    bias: torch.Tensor,
) -> None:
    """``logits[rows[i], token_ids[i]] += bias[i]`` for every ``i``, in place."""
    logits.index_put_((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def apply_penalties_inplace(
    # [B, V] float; modified in place
    logits: torch.Tensor,
    # [B, Ls] int64: prompt and output ids, padded as the module docstring says
    seen_ids: torch.Tensor,
    # [B, Lo] int64: output ids only, padded likewise
    output_ids: torch.Tensor,
    # [B, Lo] float32: 1 for a real output id, 0 for a pad
    output_valid: torch.Tensor,
    # [B] float32: 1 means none; must be 1 for rows without any seen id
    repetition_penalty: torch.Tensor,
    # [B] float32
    frequency_penalty: torch.Tensor,
    # [B] float32: must be 0 for rows without any output id
    presence_penalty: torch.Tensor,
) -> None:
    """Apply the three penalties, in place, in the order of vLLM and transformers.

    1. repetition (over prompt and output): ``l / r`` if ``l > 0`` else ``l * r``;
    2. presence (over output): ``l - presence`` once per distinct token;
    3. frequency (over output): ``l - frequency * count``.
    """
    if seen_ids.shape[1]:
        r = repetition_penalty.unsqueeze(1)  # [B, 1]
        old = logits.gather(1, seen_ids)  # [B, Ls]
        logits.scatter_(1, seen_ids, torch.where(old > 0, old / r, old * r))
    if output_ids.shape[1]:
        old = logits.gather(1, output_ids)  # [B, Lo]
        logits.scatter_(1, output_ids, old - presence_penalty.unsqueeze(1))
        logits.scatter_add_(1, output_ids, output_valid * -frequency_penalty.unsqueeze(1))
