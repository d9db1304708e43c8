"""The sampler on its own: one batch, four requests, each with its own parameters.

1. build per-row parameters and a token bitmask (row 2 may only say "yes" or "no");
2. sample a few steps, feeding each row's output back for the penalties;
3. show that a seeded request gives the same tokens alone as inside the batch;
4. verify n-gram drafts with the rejection sampler.
"""

from __future__ import annotations

import torch

from constrain.sampler import SamplingParams, rejection_sample, sample

VOCAB = ["<eos>", "yes", "no", "maybe", "the", "cat", "sat", "on", "a", "mat", ",", "."]


def fake_logits(step: int, batch: int) -> torch.Tensor:
    """A stand-in for a model: fixed random logits per step."""
    return torch.randn(batch, len(VOCAB), generator=torch.Generator().manual_seed(step)) * 2


def main() -> None:
    params = [
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=0.8, top_p=0.9, seed=42, logprobs=2),
        SamplingParams(top_k=3, seed=7),
        SamplingParams(min_p=0.1, repetition_penalty=1.5, frequency_penalty=0.5, seed=3),
    ]
    bitmask = torch.full((4, 1), -1, dtype=torch.int32)  # every token allowed...
    bitmask[2] = (1 << VOCAB.index("yes")) | (1 << VOCAB.index("no"))  # ...but row 2: yes/no only
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(6):
        out = sample(fake_logits(step, 4), params, output_token_ids=outputs, token_bitmask=bitmask)
        for row, token in enumerate(out.token_ids.tolist()):
            outputs[row].append(token)
        lp = out.logprobs
        print(
            f"step {step}: logprob of row 1's token {lp.sampled[1]:.3f}, its top-2 "
            f"{[VOCAB[t] for t in lp.top_token_ids[1].tolist()]}"
        )
    for row, tokens in enumerate(outputs):
        print(f"row {row}: {' '.join(VOCAB[t] for t in tokens)}")

    alone: list[int] = []
    for step in range(6):
        logits = fake_logits(step, 4)[1:2]
        alone.append(int(sample(logits, params[1], output_token_ids=[alone]).token_ids[0]))
    print(f"row 1 alone gives the same tokens as in the batch: {alone == outputs[1]}")

    target = torch.softmax(fake_logits(99, 3), -1).unsqueeze(0)  # [1, K + 1 = 3, V]
    drafts = torch.tensor([[VOCAB.index("the"), VOCAB.index("cat")]])
    verdict = rejection_sample(drafts, torch.tensor([2]), None, target, seeds=torch.tensor([0]))
    accepted = int(verdict.num_tokens[0]) - 1
    print(
        f"speculative step: {accepted} of 2 drafts accepted, emitted "
        f"{[VOCAB[t] for t in verdict.token_ids[0, : accepted + 1].tolist()]}"
    )


if __name__ == "__main__":
    main()
