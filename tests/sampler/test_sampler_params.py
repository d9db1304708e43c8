"""SamplingParams validation: every bad value raises a ValueError naming the field and the value."""

from __future__ import annotations

import math

import pytest
import torch

from constrain.sampler import InvalidSamplingParamsError, SamplingMetadata, SamplingParams, sample

field__value__bad = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", math.nan),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -3),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs_mode", "final"),
]


@pytest.mark.parametrize("field,value", field__value__bad)
def test_bad_value_names_field_and_value(field, value):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {"a": 1.0}, {3: math.nan}, {3: 101.0}, [(3, 1.0)]])
def test_bad_logit_bias(bias):
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_good_values_are_normalised_and_hashable():
    p = SamplingParams(temperature=1, top_k=5, top_p=1, logit_bias={3: 2}, seed=0, logprobs=20)
    assert isinstance(p.temperature, float) and isinstance(p.logit_bias[3], float)
    assert hash(p) == hash(
        SamplingParams(temperature=1.0, top_k=5, top_p=1.0, logit_bias={3: 2.0}, seed=0, logprobs=20)
    )
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]


def test_vocabulary_dependent_errors_name_the_culprit():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="logit_bias names token id 10"):
        sample(logits, SamplingParams(logit_bias={10: 1.0}))
    with pytest.raises(ValueError, match=r"output_token_ids\[1\] holds token id 12"):
        sample(logits, SamplingParams(), output_token_ids=[[1], [12]])
    with pytest.raises(ValueError, match="3 SamplingParams for 2 logits rows"):
        sample(logits, [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="words per row"):
        sample(logits, SamplingParams(), token_bitmask=torch.zeros(2, 0, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        sample(logits, SamplingParams(), token_bitmask=torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="params is empty"):
        SamplingMetadata.build([], vocab_size=10, device="cpu")
