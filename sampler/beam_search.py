"""One step of beam search: log-softmax, accumulate, keep the best ``beam_width`` of ``beams x V``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.bitmask import apply_token_bitmask_inplace

__all__ = ["BeamSearchStep", "beam_search_step"]


@dataclass(slots=True)
class BeamSearchStep:
    """The surviving beams, best first."""

    scores: torch.Tensor  # [B, beam_width] float32: accumulated log-probabilities, descending
    beam_indices: torch.Tensor  # [B, beam_width] int64: the previous beam each survivor extends
    token_ids: torch.Tensor  # [B, beam_width] int64: the token appended
    candidates: torch.Tensor  # [B, W, V] float32: every expansion's score (-inf: disallowed), to rank further


def beam_search_step(
    # [B, W, V] float: the next-token logits of each of W live beams; not mutated
    logits: torch.Tensor,
    # [B, W] float: accumulated log-probabilities; -inf marks an unused beam
    beam_scores: torch.Tensor,
    beam_width: int,
    *,
    # [B * W, ceil(V / 32)] int32 or None: allowed tokens per beam (xgrammar's layout)
    token_bitmask: torch.Tensor | None = None,
) -> BeamSearchStep:
    """Expand every beam by every token and keep the ``beam_width`` best.

    A beam's next-token distribution is renormalised over its allowed tokens.
    To start, pass ``W = 1`` and ``beam_scores = 0``. A candidate whose score is
    ``-inf`` (fewer live candidates than ``beam_width``) is still returned, with
    its ``-inf`` score; callers drop such beams.
    """
    if logits.dim() != 3 or beam_scores.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [batch, beams, vocab] and beam_scores [batch, beams]; got "
            f"{tuple(logits.shape)} and {tuple(beam_scores.shape)}"
        )
    batch, width, vocab = logits.shape
    if not 1 <= beam_width <= width * vocab:
        raise ValueError(f"beam_width={beam_width} must be in [1, beams x vocab = {width * vocab}]")
    flat = logits.reshape(batch * width, vocab).float()  # [B*W, V]
    if token_bitmask is not None:
        flat = flat.clone() if flat.data_ptr() == logits.data_ptr() else flat
        apply_token_bitmask_inplace(flat, token_bitmask)
    logprobs = torch.log_softmax(flat, dim=-1).view(batch, width, vocab)  # [B, W, V]
    candidates = beam_scores.float().unsqueeze(-1) + logprobs  # [B, W, V]
    candidates.masked_fill_(candidates.isnan(), float("-inf"))  # a fully masked beam: -inf, not NaN
    scores, flat_idx = candidates.view(batch, width * vocab).topk(beam_width, dim=-1)  # [B, beam_width]
    return BeamSearchStep(
        scores=scores, beam_indices=flat_idx // vocab, token_ids=flat_idx % vocab, candidates=candidates
    )
