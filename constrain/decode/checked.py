"""The sampled token's checks: the value checks run on the token drawn, not on every candidate.

A slot whose row was filled without its value checks (``Matcher.fill_next_token_bitmask(checks=False)``)
holds the grammar's mask, a superset of the exact one. Its drawn token is asked about
(:meth:`Matcher.allows <constrain.match.matcher.Matcher.allows>`); a refused token's bit is cleared and the
slot drawn again, with fresh randomness. After :data:`MAX_REFUSALS` refusals, or once every token is
refused, the slot's row is checked eagerly (:meth:`Matcher.check_row <constrain.match.matcher.Matcher.check_row>`:
the exact row) and drawn from a last time.

Why the distribution is exactly the eager mask's: without a filter that depends on the other tokens
(top-k, top-p, min-p) a draw is proportional to each allowed token's weight, so a draw conditioned on
not being one of the refused tokens is a draw from the mask without them; the eager row is that mask. A
greedy slot takes the argmax of the row left, which is the argmax of the exact row. Where a filter
applies, or logprobs are asked (normalised over the mask), the row is checked eagerly before sampling
(:func:`checks_sampled_token`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from constrain.match.bitmask import clear_bits
from constrain.match.matcher import Matcher
from constrain.sampler import SamplingParams

__all__ = ["MAX_REFUSALS", "CheckedSlot", "checks_sampled_token", "settle"]

MAX_REFUSALS = 3
"""Per slot and step, refused draws before its row is checked eagerly and drawn from a last time."""


@dataclass(frozen=True, slots=True)
class CheckedSlot:
    """A slot whose value checks wait for its drawn token."""

    slot: int  # the sampler's row
    row: int  # its row of the step's bitmask
    matcher: Matcher  # the grammar state at the slot
    filled: torch.Tensor  # [ceil(V / 32)] int32 on the CPU: the row as filled and guarded, unchecked (a copy)


def checks_sampled_token(params: SamplingParams) -> bool:
    """Whether a slot sampled with ``params`` may leave its value checks to the drawn token (exact:
    greedy, or sampling without top-k, top-p or min-p, and no logprobs asked)."""
    unfiltered = params.top_k is None and params.top_p >= 1.0 and params.min_p <= 0.0
    return params.logprobs is None and (params.greedy or unfiltered)


def settle(
    checked: list[CheckedSlot],
    # per slot, the token drawn (-1: none allowed); updated in place
    tokens: list[int],
    # [c, ceil(V / 32)] int32 on the CPU: the step's rows; a refused token's bit is cleared in place
    bitmask: torch.Tensor,
    redraw: Callable[[list[int], int], list[int]],
) -> int:
    """Check each ``checked`` slot's token; draw refused slots again until every token stands.

    ``redraw(rows, draw)`` draws the slots of bitmask ``rows`` again, from the rows as they are now and
    with the randomness of draw number ``draw`` (1, 2, ...), and returns their tokens in that order.
    Mutates ``tokens`` and ``bitmask``; returns how many draws were refused.
    """
    refusals = [0] * len(checked)
    exact = [False] * len(checked)  # the row was checked eagerly: what is drawn from it stands
    pending, draw = list(range(len(checked))), 0
    while pending:
        again = []
        for k in pending:
            slot = checked[k]
            token = tokens[slot.slot]
            if exact[k] or (token >= 0 and slot.matcher.allows(token, slot.filled)):
                continue
            refusals[k] += 1
            row = bitmask[slot.row]  # [ceil(V / 32)] int32, a view
            if token < 0 or refusals[k] > MAX_REFUSALS:  # every token refused, or many: the exact row
                row.copy_(slot.filled)
                slot.matcher.check_row(row)
                exact[k] = True
            else:
                clear_bits(row.numpy(), [token])
            again.append(k)
        if not again:
            break
        draw += 1
        for k, token in zip(again, redraw([checked[k].row for k in again], draw), strict=True):
            tokens[checked[k].slot] = token
        pending = again
    return sum(refusals)
