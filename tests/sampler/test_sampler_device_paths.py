"""What the sampler does to spare a GPU its waits changes no token: the rejection rounds' GPU branch (every
draw measured exactly) against the CPU's (a free bound first), the host's row facts against reading them
from the tensors, and the step's uniforms drawn at once against one stream at a time. Runs on the CPU."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from constrain.sampler import Sampler, SamplingMetadata, SamplingParams
from constrain.sampler.ops import sampling as sampling_ops
from constrain.sampler.rng import row_keys, uniform, uniforms


def _batches(count: int, seed: int):
    """Random batches: mixed parameters (greedy, window top-k, large top-k, top-p, min-p, penalties,
    logprobs), ties at the k-th logit, bitmasks with a dead row."""
    rng = random.Random(seed)
    for case in range(count):
        vocab = rng.choice([7, 256, 300, 1000, 5000])
        batch = rng.choice([1, 3, 16])
        params = []
        for _ in range(batch):
            if rng.random() < 0.15:
                params.append(SamplingParams(temperature=0.0))
                continue
            kw: dict[str, object] = {"seed": rng.randrange(10**6), "temperature": rng.choice([0.5, 1.0, 1.5])}
            if rng.random() < 0.5:
                kw["top_k"] = rng.choice([1, 2, 5, 50, 200, 2000])
            if rng.random() < 0.6:
                kw["top_p"] = rng.choice([0.1, 0.5, 0.9, 0.99])
            if rng.random() < 0.3:
                kw["min_p"] = rng.choice([0.01, 0.2])
            if rng.random() < 0.2:
                kw["repetition_penalty"] = 1.3
            if rng.random() < 0.2:
                kw["logprobs"] = 2
            params.append(SamplingParams(**kw))  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(seed * 1000 + case)
        logits = torch.randn(batch, vocab, generator=gen) * rng.choice([0.3, 3.0, 10.0])
        if rng.random() < 0.3:
            logits = (logits * 2).round() / 2  # ties, at the k-th logit too
        mask = None
        if rng.random() < 0.4:
            allowed = torch.rand(batch, vocab, generator=gen) < rng.choice([0.01, 0.5])
            if rng.random() < 0.5:
                allowed[0] = False  # a row with no token allowed
            words = (vocab + 31) // 32
            bits = torch.zeros(batch, words * 32, dtype=torch.bool)
            bits[:, :vocab] = allowed
            packed = (bits.view(batch, words, 32).long() << torch.arange(32)).sum(-1)
            mask = torch.where(packed < 2**31, packed, packed - 2**32).to(torch.int32)
        outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(5))] for _ in range(batch)]
        yield params, logits, mask, outputs


def _run(params, logits, mask, outputs, *, facts: bool = True) -> tuple[list[int], list[float] | None]:
    md = SamplingMetadata.build(
        params, vocab_size=logits.shape[1], device="cpu", output_token_ids=outputs, token_bitmask=mask
    )
    if not facts:
        md = dataclasses.replace(md, facts=None)
    out = Sampler()(logits, md, inplace=False)
    logprobs = out.logprobs.sampled.nan_to_num(-99.0).tolist() if out.logprobs is not None else None
    return out.token_ids.tolist(), logprobs


def test_the_gpu_branch_of_the_rejection_rounds_draws_the_cpus_tokens(monkeypatch):
    batches = list(_batches(150, seed=1))
    cpu = [_run(*b) for b in batches]
    monkeypatch.setattr(sampling_ops, "BOUND_FIRST", frozenset())  # every draw measured, as on a GPU
    measured = [_run(*b) for b in batches]
    assert measured == cpu
    refused = sum(t == -1 for tokens, _ in cpu for t in tokens)
    assert refused  # the batches hold rows with no token allowed, flagged on both branches


def test_row_facts_known_on_the_host_change_no_token():
    for params, logits, mask, outputs in _batches(150, seed=2):
        assert _run(params, logits, mask, outputs) == _run(params, logits, mask, outputs, facts=False)


def test_row_facts_count_what_the_tensors_hold():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=40),
        SamplingParams(top_k=120, top_p=0.9),
        SamplingParams(top_k=500),
        SamplingParams(min_p=1e-50),  # 0 in float32: not a min-p row
        SamplingParams(min_p=0.05, top_p=0.5),
    ]
    md = SamplingMetadata.build(params, vocab_size=1000, device="cpu")
    assert md.facts is not None
    full = md.full_rows
    assert md.facts.window_k_max == int(md.top_k[md.window_rows].max()) == 120
    assert md.facts.full_top_k == bool((md.top_k[full] < 1000).any()) is True
    assert md.facts.full_min_p == int((md.min_p[full] > 0).sum()) == 1
    assert md.facts.full_top_p == bool((md.top_p[full] < 1).any()) is True


def test_uniforms_are_uniform_stream_by_stream():
    keys = row_keys(torch.randint(0, 2**62, (40,)), torch.randint(0, 2**32, (40,)))
    for first in (0, 0x5A3C_0001, 2**32 - 3):  # the last wraps past 32 bits, as uniform's stream does
        together = uniforms(keys, first, 6)
        assert together.shape == (40, 6)
        for j in range(6):
            assert torch.equal(together[:, j], uniform(keys, first + j))


@pytest.mark.parametrize("rounds", [1, 3])
def test_fewer_rejection_rounds_still_fill_every_row(monkeypatch, rounds):
    monkeypatch.setattr(sampling_ops, "MAX_REJECTION_ROUNDS", rounds)  # the exact threshold takes the rest
    for params, logits, mask, outputs in _batches(40, seed=3):
        tokens, _ = _run(params, logits, mask, outputs)
        allowed = torch.ones_like(logits, dtype=torch.bool)
        if mask is not None:
            bits = (mask.long().unsqueeze(-1) >> torch.arange(32)) & 1  # [B, W, 32]
            allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
        for row, token in enumerate(tokens):
            assert token == -1 if not allowed[row].any() else bool(allowed[row, token])
