"""The rejection sampler of speculative decoding (Leviathan et al., https://arxiv.org/abs/2211.17192).

Glossary:

- *draft tokens*: the ``k`` tokens a proposer guessed for one request;
- *accepted tokens*: the longest prefix of drafts that pass the test
  ``u < p(x) / q(x)`` (``p`` the target distribution, ``q`` the draft's);
- *recovered token*: drawn from ``norm(max(0, p - q))`` at the first rejection;
- *bonus token*: drawn from ``p`` after the last draft when all were accepted.

Each step emits ``accepted + 1`` tokens whose distribution equals sampling
from ``p`` one token at a time. Greedy requests accept a draft exactly when it
is the target's argmax and recover with the argmax. N-gram (prompt-lookup)
proposers have no distribution: pass ``draft_probs=None`` and each draft is
treated as a point mass (``q(x) = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.sampling import inverse_cdf_sample
from .params import MAX_SEED
from .rng import Stream, fresh_seeds, row_keys, uniform

__all__ = ["RejectionSamplerOutput", "rejection_sample"]


@dataclass(slots=True)
class RejectionSamplerOutput:
    """The tokens to append for each request."""

    token_ids: torch.Tensor  # [B, K + 1] int64: accepted drafts, then the recovered/bonus token; -1 after
    num_tokens: torch.Tensor  # [B] int64: accepted + 1


def rejection_sample(
    # [B, K] int64: drafts, any value past a row's count
    draft_token_ids: torch.Tensor,
    # [B] int64 in [0, K]
    num_draft_tokens: torch.Tensor,
    # [B, K, V] float or None: the proposer's distributions; None for point-mass (n-gram) drafts
    draft_probs: torch.Tensor | None,
    # [B, K + 1, V] float: the final sampling distribution at each draft position and after the last
    target_probs: torch.Tensor,
    *,
    # [B] bool or None (none greedy)
    greedy: torch.Tensor | None = None,
    # [B] int64 or None (fresh random seeds)
    seeds: torch.Tensor | None = None,
    # [B] int64 or None (zeros): each request's output length; position i uses counter + i
    counters: torch.Tensor | None = None,
) -> RejectionSamplerOutput:
    """Verify drafts against the target in one vectorised pass over the batch.

    Does not mutate its inputs.
    """
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(f"target_probs must be [B, K + 1, V] = [{batch}, {k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [B, K, V] = [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}")
    greedy = torch.zeros(batch, dtype=torch.bool, device=device) if greedy is None else greedy.to(device)
    if seeds is None:
        seeds = torch.tensor(fresh_seeds(batch, MAX_SEED), dtype=torch.int64, device=device)
    counters = torch.zeros(batch, dtype=torch.int64, device=device) if counters is None else counters.to(device)

    positions = torch.arange(k, device=device)  # [K]
    is_draft = positions < num_draft_tokens.unsqueeze(1)  # [B, K]
    drafts = torch.where(is_draft, draft_token_ids, 0)  # [B, K]
    p = target_probs.float()
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    keys = row_keys(seeds.repeat_interleave(k), (counters.unsqueeze(1) + positions).flatten())  # [B * K]
    u = uniform(keys, Stream.ACCEPT).view(batch, k)
    accept = u * q_draft.double() < p_draft.double()  # u < p / q, without dividing by q = 0
    accept_greedy = drafts == p[:, :k].argmax(-1)
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept) & is_draft  # [B, K]
    num_accepted = accept.long().cumprod(1).sum(1)  # [B]

    rows = torch.arange(batch, device=device)
    p_next = p[rows, num_accepted]  # [B, V] the target where the first rejection (or the bonus) happens
    rejected_a_draft = num_accepted < num_draft_tokens  # [B]
    if draft_probs is None:
        at = drafts.gather(1, num_accepted.clamp(max=max(k - 1, 0)).unsqueeze(1)) if k else None
        q_next = torch.zeros_like(p_next)
        if at is not None:
            q_next.scatter_(1, at, 1.0)
    else:
        q_next = draft_probs.float()[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_next)
    q_next = q_next * rejected_a_draft.unsqueeze(1)  # the bonus position draws from p itself
    residual = (p_next - q_next).clamp_(min=0)  # [B, V]
    empty = residual.sum(-1) <= 0  # p == q up to rounding: fall back to p
    residual = torch.where(empty.unsqueeze(1), p_next, residual)
    drawn = inverse_cdf_sample(residual, uniform(row_keys(seeds, counters + num_accepted), Stream.RECOVER))  # [B]
    last = torch.where(greedy, p_next.argmax(-1), drawn)  # [B]

    token_ids = torch.full((batch, k + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :k] = torch.where(positions < num_accepted.unsqueeze(1), drafts, -1)
    token_ids[rows, num_accepted] = last
    return RejectionSamplerOutput(token_ids=token_ids, num_tokens=num_accepted + 1)
