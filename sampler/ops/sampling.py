"""Stage 10: drawing a token, without sorting the vocabulary.

Three ops:

- :func:`inverse_cdf_sample` draws from unnormalised weights with one uniform
  per row: block sums, then a search inside one block of 256. One read of the
  weights (float32 block sums, float64 prefix sums), and only ``n`` random numbers.
- :func:`sample_window` serves rows with a small top-k: everything happens on
  the ``topk`` window (softmax, top-p, min-p, the draw).
- :func:`sample_top_p_rejection` serves rows without a small top-k: top-p by
  rejection with a rising pivot (the idea of FlashInfer's sorting-free
  samplers). Draw ``j`` from the support above the pivot; accept it if it lies
  in the nucleus, i.e. ``mass(p > p_j) < top_p * total``; otherwise raise the
  pivot to ``p_j`` and draw again from what is above it. Conditioned on
  acceptance the draw is proportional to ``p`` over the nucleus, so the result
  is exact, and one round usually suffices (a first draw lands in the nucleus
  with probability about ``top_p``).

Tokens are searched in vocabulary order, so a draw depends only on the row's
values and its uniform: the same request gives the same token in any batch.
"""

from __future__ import annotations

import torch

from .topk_topp import top_p_threshold

__all__ = [
    "BOUND_FIRST",
    "MAX_REJECTION_ROUNDS",
    "block_sums",
    "inverse_cdf_sample",
    "sample_top_p_rejection",
    "sample_window",
]

BLOCK = 256
"""Tokens per block of the two-level inverse-CDF search."""

MAX_REJECTION_ROUNDS = 16
"""Rows still rejected after this many rounds take the exact threshold path (the sampler draws
``MAX_REJECTION_ROUNDS + 1`` uniforms per row for :func:`sample_top_p_rejection`)."""

BOUND_FIRST = frozenset({"cpu"})
"""Device types on which a rejection round measures a draw exactly only where a free bound cannot accept
it (:func:`sample_top_p_rejection`): the exact measure costs a pass there, while picking the rows to
measure costs a GPU a wait for the device. The tokens are the same either way."""


def _below(
    # [n] float64, >= 0
    total: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` the float64 just below ``total`` (just below 0 for 0): a target clamped to it lands on a positive
    weight. A search for ``t < cdf[-1]`` stops at the first ``i`` with ``cdf[i] > t >= cdf[i - 1]``, a
    positive weight; only rounding (``u * total == total``) could take it past the last one."""
    return torch.nextafter(total, torch.full_like(total, float("-inf")))


def _search(
    # [n, w] float, >= 0
    weights: torch.Tensor,
    # [n] float64, in [0, weights.sum(-1)]
    target: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` first index whose inclusive float64 cumulative sum exceeds ``target``.

    A target at or past the total (rounding) is taken just below it: the index is that of a positive
    weight (0 for a row of zeros), never past the last one.
    """
    cdf = weights.to(torch.float64).cumsum(-1)  # [n, w]
    target = torch.minimum(target, _below(cdf[:, -1]))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def block_sums(
    # [n, V] float, >= 0
    weights: torch.Tensor,
) -> torch.Tensor:
    """``[n, ceil(V / BLOCK)]`` float64 sums of consecutive blocks of ``BLOCK`` tokens.

    Summed in the weights' dtype, then widened (widening first would copy the
    whole tensor).
    """
    n, vocab = weights.shape
    full = vocab // BLOCK
    parts = []
    if full:
        parts.append(weights[:, : full * BLOCK].reshape(n, full, BLOCK).sum(-1))  # a view
    if vocab % BLOCK:
        parts.append(weights[:, full * BLOCK :].sum(-1, keepdim=True))
    return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).double()


def inverse_cdf_sample(
    # [n, V] float, >= 0, unnormalised; not mutated
    weights: torch.Tensor,
    # [n] float64 in [0, 1)
    u: torch.Tensor,
    # [n, ceil(V / BLOCK)] float64 or None: block_sums(weights), if already known
    block_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``[n]`` int64 token ids drawn with probability proportional to ``weights``.

    A row whose weights are all zero returns an arbitrary id; callers detect such rows.
    """
    vocab = weights.shape[1]
    if block_mass is None:
        block_mass = block_sums(weights)  # [n, num_blocks]
    cdf = block_mass.cumsum(-1)  # [n, num_blocks]
    target = torch.minimum(u * cdf[:, -1], _below(cdf[:, -1]))  # [n]
    block = torch.searchsorted(cdf, target.unsqueeze(1), right=True).clamp_(max=cdf.shape[1] - 1)  # [n, 1]
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_(min=0)), 0.0).squeeze(1)  # [n] mass ahead
    block = block.squeeze(1)
    offsets = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=weights.device)  # [n, BLOCK]
    if vocab % BLOCK:  # a last, shorter block: ids past the vocabulary weigh 0
        local = weights.gather(1, offsets.clamp(max=vocab - 1)) * (offsets < vocab)  # [n, BLOCK]
    else:
        local = weights.gather(1, offsets)  # [n, BLOCK]
    return block * BLOCK + _search(local, (target - before).clamp(min=0))


