"""Checking the drawn token only (``decode.checked.settle``) draws from exactly the eager mask's
distribution: a chi-squared test of the two paths' token counts on a small vocabulary, fixed seeds; greedy
takes the exact mask's argmax; a slot whose tokens are all refused ends on the eager row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from constrain.decode.checked import MAX_REFUSALS, CheckedSlot, checks_sampled_token, settle
from constrain.match.bitmask import allocate_token_bitmask, allowed_ids, clear_bits
from constrain.match.values import DEAD_END, VIABLE
from constrain.sampler import Sampler, SamplingMetadata, SamplingParams

VOCAB = 24


class Refusing:
    """A stand-in for a matcher's value checks: refuses ``refused``; ``check_row`` clears them (or, when
    every allowed token is refused, leaves the row: a dead end)."""

    def __init__(self, refused: set[int]) -> None:
        self.refused = refused
        self.asked = 0

    def allows(self, token: int, row: torch.Tensor) -> bool:
        self.asked += 1
        return token not in self.refused

    def check_row(self, row: torch.Tensor) -> int:
        if set(allowed_ids(row, VOCAB).tolist()) <= self.refused:
            return DEAD_END
        clear_bits(row.numpy(), sorted(self.refused))
        return VIABLE


def _draw(logits: torch.Tensor, bitmask: torch.Tensor, params: list[SamplingParams], lengths: list[int], draw: int):
    metadata = SamplingMetadata.build(params, vocab_size=VOCAB, device="cpu", output_lengths=lengths,
                                      token_bitmask=bitmask, draw=draw)  # fmt: skip
    return Sampler()(logits.clone(), metadata).token_ids.tolist()


def _settled(logits: torch.Tensor, refused: set[int], params: SamplingParams, positions: int) -> list[int]:
    """One token per position (a row each, drawn at once), value checks on the drawn token only."""
    rows = logits.expand(positions, VOCAB)  # [n, V]: one slot per position
    bitmask = allocate_token_bitmask(positions, VOCAB)  # [n, 1]
    checks = Refusing(refused)
    checked = [CheckedSlot(i, i, checks, bitmask[i].clone()) for i in range(positions)]  # type: ignore[arg-type]
    lengths = list(range(positions))
    tokens = _draw(rows, bitmask, [params] * positions, lengths, 0)

    def redraw(mask_rows: list[int], draw: int) -> list[int]:
        return _draw(rows[mask_rows], bitmask[mask_rows], [params] * len(mask_rows), [lengths[r] for r in mask_rows],
                     draw)  # fmt: skip

    settle(checked, tokens, bitmask, redraw)
    return tokens


def _eager(logits: torch.Tensor, refused: set[int], params: SamplingParams, positions: int) -> list[int]:
    bitmask = allocate_token_bitmask(positions, VOCAB)  # [n, 1]
    for row in bitmask:
        Refusing(refused).check_row(row)
    return _draw(logits.expand(positions, VOCAB), bitmask, [params] * positions, list(range(positions)), 0)


def _counts(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.array(tokens), minlength=VOCAB)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_drawn_token_checks_sample_the_eager_masks_distribution(temperature):
    generator = torch.Generator().manual_seed(27)
    logits = torch.randn(1, VOCAB, generator=generator) * 2  # [1, V]
    refused = set(torch.topk(logits[0], 6).indices.tolist()[::2])  # three of the likeliest tokens
    params = SamplingParams(temperature=temperature, seed=5)
    lazy, eager = _settled(logits, refused, params, 6000), _eager(logits, refused, params, 6000)
    assert not refused & set(lazy) and not refused & set(eager)
    table = np.stack([_counts(lazy), _counts(eager)])
    table = table[:, table.sum(0) > 0]
    assert chi2_contingency(table).pvalue > 1e-3  # the same distribution


def test_the_test_tells_distributions_apart():
    """The comparison above can fail: keeping the refused tokens' mass on their neighbours (a redraw with
    the same uniform, as a biased implementation would) is detected."""
    generator = torch.Generator().manual_seed(27)
    logits = torch.randn(1, VOCAB, generator=generator) * 2
    refused = set(torch.topk(logits[0], 6).indices.tolist()[::2])
    params = SamplingParams(temperature=1.0, seed=5)
    positions = 6000
    bitmask = allocate_token_bitmask(positions, VOCAB)
    tokens = _draw(logits.expand(positions, VOCAB), bitmask, [params] * positions, list(range(positions)), 0)
    for i, token in enumerate(tokens):
        if token in refused:
            Refusing(refused).check_row(bitmask[i])
    biased = _draw(logits.expand(positions, VOCAB), bitmask, [params] * positions, list(range(positions)), 0)
    table = np.stack([_counts(biased), _counts(_eager(logits, refused, params, positions))])
    table = table[:, table.sum(0) > 0]
    assert chi2_contingency(table).pvalue < 1e-6


def test_greedy_takes_the_exact_masks_argmax():
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)  # [1, V]: the last ids are likeliest
    refused = {VOCAB - 1, VOCAB - 2}
    assert _settled(logits, refused, SamplingParams(temperature=0.0), 3) == [VOCAB - 3] * 3


def test_many_refusals_end_on_the_eager_row():
    """Past MAX_REFUSALS refusals the slot's row is checked at once: the token then drawn stands."""
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)
    refused = set(range(VOCAB - 1 - 2 * MAX_REFUSALS, VOCAB))
    assert _settled(logits, refused, SamplingParams(temperature=0.0), 1) == [VOCAB - 2 - 2 * MAX_REFUSALS]


