"""The host-side token bitmask (constrain.match.bitmask) against the layout's reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from constrain.match import bitmask

VOCAB_SIZE = 100  # not a multiple of 32: the last word has padding bits


def reference_allowed(row, vocab_size):
    """The layout's reference loop: token t is allowed iff bit t % 32 of word t // 32 is set."""
    return [t for t in range(vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1]


def random_row(seed):
    words = np.random.default_rng(seed).integers(-(2**31), 2**31, size=bitmask.bitmask_size(VOCAB_SIZE))
    return words.astype(np.int32)


def test_allocate_allows_every_token():
    mask = bitmask.allocate_token_bitmask(3, VOCAB_SIZE)
    assert mask.shape == (3, 4) and mask.dtype == torch.int32
    assert reference_allowed(mask[1], VOCAB_SIZE) == list(range(VOCAB_SIZE))
    with pytest.raises(ValueError, match="positive"):
        bitmask.allocate_token_bitmask(0, VOCAB_SIZE)


@pytest.mark.parametrize("seed", range(5))
def test_reading_a_row_matches_the_reference_loop(seed):
    row = random_row(seed)
    expected = reference_allowed(row, VOCAB_SIZE)
    assert bitmask.allowed_ids(row, VOCAB_SIZE).tolist() == expected
    assert bitmask.allowed_ids(torch.from_numpy(row), VOCAB_SIZE).tolist() == expected
    assert bitmask.unpack(row)[:VOCAB_SIZE].tolist() == [t in expected for t in range(VOCAB_SIZE)]
    assert bitmask.count_allowed(row) == len(reference_allowed(row, 32 * len(row)))
    tokens = np.array([99, 31, 0, 64, 63, 5], dtype=np.int64)
    assert bitmask.allowed_among(row, tokens).tolist() == [t for t in tokens.tolist() if t in expected]
    assert [bitmask.is_allowed(row, t) for t in range(VOCAB_SIZE)] == [t in expected for t in range(VOCAB_SIZE)]


@pytest.mark.parametrize("seed", range(5))
def test_pack_inverts_unpack(seed):
    rows = np.stack([random_row(seed), random_row(seed + 100)])  # [2, W]
    flags = bitmask.unpack(rows)  # [2, 32 * W]
    assert flags.shape == (2, 32 * rows.shape[1]) and flags.dtype == np.bool_
    assert np.array_equal(bitmask.pack(flags), rows)


@pytest.mark.parametrize("copies", [1, 4], ids=["few", "many"])  # a loop for a few tokens, else vectorized
def test_clearing_and_setting_bits_in_place(copies):
    mask = bitmask.allocate_token_bitmask(1, VOCAB_SIZE)
    row = mask[0]  # a view of ``mask``: the functions write through it
    # the sign bit (31, 63), two tokens of one word, and a token twice
    bitmask.clear_bits(row, [31, 63, 2, 3, 3, 99] * copies)
    assert reference_allowed(mask[0], VOCAB_SIZE) == [t for t in range(VOCAB_SIZE) if t not in {2, 3, 31, 63, 99}]
    bitmask.clear_bits(row, [])
    row.zero_()
    bitmask.set_bits(row, np.array([31, 0, 31, 64] * copies, dtype=np.int64))
    assert reference_allowed(mask[0], VOCAB_SIZE) == [0, 31, 64]
    assert int(mask[0, 0]) == -(2**31) + 1  # bit 31 set: a negative int32
    with pytest.raises(ValueError, match="int32"):
        bitmask.clear_bits(np.zeros(4, dtype=np.int64), [1])
