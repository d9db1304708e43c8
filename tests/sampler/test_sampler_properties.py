"""Property tests (hypothesis): masked tokens are never sampled; greedy is the argmax."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from constrain.sampler import SamplingParams, sample

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-5, 0.3, 1.0, 2.5]),
    top_k=st.one_of(st.none(), st.integers(1, 300)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.5, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    presence_penalty=st.floats(-2.0, 2.0),
    logit_bias=st.dictionaries(st.integers(0, 99), st.floats(-100, 100), max_size=3),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)


@settings(max_examples=150, deadline=None)
@given(
    params=st.lists(params_strategy, min_size=1, max_size=6),
    vocab=st.integers(1, 700),
    data=st.data(),
)
def test_masked_tokens_are_never_sampled(params, vocab, data):
    batch = len(params)
    params = [dataclasses.replace(p, logit_bias={t % vocab: b for t, b in p.logit_bias.items()}) for p in params]
    seed = data.draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * data.draw(st.sampled_from([0.1, 3.0, 30.0]))
    allowed = torch.rand(batch, vocab, generator=gen) < data.draw(st.sampled_from([0.01, 0.3, 0.9]))
    words = (vocab + 31) // 32
    bits = torch.zeros(batch, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    bitmask = (bits.view(batch, words, 32) * weights).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    outputs = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=5)) for _ in range(batch)]
    out = sample(logits, params, token_bitmask=bitmask, output_token_ids=outputs)
    for i in range(batch):
        if allowed[i].any():
            assert not out.no_token_allowed[i]
            assert allowed[i, out.token_ids[i]], f"row {i} sampled masked token {int(out.token_ids[i])}"
        else:
            assert out.no_token_allowed[i] and out.token_ids[i] == -1


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 2000),
    batch=st.integers(1, 8),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 1000),
)
def test_greedy_equals_argmax(vocab, batch, scale, seed):
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    out = sample(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.1))
    assert torch.equal(out.token_ids, logits.argmax(-1))
