"""The grammar-mask stage of a decode step: one bitmask row per constrained slot.

A slot is a position whose next-token logits a forward pass computes: a request's last token, or
one of its drafts (:mod:`constrain.decode.drafts`). Each slot's row is its matcher's mask after the
drafts before it, then the repetition guard's and the constraint's :class:`~constrain.decode.request.MaskFilter`
applied, then the value checks: eagerly, or (where sampling allows it, :mod:`constrain.decode.checked`)
on the token drawn only; a thinking request's row is its :class:`~constrain.decode.reasoning.Thinking`'s.
The :class:`~constrain.decode.loop.DecodeLoop` may run this on a worker thread beside the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from constrain.decode.checked import CheckedSlot, checks_sampled_token
from constrain.decode.reasoning import Thinking
from constrain.decode.request import InFlight, MaskFilter
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import Matcher, fill_next_token_bitmasks
from constrain.match.repetition import RepetitionGuard

__all__ = ["SlotMasks", "slot_masks"]


@dataclass(frozen=True, slots=True)
class SlotMasks:
    """A step's masks: one bitmask row per constrained slot."""

    slots: list[int]  # per bitmask row, its slot
    bitmask: torch.Tensor | None  # [c, ceil(V / 32)] int32 on the CPU; None when no slot is constrained
    checked: list[CheckedSlot]  # the slots whose value checks wait for the token drawn


def slot_masks(
    active: list[InFlight],
    drafts: list[list[int]],
    vocab: int,
    decode: Callable[[list[int]], str],
) -> SlotMasks:
    """The bitmasks of every constrained slot: slot ``(i, j)`` is row ``i`` after its first ``j`` drafts
    (slots numbered row by row), repetition guard and mask filter applied, then its value checks: left
    to the token drawn where its sampling parameters allow (:func:`~constrain.decode.checked.checks_sampled_token`),
    else eager; a thinking row's mask is its :class:`~constrain.decode.reasoning.Thinking`'s.

    Parameters
    ----------
    active : the batch's requests, in row order
    drafts : per request, the draft tokens fed after its last token (``[]``: none)
    vocab : the logits' width V
    decode : token ids to text (the guard and the mask filter see the drafts' text)

    Returns
    -------
    The slot number of each constrained slot (a row of the bitmask), the bitmask, and the slots whose
    checks wait for the token drawn. Changes no matcher (drafts go to forks).
    """
    matchers: list[tuple[int, Matcher]] = []  # (mask row, the matcher at that slot)
    lazy: list[bool] = []  # per mask row: its value checks wait for the token drawn
    thinking: list[tuple[int, Thinking]] = []  # (mask row, the row's thinking)
    slots: list[int] = []
    guarded: list[tuple[int, RepetitionGuard, str]] = []  # (mask row, the row's guard, its recent text)
    filtered: list[tuple[int, MaskFilter, str]] = []  # (mask row, the row's filter, its drafts' text)
    slot = 0
    for i, r in enumerate(active):
        if r.finish_reason is not None:  # ended in this step (its fault): its slots are not sampled from
            slot += len(drafts[i]) + 1
            continue
        if r.thinking is not None and r.thinking.open:  # (no drafts while thinking)
            thinking.append((len(slots), r.thinking))
            slots.append(slot)
            lazy.append(False)
            slot += 1
            continue
        state = r.matcher
        for j in range(len(drafts[i]) + 1):
            if state is not None:
                if j:
                    state = state.fork()
                    state.accept_token(drafts[i][j - 1])
                if r.guard is not None:
                    guarded.append((len(slots), r.guard, r.generated + decode(drafts[i][:j]) if j else r.generated))
                if r.mask_filter is not None:
                    filtered.append((len(slots), r.mask_filter, decode(drafts[i][:j]) if j else ""))
                matchers.append((len(slots), state))
                slots.append(slot)
                lazy.append(checks_sampled_token(r.params))
            slot += 1
    if not slots:
        return SlotMasks(slots, None, [])
    bitmask = allocate_token_bitmask(len(slots), vocab)
    if matchers and not thinking:
        fill_next_token_bitmasks([m for _, m in matchers], bitmask, checks=False)
    elif matchers:
        filled = allocate_token_bitmask(len(matchers), vocab)  # [m, ceil(V / 32)]
        fill_next_token_bitmasks([m for _, m in matchers], filled, checks=False)
        bitmask[[k for k, _ in matchers]] = filled
    for k, thought in thinking:
        thought.fill(bitmask[k])
    by_row = dict(matchers)
    for k, guard, text in guarded:
        guard.apply(text, bitmask[k])
    for k, mask_filter, text in filtered:
        mask_filter.apply(by_row[k], text, bitmask[k])
    checked = []
    for k, matcher in matchers:
        if not matcher.checks_tokens:
            continue
        if lazy[k]:
            checked.append(CheckedSlot(slots[k], k, matcher, bitmask[k].clone()))
        else:
            matcher.check_row(bitmask[k])
    return SlotMasks(slots, bitmask, checked)