def sample_window(
    # [n, w] float32: temperature-scaled logits of the topk window, descending; -inf past each row's k
    values: torch.Tensor,
    # [n, w] int64: their token ids
    token_ids: torch.Tensor,
    # [n] float32 in (0, 1]
    top_p: torch.Tensor,
    # [n] float32 in [0, 1]
    min_p: torch.Tensor,
    # [n] float64 in [0, 1)
    u: torch.Tensor,
) -> torch.Tensor:
    """Top-p and min-p inside a top-k window, then a draw. Returns ``[n]`` int64 ids.

    Rows must have a finite first value. Does not mutate its inputs.
    """
    probs = torch.softmax(values, dim=-1)  # [n, w], descending
    before = probs.cumsum(-1) - probs  # [n, w] mass strictly ahead in sorted order
    last = (before < top_p.unsqueeze(1)).sum(-1, keepdim=True) - 1  # [n, 1] crossing position
    keep = values >= values.gather(1, last)  # ties with the crossing token stay
    keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    order = token_ids.argsort(-1)  # [n, w] vocabulary order: batch-invariant draws
    weights = (probs * keep).gather(1, order)  # [n, w]
    pos = _search(weights, u * weights.sum(-1, dtype=torch.float64))  # [n]
    return token_ids.gather(1, order).gather(1, pos.unsqueeze(1)).squeeze(1)


