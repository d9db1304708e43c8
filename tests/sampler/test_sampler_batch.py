"""The persistent :class:`SamplingBatch` gives the sampler what ``SamplingMetadata.build`` gives it.

Random batches over several steps, rows joining, leaving and moving, drafts (several slots per row),
seeds, penalties, bias, bitmasks, logprobs and redraws: the tokens, logprobs and distributions must be
equal, bit for bit, to those of metadata built from lists with the same generator state.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import pytest
import torch

from constrain.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingMetadata, SamplingParams

VOCAB = 3000  # not a multiple of 32 (the bitmask's last word is partial) and > 256 (several blocks)

POOL = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(top_k=5, seed=11),
    SamplingParams(top_k=50, top_p=0.8, logprobs=0),
    SamplingParams(top_k=400, min_p=0.05),  # a top-k past the window: the full path's threshold
    SamplingParams(min_p=0.1, seed=3, logprobs=5, logprobs_mode="raw"),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(top_p=0.6, presence_penalty=1.5, seed=123_456_789_012),
    SamplingParams(frequency_penalty=-0.5, top_k=20, logprobs=2),
    SamplingParams(logit_bias={0: 5.0, 17: -100.0, 2999: 3.0}, temperature=1.3),
    SamplingParams(logit_bias={4: 8.0}, repetition_penalty=0.8, seed=7, top_k=3),
]


@dataclass(eq=False)
class Req:
    """A request as the batch reads it (compared by identity, as the decode loop's are)."""

    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def new_request(rnd: random.Random) -> Req:
    prompt = [rnd.randrange(VOCAB) for _ in range(rnd.choice([0, 1, 5, 40]))]
    output = [rnd.randrange(VOCAB) for _ in range(rnd.choice([0, 0, 3]))]
    return Req(rnd.choice(POOL), prompt, output)


def assert_same(out: SamplerOutput, ref: SamplerOutput) -> None:
    assert torch.equal(out.token_ids, ref.token_ids)
    assert torch.equal(out.no_token_allowed, ref.no_token_allowed)
    assert (out.logprobs is None) == (ref.logprobs is None)
    if out.logprobs is not None and ref.logprobs is not None:
        for mine, theirs in (
            (out.logprobs.sampled, ref.logprobs.sampled),
            (out.logprobs.top_token_ids, ref.logprobs.top_token_ids),
            (out.logprobs.top_logprobs, ref.logprobs.top_logprobs),
        ):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


def random_bitmask(rnd: random.Random, gen: torch.Generator, slots: int) -> tuple[torch.Tensor, list[int]] | None:
    """A bitmask for a random subset of the slots (None: none constrained); a few rows allow nothing."""
    if rnd.random() < 0.3:
        return None
    rows = sorted(rnd.sample(range(slots), rnd.randint(1, slots)))
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
    sparse = torch.rand(len(rows), words, generator=gen) < 0.9
    bitmask[sparse] = 0  # ~10% of the words allowed: the mask matters
    if rnd.random() < 0.2:
        bitmask[0] = 0  # a slot with no allowed token
    return bitmask, rows


def metadata_pair(
    batch: SamplingBatch,
    requests: list[Req],
    slots: list[tuple[int, list[int]]],
    # ([c, ceil(V / 32)] int32, the slot of each of its rows) or None
    mask: tuple[torch.Tensor, list[int]] | None,
    chosen: list[int],
    draw: int,
    reference: torch.Generator,
    device: str,
) -> tuple[SamplingMetadata, SamplingMetadata]:
    """The metadata of slots ``chosen`` (with their bitmask rows): from the batch, and built from lists."""
    sub, at = None, None
    if mask is not None:
        rows = [k for k, slot in enumerate(mask[1]) if slot in chosen]
        if rows:
            sub, at = mask[0][rows].to(device), [chosen.index(mask[1][k]) for k in rows]
    mine = batch.metadata(slots=[slots[s] for s in chosen], token_bitmask=sub, bitmask_rows=at, draw=draw)
    ref = SamplingMetadata.build(
        [requests[slots[s][0]].params for s in chosen],
        vocab_size=VOCAB,
        device=device,
        prompt_token_ids=[requests[slots[s][0]].prompt_ids for s in chosen],
        output_token_ids=[requests[slots[s][0]].output_ids + slots[s][1] for s in chosen],
        token_bitmask=sub,
        bitmask_rows=at,
        generator=reference,
        draw=draw,
    )
    return mine, ref


@pytest.mark.parametrize("seed", range(6))
def test_persistent_batch_samples_what_metadata_built_from_lists_samples(seed, device):
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = SamplingBatch(VOCAB, device=device, generator=torch.Generator().manual_seed(seed))
    reference = torch.Generator().manual_seed(seed)  # build's, in lockstep with the batch's
    sampler, ref_sampler = Sampler(), Sampler()
    requests = [new_request(rnd) for _ in range(rnd.randint(1, 6))]
    for step in range(10):
        # rows leave, join, and (not in the decode loop, but allowed) move
        requests = [r for r in requests if rnd.random() > 0.2] + [new_request(rnd) for _ in range(rnd.randint(0, 3))]
        if not requests:
            requests = [new_request(rnd)]
        if step % 4 == 3:
            rnd.shuffle(requests)
        batch.update(requests)
        drafted = rnd.random() < 0.5
        slots = [
            (i, [rnd.randrange(VOCAB) for _ in range(rnd.randint(0, 2) if drafted else 0)])
            for i in range(len(requests))
        ]
        slots = [(i, d[:j]) for i, d in slots for j in range(len(d) + 1)]  # slot (i, j): row i after j drafts
        mask = random_bitmask(rnd, gen, len(slots))
        logits = (torch.randn(len(slots), VOCAB, generator=gen) * 3).to(device)  # [P, V]
        if step == 5:
            logits[0] = float("-inf")  # a dead row without a bitmask

        both = functools.partial(metadata_pair, batch, requests, slots, mask, reference=reference, device=device)

        every = list(range(len(slots)))
        mine, ref = both(every, draw=0)
        out = sampler(logits.clone(), mine)
        assert_same(out, ref_sampler(logits.clone(), ref))
        probs, ref_probs = Sampler().probs(logits.clone(), mine), Sampler().probs(logits.clone(), ref)
        torch.testing.assert_close(probs, ref_probs, rtol=0, atol=0, equal_nan=True)
        if rnd.random() < 0.5:  # a redraw of some slots at the same position (a refused value check)
            chosen = sorted(rnd.sample(every, rnd.randint(1, len(every))))
            mine, ref = both(chosen, draw=1)
            assert_same(sampler(logits[chosen].clone(), mine), ref_sampler(logits[chosen].clone(), ref))

        # each row takes its first slot's token, sometimes a long run (the histories grow past their capacity)
        tokens = out.token_ids.tolist()
        first = {}
        for s, (i, _) in enumerate(slots):
            first.setdefault(i, tokens[s])
        for i, r in enumerate(requests):
            if first[i] >= 0:
                r.output_ids.append(first[i])
            if rnd.random() < 0.1:
                r.output_ids.extend(rnd.randrange(VOCAB) for _ in range(rnd.randint(20, 60)))


def test_one_slot_per_row_reuses_the_rows_tensors():
    """Without drafts the metadata's per-row tensors are the batch's own (nothing rebuilt per step)."""
    batch = SamplingBatch(VOCAB)
    requests = [Req(p) for p in POOL]
    batch.update(requests)
    first = batch.metadata()
    batch.update(requests)
    second = batch.metadata(slots=[(i, []) for i in range(len(requests))])
    assert second.temperature is first.temperature and second.window_rows is first.window_rows
    assert not torch.equal(first.keys, second.keys)  # unseeded rows draw fresh seeds every step


def test_update_rejects_bad_requests_and_leaves_the_batch_unchanged():
    batch = SamplingBatch(VOCAB)
    held = [Req(SamplingParams(repetition_penalty=1.2), [1, 2], [3])]
    batch.update(held)
    bad = [
        [*held, Req(SamplingParams(logit_bias={VOCAB: 1.0}))],
        [*held, Req(SamplingParams(presence_penalty=1.0), [VOCAB + 5])],
        [held[0], held[0]],
    ]
    for requests in bad:
        with pytest.raises(ValueError, match=r"vocabulary|twice"):
            batch.update(requests)
        assert batch.requests == held
    held[0].output_ids.clear()
    with pytest.raises(ValueError, match="shrank"):
        batch.update(held)
    with pytest.raises(ValueError, match="no rows"):
        SamplingBatch(VOCAB).metadata()
    with pytest.raises(ValueError, match="outside"):
        batch.metadata(slots=[(1, [])])


def test_unseeded_rows_leave_torchs_global_random_state_alone():
    batch = SamplingBatch(VOCAB)
    batch.update([Req(SamplingParams())])
    torch.manual_seed(5)
    before = torch.get_rng_state()
    batch.metadata()
    assert torch.equal(torch.get_rng_state(), before)
