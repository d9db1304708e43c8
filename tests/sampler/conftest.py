"""Fixtures for the sampler tests: devices, and torch's global state restored after each test."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    return str(request.param)


@pytest.fixture(autouse=True)
def restore_torch_state():
    state = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    yield
    torch.set_rng_state(state)
    torch.set_default_dtype(dtype)