def _mass_above_inplace(
    # [n, V] float32, >= 0; overwritten
    probs: torch.Tensor,
    # [n] float32
    pivot: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` float64 ``sum(probs[probs > pivot])``, as relu-sum + pivot x count (no bool tensors).

    Destroys ``probs``: pass a copy.
    """
    excess = probs.sub_(pivot.unsqueeze(1)).clamp_(min=0)  # [n, V]
    total = excess.sum(-1).double()
    count = excess.sign_().sum(-1).double()
    return total + pivot.to(torch.float64) * count


def _above(
    # [n, V] float32, >= 0
    probs: torch.Tensor,
    # [n] float32: keep probs strictly above
    pivot: torch.Tensor,
    # [n, V] float32 scratch, overwritten and returned
    scratch: torch.Tensor,
) -> torch.Tensor:
    """``probs * (probs > pivot)`` written into ``scratch``."""
    return torch.sub(probs, pivot.unsqueeze(1), out=scratch).sign_().clamp_(min=0).mul_(probs)


def sample_top_p_rejection(
    # [n, V] float32, >= 0: probabilities (normalised or not); 0 for tokens filtered out (top-k, min-p). Not mutated.
    probs: torch.Tensor,
    # [n] float32 in (0, 1]
    top_p: torch.Tensor,
    # [n, rounds + 1] float64 in [0, 1): column r is round r's uniform (rng.uniforms from Stream.SAMPLE)
    u: torch.Tensor,
    # [>= 2n, V] float32 or None: scratch space, overwritten (allocated if None)
    scratch: torch.Tensor | None = None,
    # [t] float64 or None, t <= n: the mass top-p is a share of, for the first t rows (min-p filtered rows:
    # before filtering); the other rows' is their probs' sum
    total: torch.Tensor | None = None,
    *,
    any_top_p: bool | None = None,
) -> torch.Tensor:
    """Return ``[n]`` int64 ids drawn from ``probs`` within the top-p nucleus.

    The nucleus is ``{i : mass(p > p_i) < top_p * total}``. Where ``probs`` is an upper set of a
    larger distribution of mass ``total`` (min-p), the draw is from the intersection of that set
    with the larger distribution's nucleus: the mass above a kept token is the same in both.

    A row of zeros (no token allowed) gets an arbitrary id: callers flag such rows. ``any_top_p``:
    whether some row has ``top_p < 1``, when the caller knows it (None: read from ``top_p``, which on
    a GPU waits for it). Round ``r`` draws with ``u[:, r]``; rows still refused after ``rounds`` rounds
    take the exact threshold (with ``u[:, rounds]``). Later rounds copy their rows into the second half of
    ``scratch`` (a reused buffer: fresh pages cost as much as a pass).

    On a CPU a draw is measured exactly only where a free bound (block masses) cannot accept it: the
    exact measure costs a pass. Elsewhere (a GPU) every drawn row is measured, so that a round costs
    one wait for the device (which rows go on) instead of three.
    """
    n = probs.shape[0]
    device = probs.device
    if scratch is None:
        scratch = torch.empty(2 * n, probs.shape[1], dtype=probs.dtype, device=device)
    work, subset = scratch[:n], scratch[n : 2 * n]  # [n, V] each
    rounds = u.shape[1] - 1
    first_blocks = block_sums(probs)  # [n, num_blocks]
    target = first_blocks.sum(-1)  # [n] the mass top-p is a share of
    if total is not None:
        target[: total.numel()] = total
    target *= top_p.double()  # [n] nucleus mass
    tested = (top_p < 1) & (target > 0)  # [n] rows whose draw may be refused
    tokens = inverse_cdf_sample(probs, u[:, 0], first_blocks)  # [n] round 0
    if not (any_top_p if any_top_p is not None else bool((top_p < 1).any())):
        return tokens
    bound_first = device.type in BOUND_FIRST
    pivot = torch.full((n,), -1.0, dtype=probs.dtype, device=device)  # [n]: draw from probs above it
    rows = torch.arange(n, device=device)  # rows still drawing, as indices into the batch
    rows_probs, mass, drawn = probs, first_blocks, tokens  # [m, V], [m, num_blocks], [m]
    for round_ in range(1, rounds + 1):
        m = rows.numel()
        checked = tested[rows]  # [m]
        drawn_prob = rows_probs.gather(1, drawn.unsqueeze(1)).squeeze(1)  # [m]
        if bound_first:
            # Free bound first: a token above drawn_prob makes its block's mass exceed drawn_prob, so all
            # the mass above it lies in such blocks (and above the pivot too, so `weights` held it all).
            upper = torch.where(mass > drawn_prob.unsqueeze(1).double(), mass, 0.0).sum(-1)  # [m]
            unsure = (checked & (upper >= target[rows])).nonzero().squeeze(1)  # [x]
            rejected = torch.zeros_like(checked)
            if unsure.numel():  # measure those exactly, on a copy
                copy = torch.index_select(rows_probs, 0, unsure, out=work[: unsure.numel()])
                rejected[unsure] = _mass_above_inplace(copy, drawn_prob[unsure]) >= target[rows[unsure]]
        else:
            above = _mass_above_inplace(work[:m].copy_(rows_probs), drawn_prob)  # [m]
            rejected = checked & (above >= target[rows])
        again = rejected.nonzero().squeeze(1)  # [r]
        if not again.numel():
            return tokens
        rows, pivot = rows[again], torch.maximum(pivot[again], drawn_prob[again])
        rows_probs = torch.index_select(probs, 0, rows, out=subset[: rows.numel()])
        if round_ == rounds:
            break
        weights = _above(rows_probs, pivot, work[: rows.numel()])
        mass = block_sums(weights)
        drawn = inverse_cdf_sample(weights, u[rows, round_], mass)  # [m]
        tokens[rows] = drawn
    # Rare: fall back to the exact nucleus threshold for the rows still drawing.
    share = (target[rows] / rows_probs.sum(-1, dtype=torch.float64)).clamp(max=1.0)  # [m] of what probs hold
    floor = top_p_threshold(rows_probs, share)  # [m]
    weights = _above(rows_probs, torch.nextafter(floor, torch.zeros_like(floor)), work[: rows.numel()])
    tokens[rows] = inverse_cdf_sample(weights, u[rows, rounds])
    return tokens
