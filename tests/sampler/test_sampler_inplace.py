"""``sample()`` leaves the caller's logits unchanged unless told ``inplace=True``, and the results agree."""

from __future__ import annotations

import pytest
import torch

from constrain.sampler import Sampler, SamplingMetadata, SamplingParams, sample

VOCAB = 1000

config__params__masked = [
    ("common: temperature + top-p, the in-place full path", SamplingParams(temperature=0.7, top_p=0.9, seed=1), False),
    ("greedy", SamplingParams(temperature=0.0), False),
    ("bitmask", SamplingParams(top_k=20, seed=2), True),
    ("bias", SamplingParams(logit_bias={3: 50.0}, seed=3), False),
    ("penalties", SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, seed=4), False),
    ("bitmask + penalties + min-p", SamplingParams(min_p=0.1, presence_penalty=1.0, seed=5), True),
    ("logprobs", SamplingParams(logprobs=3, seed=6), False),
]


@pytest.mark.parametrize(("config", "params", "masked"), config__params__masked)
def test_sample_leaves_the_logits_alone_unless_inplace(config, params, masked, device):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, VOCAB, generator=gen) * 3).to(device)  # [4, V]
    history = torch.randint(0, VOCAB, (4, 30), generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (VOCAB + 31) // 32), generator=gen, dtype=torch.int32)
    kwargs = {"prompt_token_ids": history, "output_token_ids": history[:, :10]}
    if masked:
        kwargs["token_bitmask"] = bitmask.to(device)
    before = logits.clone()
    out = sample(logits, params, **kwargs)
    assert torch.equal(logits, before), config
    spent = sample(logits, params, inplace=True, **kwargs)
    assert torch.equal(out.token_ids, spent.token_ids)
    if out.logprobs is not None:
        assert spent.logprobs is not None
        assert torch.equal(out.logprobs.top_logprobs, spent.logprobs.top_logprobs)
    if masked or params.logit_bias or params.has_penalties or config.startswith("common"):
        assert not torch.equal(logits, before), f"{config}: the in-place call writes into the logits"


def test_sampler_without_inplace_leaves_bitmasked_rows_alone(device):
    """A bitmask for some rows only (``bitmask_rows``): the masked logits go to a copy."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, VOCAB, generator=gen) * 3).to(device)  # [3, V]
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 0b100  # row 1 may only take token 2
    params = [SamplingParams(seed=i) for i in range(3)]
    md = SamplingMetadata.build(params, vocab_size=VOCAB, device=device, token_bitmask=bitmask, bitmask_rows=[1])
    before = logits.clone()
    out = Sampler()(logits, md, inplace=False)
    assert torch.equal(logits, before)
    assert out.token_ids[1] == 2
    assert torch.equal(out.token_ids, Sampler()(logits.clone(), md).token_ids)


def test_sample_takes_inference_tensors_outside_inference_mode():
    """Logits made under ``torch.inference_mode()`` cannot be written outside it: the default copies where
    the pipeline writes."""
    with torch.inference_mode():
        logits = torch.randn(2, VOCAB)  # [2, V], an inference tensor
    out = sample(logits, SamplingParams(logit_bias={7: 100.0}, repetition_penalty=1.5), prompt_token_ids=[[1], [2]])
    assert out.token_ids.tolist() == [7, 7]


def test_sample_with_a_kept_sampler_gives_what_a_fresh_one_gives():
    gen = torch.Generator().manual_seed(2)
    kept = Sampler()
    for batch in (4, 2, 4):  # its buffers grow and shrink between calls
        logits = torch.randn(batch, VOCAB, generator=gen) * 3  # [B, V]
        params = [SamplingParams(seed=i, top_p=0.9, min_p=0.01 * i, logprobs=2) for i in range(batch)]
        mine, fresh = sample(logits, params, sampler=kept), sample(logits, params)
        assert torch.equal(mine.token_ids, fresh.token_ids)
        assert mine.logprobs is not None and fresh.logprobs is not None
        assert torch.equal(mine.logprobs.top_logprobs, fresh.logprobs.top_logprobs)