def test_a_dead_end_keeps_the_grammars_row():
    """Every allowed token refused: the eager row is the grammar's, and its draw stands."""
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)
    assert _settled(logits, set(range(VOCAB)), SamplingParams(temperature=0.0), 1) == [VOCAB - 1]


@pytest.mark.parametrize(
    ("params", "lazy"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.0, top_p=0.5), True),  # greedy ignores the filters
        (SamplingParams(temperature=1.0), True),
        (SamplingParams(temperature=1.0, top_k=5), False),
        (SamplingParams(temperature=1.0, top_p=0.9), False),
        (SamplingParams(temperature=1.0, min_p=0.1), False),
        (SamplingParams(temperature=0.0, logprobs=2), False),  # logprobs are normalised over the mask
    ],
)
def test_filters_and_logprobs_keep_the_eager_mask(params, lazy):
    assert checks_sampled_token(params) is lazy


CHECKED_SCHEMAS = [
    {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan"]}, "uniqueItems": True, "maxItems": 4},
    {"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 9}},
     "required": ["price"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "additionalProperties": {"type": "integer"}, "maxProperties": 3},  # the key guard too (specification mode)
]  # fmt: skip


def _generate_both_ways(tiny, monkeypatch, schema: dict, sampling: dict) -> tuple[list[list[int]], int]:
    """Token ids of 4 completions with the checks on the drawn token, then with every row checked eagerly;
    and how many draws the first way refused."""
    import constrain
    from constrain.decode import checked, loop, masks

    refused = [0]

    def counted(*args, **kwargs):
        refused[0] += checked.settle(*args, **kwargs)
        return 0

    constraint = constrain.json_schema(schema, mode="specification")
    outputs = []
    for eager in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(loop, "settle", counted)
            if eager:
                patch.setattr(masks, "checks_sampled_token", lambda params: False)
            results = constrain.generate(tiny, ["a", "b", "cc", "ddd"], schema=constraint, max_tokens=40, **sampling)
        for result in results:
            assert result.violations == [] or result.finish_reason == "length", result
        outputs.append([r.token_ids for r in results])
    return outputs, refused[0]


@pytest.mark.parametrize("schema", CHECKED_SCHEMAS)
def test_greedy_decoding_writes_the_same_tokens_either_way(tiny, monkeypatch, schema):
    (lazy, eager), _ = _generate_both_ways(tiny, monkeypatch, schema, {"temperature": 0})
    assert lazy == eager


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_draws_are_refused_and_redrawn_in_the_loop(tiny, monkeypatch, sampling):
    """Three distinct items of three values: every second or third item the model draws is refused (or found
    heading nowhere by the look-ahead), redrawn, and the outputs end valid."""
    (lazy, eager), refused = _generate_both_ways(tiny, monkeypatch, CHECKED_SCHEMAS[0], sampling)
    assert refused > 0
    if not sampling.get("seed"):
        assert lazy == eager
