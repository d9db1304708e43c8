"""Constrained decoding on a CUDA device: the model, the sampler's tensors and the bitmask on the GPU,
the masks filled on the loop's worker thread beside the forward pass (``overlap``, the default off the CPU).

Skipped without CUDA: CI has none. Run where a GPU is lent (``pytest tests/constrain/decode/test_cuda.py``);
docs/performance.md names the runs. The model is a random-weight Llama in float32 with a SentencePiece
tokenizer trained here, so nothing needs a model package on the GPU machine.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex
import torch

import constrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "uniqueItems": True, "maxItems": 3},
        "score": {"type": "number", "multipleOf": 0.5, "minimum": 0},
    },
    "required": ["tags", "score"],
    "additionalProperties": False,
}  # value checks: uniqueItems, multipleOf on a float
REGEX = r"[a-z]{2,6}-\d{2}"
CHOICES = ["cat", "json", "the name"]


@pytest.fixture(scope="module")
def models(sp_tokenizer) -> tuple[constrain.ModelHandle, constrain.ModelHandle]:
    """The same random float32 Llama on the CPU and on the GPU (a copy: the caller's model stays)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(sp_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=sp_tokenizer.eos_token_id, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    pair = (model, sp_tokenizer)
    return constrain.load_model(pair, dtype=torch.float32), constrain.load_model(
        pair, device="cuda", dtype=torch.float32
    )


def _batch(**sampling: object) -> list[constrain.Request]:
    prompts = ["the cat sat", "json name age", "héllo the cat"]
    out = []
    for prompt in prompts:
        out += [
            constrain.Request(prompt, schema=SCHEMA, max_tokens=60, sampling=sampling),
            constrain.Request(prompt, regex=REGEX, max_tokens=20, sampling=sampling),
            constrain.Request(prompt, choices=CHOICES, sampling=sampling),
            constrain.Request(prompt, max_tokens=12, sampling=sampling),
        ]
    return out


def _assert_valid(results: list[constrain.GenerationResult]) -> None:
    for k, result in enumerate(results):
        assert result.finish_reason in ("stop", "length"), (k, result.finish_reason, result.error)
        kind = k % 4
        if kind == 0:
            jsonschema.validate(json.loads(result.text), SCHEMA)
        elif kind == 1:
            assert regex.fullmatch(REGEX, result.text), result.text
        elif kind == 2:
            assert result.text in CHOICES


def test_greedy_on_cuda_writes_what_the_cpu_writes(models):
    cpu, cuda = models
    on_cpu = constrain.generate(cpu, _batch(temperature=0))
    on_cuda = constrain.generate(cuda, _batch(temperature=0))
    assert next(cuda.model.parameters()).is_cuda
    _assert_valid(on_cuda)
    assert [r.text for r in on_cuda] == [r.text for r in on_cpu]


def test_sampled_rows_on_cuda_satisfy_their_constraints_and_repeat_with_their_seeds(models):
    _, cuda = models
    for sampling in ({"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):
        first = constrain.generate(cuda, _batch(**sampling))
        _assert_valid(first)
        again = constrain.generate(cuda, _batch(**sampling))
        assert [r.text for r in again] == [r.text for r in first]
        assert len({r.text for r in first[0::4]}) > 1  # the schema rows were drawn, not all one text


def test_logprobs_on_cuda_are_the_masked_distributions(models):
    _, cuda = models
    sampling = {"temperature": 1.0, "seed": 3, "logprobs": 3}
    [result] = constrain.generate(cuda, [constrain.Request("the cat", schema=SCHEMA, max_tokens=40, sampling=sampling)])
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs or [], strict=False):
        if logprob == logprob:  # NaN: forced by the budget, not sampled
            assert logprob <= 1e-4 and top and max(top.values()) >= logprob - 1e-4
            assert token in top or logprob <= min(top.values()) + 1e-4
