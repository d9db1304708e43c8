"""Stages 7-9 as exact thresholds: top-k, then top-p over the top-k survivors, then min-p.

Each filter keeps an *upper set* of the row (every token at or above a
threshold), so the three compose into one threshold per row. The sampling hot
path (:mod:`constrain.sampler.ops.sampling`) never materialises these thresholds for
top-p; these functions are the exact definition, used for processed logprobs,
for target distributions in speculative decoding and as the fallback of the
rejection loop. They never sort the whole vocabulary: top-p widens a ``topk``
window by doubling until the nucleus fits.
"""

from __future__ import annotations

import torch

__all__ = ["apply_top_k_top_p_min_p", "top_k_threshold", "top_p_threshold"]

_FIRST_WINDOW = 64
"""Width of the first ``topk`` window of the top-p threshold search."""


def top_k_threshold(
    # [n, V] float
    logits: torch.Tensor,
    # [n] int64, >= 1; k >= V keeps all
    top_k: torch.Tensor,
) -> torch.Tensor:
    """Return ``[n]``: the k-th largest logit of each row (``-inf`` where ``k >= V``)."""
    vocab = logits.shape[-1]
    k = top_k.clamp(max=vocab)  # [n]
    width = int(k.max())
    kth = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)  # [n]
    return torch.where(top_k >= vocab, torch.full_like(kth, float("-inf")), kth)


def top_p_threshold(
    # [n, V] float, >= 0: unnormalised probabilities, 0 outside the support
    probs: torch.Tensor,
    # [n] float in (0, 1]
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Return ``[n]`` thresholds ``t`` such that the nucleus is ``probs >= t``.

    The nucleus is the smallest set of most probable tokens whose mass reaches
    ``top_p`` of the row's mass, the crossing token included, and every token
    tied with it: equivalently ``{i : mass(probs > probs[i]) < top_p * total}``.
    Rows with ``top_p == 1`` get ``0``. Does not mutate its inputs.
    """
    n, vocab = probs.shape
    threshold = torch.zeros(n, dtype=probs.dtype, device=probs.device)  # [n]
    target = probs.sum(-1).double() * top_p.double()  # [n]
    pending = (top_p < 1).nonzero().squeeze(1)  # [m]
    width = _FIRST_WINDOW
    while pending.numel():
        width = min(width, vocab)
        vals = probs[pending].topk(width, dim=-1).values  # [m, width], descending
        cdf = vals.to(torch.float64).cumsum(-1)  # [m, width]
        crossing = torch.searchsorted(cdf, target[pending].unsqueeze(1)).squeeze(1)  # [m]
        found = crossing < width
        if width == vocab:  # rounding can leave the total a hair below target: keep all
            found = torch.ones_like(found)
            crossing = crossing.clamp(max=width - 1)
        threshold[pending[found]] = vals[found].gather(1, crossing[found].unsqueeze(1)).squeeze(1)
        pending = pending[~found]
        width *= 4
    return threshold


def apply_top_k_top_p_min_p(
    # [n, V] float32: temperature already applied; not mutated
    logits: torch.Tensor,
    # [n] int64; >= V keeps all
    top_k: torch.Tensor,
    # [n] float in (0, 1]
    top_p: torch.Tensor,
    # [n] float in [0, 1]
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Return a new ``[n, V]`` tensor: ``logits`` where kept, ``-inf`` elsewhere.

    A row that is all ``-inf`` stays all ``-inf``.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if bool((top_k < logits.shape[-1]).any()):
        logits = torch.where(logits >= top_k_threshold(logits, top_k).unsqueeze(1), logits, neg_inf)  # [n, V]
    row_max = logits.amax(-1, keepdim=True)  # [n, 1]
    row_max = torch.where(row_max.isfinite(), row_max, torch.zeros_like(row_max))
    probs = (logits - row_max).exp_()  # [n, V], max 1 per live row
    keep = probs >= top_p_threshold(probs, top_p).unsqueeze(1)  # [n, V]
    keep &= probs >= min_p.unsqueeze(1).to(probs.dtype)  # min-p relative to the max, which is 1
    keep &= logits > float("-inf")
    return torch.where(keep, logits, neg_inf)
