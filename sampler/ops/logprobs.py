"""Stage 11: logprobs of the sampled token and the top-N."""

from __future__ import annotations

import torch

__all__ = ["gather_logprobs"]


def gather_logprobs(
    # [n, V] float32: log-probabilities (-inf for excluded tokens)
    logprobs: torch.Tensor,
    # [n] int64: the sampled ids (-1 where none)
    token_ids: torch.Tensor,
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(sampled [n], top_ids [n, num_top], top_logprobs [n, num_top])``.

    ``sampled`` is NaN where ``token_ids`` is -1. Does not mutate its inputs.
    """
    sampled = logprobs.gather(1, token_ids.clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
    sampled = torch.where(token_ids >= 0, sampled, torch.full_like(sampled, float("nan")))
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [n, num_top] each
    return sampled, top_ids, top_logprobs
