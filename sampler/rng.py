"""A counter-based random generator: uniforms as a pure function of (seed, counter, stream).

Why not ``torch.Generator``: a request's randomness must not depend on which
batch it runs in, nor at which row, and the batch must be served without a
Python loop over its rows. A stateful generator per request gives the first but
not the second; one generator for the batch gives the second but not the first.
A counter-based generator (the idea behind Philox, which CUDA's torch uses)
gives both: each row's uniform is ``hash(hash(seed, counter), stream)``,
computed for all rows at once with integer tensor ops on any device.

The hash (see :func:`_hash32`) is chained over the 32-bit words of the key.
"""

from __future__ import annotations

import secrets
from typing import TypeVar

import torch

__all__ = ["Stream", "fresh_seeds", "row_keys", "uniform", "uniforms"]

_MASK32 = 0xFFFFFFFF

_Int = TypeVar("_Int", int, torch.Tensor)


class Stream:
    """Named streams keep the uses of randomness at one step independent."""

    SAMPLE = 0x5A3C_0001
    """Round ``r`` of a top-p rejection loop uses ``SAMPLE + r``."""
    ACCEPT = 0x71E2_0000
    """Acceptance test of a draft token in the rejection sampler."""
    RECOVER = 0x2B9D_0000
    """Sampling of the recovered (or bonus) token in the rejection sampler."""
    REDRAW = 0x6C4F_0000
    """Draw ``d`` > 0 of a row at one position uses keys mixed with ``REDRAW + d`` (``row_keys``)."""


def fresh_seeds(n: int, bound: int, generator: torch.Generator | None = None) -> list[int]:
    """``n`` seeds in ``[0, bound)`` for rows that were given none: from ``generator`` when one is given, else
    from the operating system's entropy, so that the caller's ``torch`` random state is neither read nor
    advanced (``torch.manual_seed`` elsewhere does not fix them, and drawing them changes nothing there)."""
    if generator is not None:
        return list(torch.randint(0, bound, (n,), generator=generator).tolist())
    return [secrets.randbelow(bound) for _ in range(n)]


def _hash32(x: _Int) -> _Int:
    """A 32-bit integer hash; works on Python ints and on int64 tensors holding 32-bit values.

    Wellons' ``[16 21f0aaad 15 735a2d97 15]`` (bias ~0.107, among the best two-multiply
    hashes found). Both multipliers are below 2**31, so ``x * c < 2**63``: no int64 overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def row_keys(
    # [n] int64, each in [0, 2**63)
    seeds: torch.Tensor,
    # [n] int64, each in [0, 2**32): the request's position (e.g. its output length)
    counters: torch.Tensor,
    draw: int = 0,
) -> torch.Tensor:
    """``[n]`` int64 32-bit keys: one per (seed, counter), the input of :func:`uniform`; ``draw`` > 0
    (a row drawn again at the same position) gives keys independent of draw 0's.

    Computed once per step (by ``SamplingMetadata.build``), so that each draw
    afterwards costs only the few ops of :func:`uniform`. Does not mutate its inputs.
    """
    seeds = seeds.to(torch.int64)
    h = _hash32((counters.to(torch.int64) & _MASK32) ^ 0x2545F491)
    h = _hash32(h ^ (seeds & _MASK32))
    h = _hash32(h ^ ((seeds >> 32) & _MASK32))
    return h if not draw else _hash32(h ^ _hash32((Stream.REDRAW + draw) & _MASK32))


def uniform(
    # [n] int64 from row_keys
    keys: torch.Tensor,
    stream: int,
) -> torch.Tensor:
    """Return ``[n]`` float64 uniforms in ``[0, 1)`` with 53 random bits each.

    Pure function of ``(keys[i], stream)``; does not mutate its inputs.
    """
    return _bits_to_unit(_hash32(keys ^ _hash32(stream & _MASK32)))


def uniforms(
    # [n] int64 from row_keys
    keys: torch.Tensor,
    first: int,
    count: int,
) -> torch.Tensor:
    """Return ``[n, count]`` float64: column ``j`` is ``uniform(keys, first + j)``, bit for bit.

    One set of tensor ops for all the streams (a sampler's rejection rounds): on a GPU, where each op is a
    kernel launch, ``count`` streams cost what one does. Does not mutate its inputs.
    """
    streams = torch.arange(first, first + count, dtype=torch.int64, device=keys.device) & _MASK32  # [count]
    return _bits_to_unit(_hash32(keys.unsqueeze(1) ^ _hash32(streams)))  # [n, count]


def _bits_to_unit(
    # [...] int64 holding 32-bit hashes
    h: torch.Tensor,
) -> torch.Tensor:
    """``[...]`` float64 in ``[0, 1)``: 53 bits derived from each hash (32 + 21, two more hashes)."""
    a = _hash32(h ^ 0x9E3779B9)  # 32 bits
    b = _hash32(h ^ 0x85EBCA6B) >> 11  # 21 bits
    return ((a << 21) | b).to(torch.float64) * (2.0**-53)
