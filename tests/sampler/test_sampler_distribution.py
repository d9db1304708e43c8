"""Statistical tests, fixed seeds: sampled frequencies match the exact target distribution.

Each test draws N tokens (one batch of N rows, row i seeded with i) and runs a
chi-square goodness-of-fit test against the float64 reference distribution,
pooling categories whose expected count is below 5. With fixed seeds the
outcome is deterministic; the threshold 1e-3 leaves room for the seeds chosen
and still rejects any real bias (a wrong top-p boundary or an off-by-one in the
search moves the statistic by orders of magnitude: see the sanity test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

import constrain.sampler.ops.sampling as sampling_ops
from constrain.sampler import SamplingParams, rejection_sample, sample
from constrain.sampler.ops.sampling import inverse_cdf_sample

from reference import target_distribution

N = 20_000
P_MIN = 1e-3


def chi_square_p(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of observed token counts against ``expected_probs`` (pooling rare categories)."""
    vocab = expected_probs.numel()
    observed = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = expected_probs.cpu().double() * tokens.numel()
    assert observed[expected == 0].sum() == 0, "drew a token of probability zero"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue) if len(obs) > 1 else 1.0


def _logits(vocab: int, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


params__distribution = [
    SamplingParams(),  # full path, no filter
    SamplingParams(temperature=0.6, top_p=0.9),  # full path, rejection top-p
    SamplingParams(top_p=0.3),
    SamplingParams(min_p=0.2),
    SamplingParams(top_p=0.8, min_p=0.1),
    SamplingParams(top_k=40),  # window path
    SamplingParams(top_k=100, top_p=0.7, min_p=0.02, temperature=1.4),
    SamplingParams(top_k=60, min_p=0.3),
    SamplingParams(top_k=200, top_p=0.9),  # large k: full path with a threshold
    SamplingParams(
        temperature=0.9,
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={3: 2.0, 4: -50.0},
        top_p=0.95,
    ),
]


@pytest.mark.parametrize("vocab", [600, 256])
@pytest.mark.parametrize("params", params__distribution)
def test_sampled_frequencies_match_target(params, vocab, device):
    row = _logits(vocab)
    output = [3, 3, 9, 17]
    batch = [
        SamplingParams(**{**{f: getattr(params, f) for f in params.__dataclass_fields__}, "seed": i}) for i in range(N)
    ]
    out = sample(row.expand(N, vocab).to(device), batch, output_token_ids=[output] * N)
    assert (out.token_ids >= 0).all()
    expected = target_distribution(row, params, output=output)
    assert chi_square_p(out.token_ids, expected) > P_MIN


@pytest.mark.parametrize(
    "params", [SamplingParams(top_p=0.5), SamplingParams(top_p=0.6, min_p=0.15), SamplingParams(top_p=0.3, min_p=0.02)]
)
def test_rejection_fallback_is_exact(monkeypatch, params):
    monkeypatch.setattr(sampling_ops, "MAX_REJECTION_ROUNDS", 1)  # most rejected rows take the exact threshold
    row = _logits(500, seed=3)
    out = sample(row.expand(N, 500), [dataclasses.replace(params, seed=i) for i in range(N)])
    assert chi_square_p(out.token_ids, target_distribution(row, params)) > P_MIN


def test_the_test_can_fail():
    """Sanity: a slightly wrong distribution (top_p 0.85 vs 0.9) is rejected by the same test."""
    row = _logits(600)
    out = sample(row.expand(N, 600), [SamplingParams(top_p=0.85, seed=i) for i in range(N)])
    assert chi_square_p(out.token_ids, target_distribution(row, SamplingParams(top_p=0.9))) < P_MIN


@pytest.mark.parametrize("vocab", [1, 7, 256, 300, 1000])
def test_inverse_cdf_sample_matches_weights(vocab):
    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(vocab, generator=gen) * (torch.rand(vocab, generator=gen) < 0.6)
    weights[vocab // 2] = 0.5  # at least one positive weight
    u = torch.rand(N, generator=gen, dtype=torch.float64)
    tokens = inverse_cdf_sample(weights.expand(N, vocab), u)
    assert chi_square_p(tokens, weights / weights.sum()) > P_MIN


def _random_distribution(gen: torch.Generator, shape: tuple[int, ...], sparsity: float = 0.3) -> torch.Tensor:
    w = torch.rand(shape, generator=gen) ** 3 * (torch.rand(shape, generator=gen) > sparsity)
    w[..., 0] += 1e-3
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_sampler_output_distribution_equals_target(with_draft_probs, device):
    """Drafts come from an arbitrary q; the emitted token at each position follows p."""
    gen = torch.Generator().manual_seed(7)
    vocab, k = 12, 3
    target = _random_distribution(gen, (k + 1, vocab))  # the same target for every request
    q = _random_distribution(gen, (k, vocab), sparsity=0.5)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(k)], 1)  # [N, K]
    if not with_draft_probs:  # n-gram drafts: a fixed guess per position, q a point mass
        drafts = torch.tensor([2, 5, 0]).expand(N, k)
    out = rejection_sample(
        drafts.to(device),
        torch.full((N,), k, device=device),
        q.expand(N, k, vocab).to(device) if with_draft_probs else None,
        target.expand(N, k + 1, vocab).to(device),
        seeds=torch.arange(N, device=device),
    )
    assert ((out.num_tokens >= 1) & (out.num_tokens <= k + 1)).all()
    for pos in range(k + 1):
        emitted = out.num_tokens > pos
        tokens = out.token_ids[emitted, pos]
        if tokens.numel() > 500:
            assert chi_square_p(tokens, target[pos]) > P_MIN, f"position {pos}"
    accepted_drafts = out.token_ids[:, :k] == drafts.to(device)
    assert (accepted_drafts.long().cumprod(1).sum(1) >= out.num_tokens - 1).all()


def test_rejection_sampler_greedy_accepts_exactly_the_argmax():
    gen = torch.Generator().manual_seed(1)
    vocab, k, batch = 20, 4, 64
    target = _random_distribution(gen, (batch, k + 1, vocab))
    best = target.argmax(-1)  # [B, K + 1]
    drafts = best[:, :k].clone()
    wrong_at = torch.randint(0, k + 1, (batch,), generator=gen)  # k means: all drafts right
    for b in range(batch):
        if wrong_at[b] < k:
            drafts[b, wrong_at[b]] = (best[b, wrong_at[b]] + 1) % vocab
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    out = rejection_sample(drafts, num_draft, None, target, greedy=torch.ones(batch, dtype=torch.bool))
    expected_accepted = torch.minimum(wrong_at, num_draft)
    assert torch.equal(out.num_tokens, expected_accepted + 1)
    for b in range(batch):
        n = int(expected_accepted[b])
        assert out.token_ids[b, : n + 1].tolist() == best[b, : n + 1].tolist()
        assert (out.token_ids[b, n + 1 :] == -1).all()
