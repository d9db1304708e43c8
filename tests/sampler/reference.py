"""A straightforward float64 reference of the sampling pipeline, one row at a time.

Written for obviousness, not speed: full sorts, Python loops, no shortcuts.
"""

from __future__ import annotations

import math

import torch

from constrain.sampler import SamplingParams


def allowed_from_bitmask(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[V]`` bool from one int32 bitmask row, bit by bit."""
    words = bitmask_row.tolist()
    return torch.tensor([(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)])


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt: list[int] = (),
    output: list[int] = (),
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stages 2-4 on one row, in float64."""
    z = logits.double().clone()
    if allowed is not None:
        z[~allowed] = -math.inf
    for t, b in params.logit_bias.items():
        z[t] += b
    for t in set(prompt) | set(output):
        r = params.repetition_penalty
        z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t in set(output):
        z[t] -= params.presence_penalty
    for t in output:
        z[t] -= params.frequency_penalty
    return z


def filtered_logits(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Stages 6-9 on one row of processed logits: temperature, top-k, top-p, min-p (float64)."""
    vocab = z.numel()
    z = z / params.temperature
    if params.top_k is not None and params.top_k < vocab:
        kth = torch.sort(z, descending=True).values[params.top_k - 1]
        z = torch.where(z >= kth, z, -math.inf)
    probs = torch.softmax(z, -1)
    if params.top_p < 1:
        sorted_probs = torch.sort(probs, descending=True).values
        cum = torch.cumsum(sorted_probs, 0)
        crossing = int((cum < params.top_p).sum())  # first index whose cumulative mass reaches p
        threshold = sorted_probs[min(crossing, vocab - 1)]
        z = torch.where(probs >= threshold, z, -math.inf)
    if params.min_p > 0:
        z = torch.where(probs >= params.min_p * probs.max(), z, -math.inf)
    return z


def target_distribution(logits: torch.Tensor, params: SamplingParams, **kwargs) -> torch.Tensor:
    """``[V]`` float64: the distribution the sampler must draw from for one row."""
    z = processed_logits(logits, params, **kwargs)
    if params.greedy:
        out = torch.zeros_like(z)
        out[int(torch.argmax(z))] = 1.0
        return out
    return torch.softmax(filtered_logits(z, params), -1)
