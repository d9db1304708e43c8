"""Seeded requests are reproducible in any batch, at any row; the counter-based generator is uniform."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from constrain.sampler import Sampler, SamplingMetadata, SamplingParams, sample
from constrain.sampler.rng import row_keys, uniform

VOCAB = 5000

seeded__params = [
    SamplingParams(seed=1234),
    SamplingParams(seed=1234, top_k=30, top_p=0.8),
    SamplingParams(seed=99, top_p=0.6, min_p=0.05, temperature=0.8),
    SamplingParams(seed=7, top_k=500, repetition_penalty=1.3, frequency_penalty=0.5),
]

others = [
    SamplingParams(),
    SamplingParams(temperature=0),
    SamplingParams(top_k=5),
    SamplingParams(top_k=120, top_p=0.5),
    SamplingParams(top_p=0.3, presence_penalty=1.0),
    SamplingParams(min_p=0.5, logit_bias={1: 5.0}),
]


@pytest.mark.parametrize("params", seeded__params)
def test_same_tokens_alone_or_at_any_row_of_any_batch(params, device):
    gen = torch.Generator().manual_seed(0)
    steps = 6
    rows = torch.randn(steps, VOCAB, generator=gen) * 3  # one logits row per step
    noise = torch.randn(steps, 16, VOCAB, generator=gen) * 3  # other requests' logits

    def run(batch_size: int, position: int) -> list[int]:
        output: list[int] = []
        for step in range(steps):
            logits = noise[step, :batch_size].clone()
            logits[position] = rows[step]
            batch = [others[(i + batch_size) % len(others)] for i in range(batch_size)]
            batch[position] = params
            outputs = [[(i * 13 + 1) % VOCAB] for i in range(batch_size)]
            outputs[position] = list(output)
            token = sample(logits.to(device), batch, output_token_ids=outputs).token_ids[position]
            output.append(int(token))
        return output

    alone = run(1, 0)
    for batch_size, position in [(2, 1), (7, 3), (16, 0), (16, 15)]:
        assert run(batch_size, position) == alone, f"batch {batch_size}, row {position}"


def test_unseeded_rows_differ_between_calls_and_follow_the_generator():
    logits = torch.zeros(64, VOCAB)
    a = sample(logits, SamplingParams()).token_ids
    b = sample(logits, SamplingParams()).token_ids
    assert not torch.equal(a, b)
    md = lambda: SamplingMetadata.build(
        [SamplingParams()] * 64, vocab_size=VOCAB, device="cpu", generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(Sampler()(logits, md()).token_ids, Sampler()(logits, md()).token_ids)


def test_seed_and_counter_change_the_draw():
    logits = torch.zeros(1, VOCAB)
    by_seed = {int(sample(logits, SamplingParams(seed=s)).token_ids[0]) for s in range(50)}
    by_step = {int(sample(logits, SamplingParams(seed=1), output_token_ids=[[0] * n]).token_ids[0]) for n in range(50)}
    assert len(by_seed) > 45 and len(by_step) > 45


def test_counter_based_uniforms_are_uniform_and_independent():
    n = 200_000
    seeds = torch.arange(n)
    for counters, stream in [(torch.zeros(n, dtype=torch.long), 1), (torch.full((n,), 3), 2)]:
        u = uniform(row_keys(seeds, counters), stream)
        assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
        counts = torch.bincount((u * 100).long(), minlength=100).double()
        assert chisquare(counts.numpy()).pvalue > 1e-3
    u0 = uniform(row_keys(seeds, torch.zeros(n, dtype=torch.long)), 1)
    u1 = uniform(row_keys(seeds, torch.ones(n, dtype=torch.long)), 1)
    joint = torch.bincount((u0 * 10).long() * 10 + (u1 * 10).long(), minlength=100).double()
    assert chisquare(joint.numpy()).pvalue > 1e-3  # consecutive counters are independent
    assert abs(float(torch.corrcoef(torch.stack([u0, uniform(row_keys(seeds, seeds * 0), 2)]))[0, 1])) < 0.01
    big = torch.tensor([2**63 - 1, 2**62, 0])
    keys = row_keys(big, torch.zeros(3, dtype=torch.long))
    assert torch.equal(uniform(keys, 0), uniform(keys.clone(), 0))
    assert len(set(keys.tolist())) == 3


def test_output_lengths_place_seeded_rows_as_output_ids_do(device):
    """Without penalties a caller may pass each row's output length instead of its ids: same stream positions."""
    params = [SamplingParams(seed=5), SamplingParams(seed=5, top_k=40), SamplingParams(seed=8, top_p=0.7)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1), device="cpu").to(device) * 3
    ids = [[1, 2, 3], [], [4] * 11]

    def tokens(**history) -> list[int]:
        metadata = SamplingMetadata.build(params, vocab_size=VOCAB, device=device, **history)
        return Sampler()(logits.clone(), metadata).token_ids.tolist()

    by_ids = tokens(output_token_ids=ids)
    assert tokens(output_lengths=[len(r) for r in ids]) == by_ids
    assert tokens(output_lengths=[0, 1, 2]) != by_ids  # the positions do matter
    with pytest.raises(ValueError, match="not both"):
        tokens(output_token_ids=ids, output_lengths=[3, 0, 11])
    with pytest.raises(ValueError, match="rows for a batch"):
        tokens(output_lengths=[3, 0])


def test_unseeded_rows_leave_torchs_global_random_state_alone():
    """Rows without a seed draw their keys from the OS's entropy: the caller's ``torch.manual_seed`` neither
    fixes them nor is advanced by them (sample() and the rejection sampler alike)."""
    from constrain.sampler import rejection_sample

    logits = torch.zeros(64, VOCAB)  # [64, V]: uniform, so every draw is a fresh key's
    drafts = torch.zeros(4, 2, dtype=torch.int64)  # [B, K]
    target = torch.full((4, 3, VOCAB), 1.0 / VOCAB)  # [B, K + 1, V]
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = sample(logits, SamplingParams()).token_ids.tolist()
    rejection_sample(drafts, torch.full((4,), 2), None, target)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    again = sample(logits, SamplingParams()).token_ids.tolist()
    assert first != again  # 64 uniform draws over 5,000 tokens: equal with probability 5000**-64
