"""Each stage against the float64 reference in ``reference.py``, on random logits and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar as xgr

from constrain.sampler import Sampler, SamplingMetadata, SamplingParams, apply_token_bitmask_inplace, sample
from constrain.sampler.ops.bitmask import apply_token_bitmask
from constrain.sampler.ops.blocks import block_argmax, block_max, block_topk
from constrain.sampler.ops.topk_topp import apply_top_k_top_p_min_p

from reference import allowed_from_bitmask, filtered_logits, target_distribution

VOCAB = 1000

params__filters = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=7),
    SamplingParams(top_k=VOCAB),  # k >= V keeps all
    SamplingParams(top_k=VOCAB + 5),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(top_p=1.0),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=1.0),  # only the maximum survives
    SamplingParams(top_k=50, top_p=0.8, min_p=0.05, temperature=1.3),
    SamplingParams(top_k=300, top_p=0.95),
    SamplingParams(temperature=1e-5, top_p=0.9),
    SamplingParams(temperature=1e-5),
]


def _row_logits(seed: int, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("params", params__filters)
def test_filters_match_reference(params):
    for seed in range(5):
        row = _row_logits(seed)
        row[seed * 7 : seed * 7 + 30] = -math.inf  # some rows hold -inf
        expected = filtered_logits(row.double(), params)
        scaled = (row / params.temperature).unsqueeze(0)
        got = apply_top_k_top_p_min_p(
            scaled,
            torch.tensor([min(params.top_k or VOCAB, VOCAB)]),
            torch.tensor([params.top_p]),
            torch.tensor([params.min_p]),
        )[0]
        assert torch.equal(got.isfinite(), expected.isfinite()), f"kept sets differ (seed {seed})"
        torch.testing.assert_close(torch.softmax(got.double(), -1), torch.softmax(expected, -1), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("params", params__filters)
def test_processed_logprobs_match_reference(params):
    params = SamplingParams(**{**_fields(params), "logprobs": 5})
    logits = torch.stack([_row_logits(s) for s in range(4)])
    md = SamplingMetadata.build([params] * 4, vocab_size=VOCAB, device="cpu")
    out = Sampler()(logits.clone(), md)
    for i in range(4):
        expected = torch.log_softmax(filtered_logits(logits[i].double(), params), -1)
        assert out.token_ids[i] >= 0 and expected[out.token_ids[i]] > -math.inf, "sampled outside the support"
        torch.testing.assert_close(out.logprobs.sampled[i].double(), expected[out.token_ids[i]], atol=1e-4, rtol=1e-4)
        top = torch.sort(expected, descending=True).values[:5]
        finite = top.isfinite()
        torch.testing.assert_close(out.logprobs.top_logprobs[i][finite].double(), top[finite], atol=1e-4, rtol=1e-4)


def test_raw_logprobs_are_the_models_distribution():
    logits = torch.stack([_row_logits(s) for s in range(3)])
    params = SamplingParams(top_k=3, temperature=0.5, logprobs=2, logprobs_mode="raw", repetition_penalty=1.5)
    out = Sampler()(
        logits.clone(),
        SamplingMetadata.build([params] * 3, vocab_size=VOCAB, device="cpu", output_token_ids=[[1, 2]] * 3),
    )
    expected = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.sampled.double(), expected.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.logprobs.top_logprobs.double(), expected.topk(2).values)


def test_logprobs_only_for_rows_that_ask():
    logits = torch.stack([_row_logits(s) for s in range(3)])
    params = [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=0, logprobs=0)]
    out = Sampler()(logits.clone(), SamplingMetadata.build(params, vocab_size=VOCAB, device="cpu"))
    assert out.logprobs.top_logprobs.shape == (3, 0)
    assert not math.isnan(out.logprobs.sampled[0]) and math.isnan(out.logprobs.sampled[1])
    # greedy rows report the distribution after stages 2-4: the log-softmax of the logits
    torch.testing.assert_close(out.logprobs.sampled[2], torch.log_softmax(logits[2], -1).max())


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


params__penalties = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4, logit_bias={5: 3.0, 9: -100.0}),
]


@pytest.mark.parametrize("params", params__penalties)
def test_bias_and_penalties_match_reference(params, device):
    batch = 4
    logits = torch.stack([_row_logits(s) for s in range(batch)]).to(device)
    prompts = [[1, 2, 3], [], [4, 4, 10], [7]]
    outputs = [[3, 3, 3, 5], [8], [], [7, 9, 9]]
    md = SamplingMetadata.build(
        [params] * batch, vocab_size=VOCAB, device=device, prompt_token_ids=prompts, output_token_ids=outputs
    )
    probs = Sampler().probs(logits.clone(), md)  # stage 2-4 then temperature 1: the softmax
    for i in range(batch):
        expected = target_distribution(logits[i].cpu(), params, prompt=prompts[i], output=outputs[i])
        torch.testing.assert_close(probs[i].cpu().double(), expected, atol=1e-6, rtol=1e-4)


def test_penalties_leave_other_rows_untouched():
    logits = torch.stack([_row_logits(s) for s in range(2)])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), SamplingParams(temperature=0)]
    md = SamplingMetadata.build(params, vocab_size=VOCAB, device="cpu", output_token_ids=[[1, 2], [1, 2]])
    work = logits.clone()
    Sampler()(work, md)  # stages 2-4 act in place on float32 input
    assert torch.equal(work[1], logits[1])
    assert not torch.equal(work[0, [1, 2]], logits[0, [1, 2]])
    assert torch.equal(work[0, 3:], logits[0, 3:])


@pytest.mark.parametrize("kernel", ["auto", "lut", "shifts"])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
def test_bitmask_matches_bit_loop_and_xgrammar(vocab, kernel, device):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    ours = logits.clone().to(device)
    copied = apply_token_bitmask(logits.to(device), bitmask.to(device), kernel=kernel)
    apply_token_bitmask_inplace(ours, bitmask.to(device), kernel=kernel)
    assert torch.equal(copied, ours)
    if vocab > 1:  # xgrammar 0.2.8 masks allowed tokens of a 1-token vocabulary; the bit loop is the arbiter
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask)
        torch.testing.assert_close(ours.cpu(), theirs)
    for i in range(3):
        allowed = allowed_from_bitmask(bitmask[i], vocab)
        expected = torch.where(allowed, logits[i], -math.inf)
        torch.testing.assert_close(ours[i].cpu(), expected)


@pytest.mark.parametrize("kernel", ["lut", "shifts"])
def test_bitmask_rows_touch_only_named_rows(kernel, device):
    logits = torch.randn(4, 64).to(device)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # only token 3
    out = logits.clone()
    apply_token_bitmask_inplace(out, bitmask.to(device), torch.tensor([2], device=device), kernel=kernel)
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])
    assert out[2].isfinite().nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_input_is_computed_in_fp32(dtype, device):
    logits = torch.stack([_row_logits(s, scale=4.0) for s in range(3)]).to(dtype).to(device)
    params = SamplingParams(top_k=20, top_p=0.9, logprobs=1)
    out = Sampler()(logits, SamplingMetadata.build([params] * 3, vocab_size=VOCAB, device=device))
    for i in range(3):
        expected = torch.log_softmax(filtered_logits(logits[i].cpu().double(), params), -1)
        torch.testing.assert_close(
            out.logprobs.sampled[i].cpu().double(), expected[out.token_ids[i]], atol=1e-4, rtol=1e-4
        )
    greedy = Sampler()(
        logits, SamplingMetadata.build([SamplingParams(temperature=0)] * 3, vocab_size=VOCAB, device=device)
    )
    assert torch.equal(greedy.token_ids, logits.float().argmax(-1))


def test_greedy_is_argmax_after_bias_and_penalties():
    logits = torch.stack([_row_logits(s) for s in range(3)])
    top = logits.argmax(-1)
    params = SamplingParams(temperature=0, logit_bias={11: 50.0})
    out = Sampler()(logits.clone(), SamplingMetadata.build([params] * 3, vocab_size=VOCAB, device="cpu"))
    assert out.token_ids.tolist() == [11, 11, 11]
    params = SamplingParams(temperature=0, repetition_penalty=10.0)
    out = Sampler()(
        logits.clone(),
        SamplingMetadata.build([params] * 3, vocab_size=VOCAB, device="cpu", output_token_ids=[[int(t)] for t in top]),
    )
    assert (out.token_ids != top).all()


def test_row_with_no_allowed_token_is_reported_not_sampled(device):
    logits = torch.randn(4, 100, device=device)
    bitmask = torch.full((4, 4), -1, dtype=torch.int32, device=device)
    bitmask[1] = 0
    bitmask[3] = 0
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    md = SamplingMetadata.build(params, vocab_size=100, device=device, token_bitmask=bitmask)
    out = Sampler()(logits, md)
    assert out.no_token_allowed.tolist() == [False, True, False, True]
    assert out.token_ids[1] == -1 and out.token_ids[3] == -1
    assert (out.token_ids[[0, 2]] >= 0).all()
    md = SamplingMetadata.build([SamplingParams(top_p=0.5)] * 4, vocab_size=100, device=device, token_bitmask=bitmask)
    out = Sampler()(torch.randn(4, 100, device=device), md)
    assert out.no_token_allowed.tolist() == [False, True, False, True]


def test_ties_at_the_kth_logit_are_all_kept():
    logits = torch.full((1, 300), -5.0)
    logits[0, [10, 20, 30, 40]] = 1.0  # four-way tie for the 2nd..5th place with k = 3
    logits[0, 5] = 2.0
    params = SamplingParams(top_k=3, logprobs=5)
    out = Sampler()(logits.clone(), SamplingMetadata.build([params], vocab_size=300, device="cpu"))
    kept = out.logprobs.top_logprobs[0].isfinite().sum()
    assert kept == 5
    seen = {int(sample_one(logits, params, seed)) for seed in range(200)}
    assert seen == {5, 10, 20, 30, 40}


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    p = SamplingParams(**{**_fields(params), "seed": seed, "logprobs": None})
    return int(
        Sampler()(logits.clone(), SamplingMetadata.build([p], vocab_size=logits.shape[1], device="cpu")).token_ids[0]
    )


def test_sample_never_modifies_its_input():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    sample(
        logits,
        [SamplingParams(top_p=0.9), SamplingParams(repetition_penalty=2.0), SamplingParams(temperature=0)],
        output_token_ids=[[1], [1], [1]],
        token_bitmask=torch.full((3, 32), -1, dtype=torch.int32),
    )
    assert torch.equal(logits, before)


def test_non_contiguous_logits_like_a_models_last_position(device):
    full = torch.randn(16, 5, VOCAB, device=device)  # [B, T, V]
    logits = full[:, -1, :]  # what a decode loop hands over: rows strided T * V apart
    params = [SamplingParams(seed=i, top_p=0.9) for i in range(16)]
    expected = Sampler()(logits.contiguous(), SamplingMetadata.build(params, vocab_size=VOCAB, device=device))
    got = Sampler()(logits, SamplingMetadata.build(params, vocab_size=VOCAB, device=device))
    assert torch.equal(got.token_ids, expected.token_ids)


@pytest.mark.parametrize("vocab", [1, 100, 256, 600, 1000, 4096, 4100])
def test_block_argmax_and_topk_equal_torchs(vocab):
    """The block ops read maxima of 256-token blocks first; they must equal argmax / topk exactly,
    ties, -inf and a last, shorter block included."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).round()  # rounding makes ties frequent
    logits[1] = -math.inf
    logits[2, : vocab // 2] = -math.inf
    logits[3] = 7.0  # one value throughout
    rows = torch.tensor([5, 0, 1, 2, 3])
    maxima = block_max(logits)
    best, ids = block_argmax(logits, rows, maxima)
    assert torch.equal(ids, logits[rows].argmax(-1))
    assert torch.equal(best, logits[rows].amax(-1))
    for width in {1, min(7, vocab), min(50, vocab), min(129, vocab), vocab}:
        values, top_ids = block_topk(logits, rows, maxima, width)
        assert torch.equal(values, logits[rows].topk(width, -1).values)
        assert ((top_ids >= 0) & (top_ids < vocab)).all()
        finite = values.isfinite()
        assert torch.equal(logits[rows].gather(1, top_ids)[finite], values[finite])  # ids hold their values
        for r in range(len(rows)):
            assert top_ids[r][finite[r]].unique().numel() == int(finite[r].sum())  # no token twice


def test_auto_kernel_shifts_only_large_masks_on_cuda(device):
    from constrain.sampler.ops.bitmask import SHIFTS_FROM, auto_kernel

    small = torch.zeros(1, 4008, dtype=torch.int32, device=device)  # 1 x 128,256 entries
    large = torch.zeros(SHIFTS_FROM // 32, 1, dtype=torch.int32, device=device)
    assert auto_kernel(small) == "lut"
    assert auto_kernel(large) == ("shifts" if device == "cuda" else "lut")


def test_an_unknown_bitmask_kernel_is_a_value_error():
    with pytest.raises(ValueError, match="kernel must be one of auto, lut, shifts; got 'triton'"):
        apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), kernel="triton")  # type: ignore[arg-type]
