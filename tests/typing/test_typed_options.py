"""The public calls' keyword options are typed: `mypy --strict` (`make lint`) checks this file.

Each ``# type: ignore[...]`` below marks a call mypy must refuse: under ``warn_unused_ignores`` (strict), an
ignore that mypy no longer needs is an error, so a lost annotation fails `make lint`. At run time the same
misspelt options raise a ``ValueError`` that names them, before any model is loaded.
"""

from __future__ import annotations

import dataclasses

import pytest

import constrain
from constrain.sampler import SamplingParams


def test_the_options_mirror_request_and_sampling_params() -> None:
    request = {f.name for f in dataclasses.fields(constrain.Request)} - {"prompt", "sampling"}
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    decoding = {"jump_forward", "speculative", "forward_cost"}
    assert set(constrain.SamplingOptions.__annotations__) == sampling
    assert set(constrain.GenerateOptions.__annotations__) == request | sampling | decoding
    beams = {"n", "num_beams", "length_penalty"}
    assert set(constrain.StreamOptions.__annotations__) == (request | sampling | decoding) - beams
    constraints = {"schema", "regex", "grammar", "choices", "constraint", "n"}
    assert set(constrain.ChatOptions.__annotations__) == (request | sampling | decoding) - constraints


def test_a_misspelt_option_is_refused_by_mypy_and_at_run_time() -> None:
    with pytest.raises(ValueError, match=r"unknown option 'temprature' \(did you mean 'temperature'\?\)"):
        constrain.generate(None, "x", temprature=0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"unknown option 'max_token' \(did you mean 'max_tokens'\?\)"):
        next(constrain.stream(None, "x", max_token=3))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"chat\(\) got an unknown option 'sead'"):
        constrain.chat(None, [{"role": "user", "content": "x"}], sead=1)  # type: ignore[call-arg]


def test_an_option_of_the_wrong_type_is_refused_by_mypy() -> None:
    with pytest.raises(constrain.InvalidSamplingParamsError, match="temperature"):
        constrain.generate(None, "x", temperature="hot")  # type: ignore[arg-type]


def test_stream_refuses_the_options_of_a_batch() -> None:
    with pytest.raises(ValueError, match="n=1"):
        next(constrain.stream(None, "x", n=2))  # type: ignore[call-arg]
    with pytest.raises(constrain.BeamSearchError, match="num_beams"):
        next(constrain.stream(None, "x", num_beams=2))  # type: ignore[call-arg]
