"""Beam search step against brute force."""

from __future__ import annotations

import math

import pytest
import torch

from constrain.sampler import beam_search_step


def test_step_matches_brute_force(device):
    gen = torch.Generator().manual_seed(0)
    batch, width, vocab, beam_width = 3, 4, 50, 4
    logits = torch.randn(batch, width, vocab, generator=gen)
    scores = torch.randn(batch, width, generator=gen)
    scores[1, 2:] = -math.inf  # unused beams
    out = beam_search_step(logits.to(device), scores.to(device), beam_width)
    logprobs = torch.log_softmax(logits.double(), -1)
    for b in range(batch):
        cands = sorted(
            ((float(scores[b, w]) + float(logprobs[b, w, t]), w, t) for w in range(width) for t in range(vocab)),
            reverse=True,
        )[:beam_width]
        assert out.beam_indices[b].tolist() == [w for _, w, _ in cands]
        assert out.token_ids[b].tolist() == [t for _, _, t in cands]
        torch.testing.assert_close(
            out.scores[b].cpu().double(), torch.tensor([s for s, _, _ in cands], dtype=torch.float64)
        )


def test_first_step_and_bitmask():
    logits = torch.randn(1, 1, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b10110  # tokens 1, 2, 4
    out = beam_search_step(logits, torch.zeros(1, 1), 3, token_bitmask=bitmask)
    assert sorted(out.token_ids[0].tolist()) == [1, 2, 4]
    torch.testing.assert_close(out.scores[0].exp().sum(), torch.tensor(1.0))  # renormalised over the allowed
    assert out.beam_indices.tolist() == [[0, 0, 0]]
    more = beam_search_step(logits, torch.zeros(1, 1), 5, token_bitmask=bitmask)
    assert more.scores[0, 3:].tolist() == [-math.inf, -math.inf]


def test_bad_arguments():
    with pytest.raises(ValueError, match="beam_width"):
        beam_search_step(torch.zeros(1, 1, 3), torch.zeros(1, 1), 4)
    with pytest.raises(ValueError, match=r"\[batch, beams, vocab\]"):
        beam_search_step(torch.zeros(1, 3), torch.zeros(1, 1), 1)
