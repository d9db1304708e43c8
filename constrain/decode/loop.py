"""The decode loop: forward -> grammar bitmask -> sampler -> stop criteria -> detokenize.

A :class:`DecodeLoop` runs one batch: every step does one forward for the whole batch (transformers'
KV cache), one batched bitmask fill for the constrained rows, and one sampler call. Requests join
between steps (their prompts are prefilled in the step they join, in groups of similar length or
after a prefix another prompt left in the :class:`~constrain.decode.kv.PrefixCache`, and their KV cache
is merged into the batch's) and leave as soon as they finish or are cancelled: continuous batching,
for a server. :func:`run` decodes a fixed set of requests to the end.

The stages live beside it: the per-request state machine in :mod:`constrain.decode.request`, the
masks in :mod:`constrain.decode.masks`, the drafts in :mod:`constrain.decode.drafts`, the KV cache's
reuse and merging in :mod:`constrain.decode.kv`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from constrain.decode.checked import CheckedSlot, settle
from constrain.decode.drafts import MAX_DRAFT, feedable, next_drafts, resolve_proposer
from constrain.decode.kv import PrefixCache, growing, merge_rows, mergeable, prefill_groups
from constrain.decode.masks import SlotMasks, slot_masks
from constrain.decode.request import InFlight
from constrain.decode.speculative import Acceptance, Drafts, Proposer, plan_drafts, probe_width, shortening
from constrain.models import cost
from constrain.models.loading import ModelHandle
from constrain.sampler import Sampler, SamplingBatch, SamplingParams

__all__ = ["DecodeLoop", "project_only", "run"]

log = logging.getLogger("constrain.decode.loop")


class _Clock:
    """Adds the seconds spent in each stage to ``totals`` (a no-op without it)."""

    def __init__(self, totals: dict[str, float] | None) -> None:
        self.totals = totals
        self._stage = ""
        self._start = 0.0

    def __call__(self, stage: str) -> _Clock:
        self._stage = stage
        return self

    def __enter__(self) -> None:
        if self.totals is not None:
            self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.totals is not None:
            self.totals[self._stage] = self.totals.get(self._stage, 0.0) + time.perf_counter() - self._start


class DecodeLoop:
    """A running batch of :class:`InFlight` requests, advanced one forward pass per :meth:`step`.

    Not thread-safe: one thread owns the loop (a server's engine thread hands it requests between
    steps). Requests added with :meth:`add` join at the next step; finished and cancelled ones leave
    the batch and the cache at once. With a cache that cannot be merged (sliding-window layers, as in
    Gemma 3), new requests wait until the running batch has drained.

    ``jump_forward``: after each token, the text the grammar forces next (``{"name": "``, a closing
    quote) is tokenized and fed in the same forward pass as drafts; the sampler then runs at every
    draft position exactly as plain decoding would (same masks, history and seeded draws), and a
    draft counts only when the sampled token equals it. The output is therefore that of plain
    decoding, token for token (up to the last bits of the logits, which differ between a one-token
    and a many-token forward pass and could flip an exact tie), while one forward pass covers the
    forced stretch. Rejected drafts stay in the KV cache, masked out of attention.

    ``speculative``: where nothing is forced, draft with a :class:`~constrain.decode.speculative.Proposer`
    (``True``, the default: :class:`~constrain.decode.speculative.NgramProposer`, prompt lookup), pruned by
    the grammar, verified the same way. Drafts are deterministic, so "accept while the sampled token
    equals the draft" accepts with the probability rejection sampling would (p of the draft) and emits
    exactly plain decoding's distribution (its very tokens, for seeded requests). Each step feeds only
    the drafts that pay (:func:`~constrain.decode.speculative.plan_drafts`), from each request's acceptance so
    far and ``forward_cost`` (default: the model's, measured once per machine and saved:
    :func:`~constrain.models.cost.forward_cost`); the drafts of requests added together (a ``generate`` call's,
    which ends with its slowest) count for the share that shortens the slowest
    (:func:`~constrain.decode.speculative.shortening`).

    ``overlap``: fill the grammar masks on a worker thread while the forward pass runs (xgrammar and
    llguidance release the GIL), so that the mask costs nothing on the critical path. Default: when
    the model is not on the CPU; on the CPU the thread competes with the forward for the same cores
    (measured with SmolLM2 on 2 cores, batch 8: the mask wait fell from 0.65 to 0.02 ms a step and the
    forward rose by 1.6 ms). The loop owns that thread: :meth:`close` it (or use the loop as a context
    manager) when done.

    ``timings`` collects seconds per stage (forward, mask, sampler, checks, stop+detokenize).

    ``prefix_cache_bytes``: the bound on the KV of recent prompts kept for reuse
    (:class:`~constrain.decode.kv.PrefixCache`; default None: sized to the machine, at most 512 MiB; 0: none).

    One request never breaks another: an exception while masking, sampling, checking or advancing one
    row (detokenizing, stop strings, its ``on_event``) ends that row alone (:meth:`InFlight.fail
    <constrain.decode.request.InFlight.fail>`: ``finish_reason="error"``, the exception in ``fault``, logged
    with its ``request_id``); the rest of the step runs again without it, so its neighbours write what
    they would have written. A batched stage that fails is retried row by row to find the culprit: the
    cost falls on the failing step only. What cannot be told apart by row (the forward pass: out of
    memory) propagates from :meth:`step`.

    Value checks (keywords beyond the grammar) run on the token drawn where the sampling allows it
    exactly (:mod:`constrain.decode.checked`: greedy, or no top-k, top-p or min-p, no logprobs): the mask
    is then the grammar's, a refused token is cleared and its slot drawn again. Elsewhere the mask is
    checked eagerly. Either way the output's distribution is the exact mask's.
    """

    def __init__(
        self,
        handle: ModelHandle,
        timings: dict[str, float] | None = None,
        *,
        overlap: bool | None = None,
        jump_forward: bool = True,
        speculative: bool | Proposer = True,
        forward_cost: cost.ForwardCost | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        self.handle = handle
        self.clock = _Clock(timings)
        self.proposer = resolve_proposer(handle, speculative)
        self.forward_cost = forward_cost
        self.jump_forward = jump_forward
        self.device = next(handle.model.parameters()).device
        self.overlap = self.device.type != "cpu" if overlap is None else overlap
        # with overlap: the thread that fills the masks during the forward pass (stopped by close())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="constrain-masks") if self.overlap else None
        tokenizer = handle.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else handle.eos_token_ids[0]
        self.sampler = Sampler()
        self.sampling = SamplingBatch(handle.vocab_size, device=self.device)  # the rows' sampling tensors, kept
        forward_args = inspect.signature(handle.model.forward).parameters
        # a prompt's logits are needed at its last position only ([B, T, V] would dominate the prefill)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._cache_keyword = cost.cache_keyword(handle.model)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self._groups = itertools.count()  # labels of the requests added together
        self._merges = False  # whether the model's cache takes joining rows (learnt at the first prefill)
        self.active: list[InFlight] = []  # the rows of the cache, in order
        self.joining: list[InFlight] = []
        self._drafts: list[list[int]] = []  # per active row: the drafts fed after its last token
        self._proposed: list[int] = []  # per active row: how many of its drafts came from the proposer
        self._cache: Any = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [b, T]: 0 = padding or rejected draft
        self._input_ids = self._mask  # [b, width]: each row's last token and drafts, for the next forward
        self._positions = self._mask  # [b, width]

    def close(self) -> None:
        """Stop the mask worker thread (with ``overlap``), after the fill in progress if any. Idempotent;
        a closed loop still steps, filling the masks on the stepping thread. ``with DecodeLoop(...) as loop:``
        closes it at the end of the block."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> DecodeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, without special tokens (forced text, for drafts)."""
        return list(self.handle.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of token ids ``ids`` (drafts, for the repetition guard and mask filters)."""
        return str(self.handle.tokenizer.decode(ids))

    @property
    def busy(self) -> bool:
        """Whether any request is running or waiting to join."""
        return bool(self.active or self.joining)

    def add(self, requests: Sequence[InFlight], *, together: bool = False) -> None:
        """Queue ``requests`` to join the batch at the next step (their acceptance starts at the
        proposer's prior). Each must be started (:meth:`InFlight.start <constrain.decode.request.InFlight.start>`,
        which admission calls), else ``ValueError``. ``together``: the caller waits for all of them (a
        ``generate`` call), so their drafts count for the share that shortens the slowest of them
        (:func:`~constrain.decode.speculative.shortening`); default: each on its own (a server's)."""
        if not all(r.started for r in requests):
            raise ValueError("a request joins the loop after InFlight.start() (constrain.generation.admit calls it)")
        group = next(self._groups) if together and len(requests) > 1 else None
        for r in requests:
            r.group = group
            if self.proposer is not None:
                r.acceptance = Acceptance(prior=self.proposer.acceptance_prior)
        self.joining.extend(requests)

    def cancel(self, request: InFlight) -> None:
        """End ``request`` now (``finish_reason="cancelled"``); it leaves the batch at the next step."""
        if request.finish_reason is None:
            request.finish("cancelled")
        if request in self.joining:
            self.joining.remove(request)

    def step(self) -> None:
        """One forward pass for the running rows and the prefill of the joining ones, then the masks,
        one sampler call, stop criteria and detokenization for every row."""
        running = [i for i, r in enumerate(self.active) if r.finish_reason is None]
        if len(running) < len(self.active):  # cancelled rows leave, with their prepared inputs
            index = torch.tensor(running, device=self.device, dtype=torch.long)
            self._input_ids, self._positions = self._input_ids[index], self._positions[index]
            self._select(running)
        joining: list[InFlight] = []
        plan: list[tuple[list[InFlight], int]] = []
        if self.joining and (not self.active or mergeable(self._cache)):
            plan = self._prefill_plan([r for r in self.joining if r.finish_reason is None])
            if not self.active and not self._merges:  # one group, until a cache shows it takes more
                plan = plan[:1]  # (sliding-window layers do not: the others wait for the batch to drain)
            joining = [r for group, _ in plan for r in group]
            taken = {id(r) for r in joining}
            self.joining = [r for r in self.joining if r.finish_reason is None and id(r) not in taken]
        rows, drafts = self.active + joining, self._drafts + [[] for _ in joining]
        if not rows:
            return
        with torch.inference_mode():
            # the masks depend only on the tokens so far: fill them beside the forward pass
            pool = self._pool
            pending = pool.submit(self._masks, rows, drafts) if pool is not None else None
            with self.clock("forward"):
                logits = self._forward(plan)  # [P, V]: every slot's next-token logits
            with self.clock("mask"):  # with overlap: what is left of the fill once the forward is done
                masks = pending.result() if pending is not None else self._masks(rows, drafts)
            with self.clock("sampler"):
                histories = [(rows[i], drafts[i][:j]) for i, d in enumerate(drafts) for j in range(len(d) + 1)]
                # the sampler may overwrite its logits: the checked slots' are kept for a second draw
                kept = logits[[c.slot for c in masks.checked]] if masks.checked else None  # [k, V]
                sampled = self._sample_all(histories, logits, masks)
                tokens = sampled.token_ids.tolist()
            if kept is not None:
                with self.clock("checks"):
                    self._settle(masks, kept, histories, tokens)
            with self.clock("stop+detokenize"):
                keep = self._advance(tokens, sampled.logprobs)
            self._select(keep)
            if self.active:
                self._next_inputs()

    def _isolate(self, rows: Sequence[InFlight], stage: str, attempt: Callable[[InFlight], object]) -> bool:
        """After a batched stage failed: ``attempt(row)`` for each live row alone, failing the rows that raise
        (:meth:`_fail`). Returns whether any row failed (else the fault is not one row's)."""
        failed = False
        for r in rows:
            if r.finish_reason is None:
                try:
                    attempt(r)
                except Exception as err:
                    self._fail(r, err, stage)
                    failed = True
        return failed

    @staticmethod
    def _fail(r: InFlight, err: BaseException, stage: str) -> None:
        """End row ``r`` alone after ``err`` in ``stage`` (logged with its request id)."""
        log.error("request %s failed while %s; its batch goes on", r.request_id or hex(id(r)), stage, exc_info=err)
        r.fail(err, stage)

    def _masks(self, rows: list[InFlight], drafts: list[list[int]]) -> SlotMasks:
        """:func:`~constrain.decode.masks.slot_masks` of the step; where it raises, the rows that raise alone
        fail and the others' masks are filled again (a failed row's slots get no mask row)."""
        vocab, decode = self.handle.vocab_size, self.decode
        try:
            return slot_masks(rows, drafts, vocab, decode)
        except Exception:
            index = {id(r): i for i, r in enumerate(rows)}
            if not self._isolate(rows, "masking", lambda r: slot_masks([r], [drafts[index[id(r)]]], vocab, decode)):
                raise
        return slot_masks(rows, drafts, vocab, decode)

    def _sample_all(
        self,
        histories: list[tuple[InFlight, list[int]]],
        # [P, V] float: every slot's logits; a failed row's are zeroed (in place) before the retry
        logits: torch.Tensor,
        masks: SlotMasks,
    ) -> Any:
        """One sampler call for every slot; where it raises, the rows whose slots raise alone fail, and the
        call runs again with their slots neutral (zero logits, no mask, greedy), their tokens then unused."""
        device = self.device

        def call(slots: list[int], hist: list[tuple[Any, list[int]]]) -> Any:
            if len(slots) == len(histories):  # every slot (the common case: no copy of the bitmask)
                bitmask = masks.bitmask.to(device) if masks.bitmask is not None else None
                return _sample(self.sampler, self.sampling, hist, logits, bitmask, masks.slots, sync=True)
            position = {slot: k for k, slot in enumerate(slots)}
            rows = [k for k, slot in enumerate(masks.slots) if slot in position]  # their bitmask rows
            bitmask = masks.bitmask[rows].to(device) if masks.bitmask is not None and rows else None
            # slots and bitmask rows keep their order, so row k of the bitmask is slot position[masks.slots[k]]
            index = [position[masks.slots[k]] for k in rows]
            return _sample(self.sampler, self.sampling, hist, logits[slots], bitmask, index)

        every = list(range(len(histories)))
        try:
            return call(every, list(histories))
        except Exception:
            owned: dict[int, list[int]] = {}
            for slot, (r, _) in enumerate(histories):
                owned.setdefault(id(r), []).append(slot)
            rows = list({id(r): r for r, _ in histories}.values())
            if not self._isolate(rows, "sampling", lambda r: call(owned[id(r)], [histories[k] for k in owned[id(r)]])):
                raise
        idle = [k for k, (r, _) in enumerate(histories) if r.finish_reason is not None]
        logits[idle] = 0.0
        return call(every, [(_IDLE, []) if r.finish_reason is not None else (r, extra) for r, extra in histories])

    def _settle(
        self,
        masks: SlotMasks,
        # [k, V]: the logits of the slots in masks.checked, in order, as the forward computed them
        logits: torch.Tensor,
        histories: list[tuple[InFlight, list[int]]],
        # per slot: the tokens drawn; updated in place
        tokens: list[int],
    ) -> None:
        """Check each checked slot's token; draw refused ones again (:func:`~constrain.decode.checked.settle`).
        Where a row's value check raises, that row fails and the others settle."""
        assert masks.bitmask is not None
        bitmask = masks.bitmask

        def run(checked: list[CheckedSlot], kept: torch.Tensor) -> None:  # kept: [len(checked), V]
            at = {c.row: k for k, c in enumerate(checked)}  # mask row -> its row of ``kept``

            def redraw(mask_rows: list[int], draw: int) -> list[int]:
                index = [at[row] for row in mask_rows]
                again = [histories[masks.slots[row]] for row in mask_rows]
                rows = bitmask[mask_rows].to(self.device)  # [n, ceil(V / 32)]: refused bits cleared
                out = _sample(self.sampler, self.sampling, again, kept[index], rows, list(range(len(mask_rows))),
                              draw=draw)  # fmt: skip
                return list(out.token_ids.tolist())

            settle(checked, tokens, bitmask, redraw)

        try:
            run(masks.checked, logits)
            return
        except Exception:
            owner = {c.slot: histories[c.slot][0] for c in masks.checked}
            checked = {id(r): [c for c in masks.checked if owner[c.slot] is r] for r in owner.values()}

            def check(r: InFlight) -> None:
                for c in checked[id(r)]:
                    c.matcher.allows(max(tokens[c.slot], 0), c.filled)
                    c.matcher.check_row(c.filled.clone())

            if not self._isolate(list(owner.values()), "checking values", check):
                raise
        live = [k for k, c in enumerate(masks.checked) if histories[c.slot][0].finish_reason is None]
        run([masks.checked[k] for k in live], logits[live])

    def _prefill_plan(self, joining: list[InFlight]) -> list[tuple[list[InFlight], int]]:
        """How to prefill ``joining``: (group, cached prefix length). A request whose prompt starts with
        :data:`~constrain.decode.kv.MIN_PREFIX` or more tokens of a prompt prefilled before is prefilled
        alone, after that prefix (its KV copied from the :class:`~constrain.decode.kv.PrefixCache`); the
        others by prompt length, in groups of similar lengths (:func:`~constrain.decode.kv.prefill_groups`)."""
        hits = [(r, self.prefixes.match(r.prompt_ids)) for r in joining]
        rest = sorted((r for r, n in hits if n == 0), key=lambda r: len(r.prompt_ids))
        return [([r], n) for r, n in hits if n] + [(group, 0) for group in prefill_groups(rest)]

    def _forward(self, plan: list[tuple[list[InFlight], int]]) -> torch.Tensor:  # [P, V]
        """Run the running rows' step and the joining rows' prefill; merge the joiners into the batch."""
        model, parts = self.handle.model, []
        if self.active:
            slots = None  # every position is a slot (no row is padded) unless drafts differ in length
            if sum(len(d) + 1 for d in self._drafts) < self._input_ids.numel():
                slot_row = [i for i, d in enumerate(self._drafts) for _ in range(len(d) + 1)]
                slot_col = [j for d in self._drafts for j in range(len(d) + 1)]
                slots = (torch.tensor(slot_row, device=self.device), torch.tensor(slot_col, device=self.device))
            with project_only(model, slots) as projected:
                out = model(input_ids=self._input_ids, attention_mask=self._mask, position_ids=self._positions,
                            use_cache=True, **{self._cache_keyword: self._cache})  # fmt: skip
            self._cache = getattr(out, self._cache_keyword)
            if projected:
                parts.append(out.logits[0])  # [P_running, V]
            else:
                parts.append(out.logits.flatten(0, 1) if slots is None else out.logits[slots])  # [P_running, V]
        for group, cached in plan:
            width = max(len(r.prompt_ids) for r in group)
            ids = [[self.pad] * (width - len(r.prompt_ids)) + r.prompt_ids[cached:] for r in group]
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group],
                                device=self.device)  # fmt: skip  # [g, width]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]  # [g, width - cached]: padding shifts none
            past = self.prefixes.cache(group[0].prompt_ids, cached) if cached else None
            out = model(input_ids=torch.tensor(ids, device=self.device), attention_mask=mask, position_ids=positions,
                        use_cache=True, **{self._cache_keyword: past}, **self._last_only)  # fmt: skip
            parts.append(out.logits[:, -1])  # [g, V]
            cache = getattr(out, self._cache_keyword)
            self._merges = mergeable(cache)
            if self._merges:
                self.prefixes.add([r.prompt_ids for r in group], cache)
            if self.active:
                self._mask = merge_rows(self._cache, self._mask, cache, mask)
            else:
                self._cache, self._mask = growing(cache), mask
            self.active, self._drafts = self.active + group, self._drafts + [[] for _ in group]
            self._proposed += [0] * len(group)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _advance(self, tokens: list[int], logprobs: Any) -> list[int]:
        """Feed each row its sampled tokens (the first, then each one that confirms its draft); mask out
        of attention the drafts that did not happen. Returns the rows still running."""
        keep, rejected = [], []  # rejected: (row, first block column whose draft is not kept)
        slot = 0
        for i, r in enumerate(self.active):
            finished, confirmed, drafts = r.finish_reason is not None, len(self._drafts[i]), self._drafts[i]
            try:
                for j in range(0 if finished else len(drafts) + 1):
                    token = tokens[slot + j]
                    if r.params.logprobs is not None and logprobs is not None and token >= 0:
                        r.record_logprobs(logprobs, slot + j)
                    finished = r.step(token)
                    if finished or j == len(drafts):
                        break
                    if token != drafts[j] or r.output_ids[-1] != token:
                        confirmed = j  # drafts j+1.. were computed on a history that did not happen
                        break
            except Exception as err:
                self._fail(r, err, "advancing")
                finished = True
            slot += len(drafts) + 1
            if not finished:
                keep.append(i)
                r.acceptance.observe(self._proposed[i], min(confirmed, self._proposed[i]))
                if confirmed < len(drafts):
                    rejected.append((i, confirmed + 1))
        width = 1 + max((len(d) for d in self._drafts), default=0)
        for i, first in rejected:
            self._mask[i, self._mask.shape[1] - width + first :] = 0
        if rejected and mergeable(self._cache):  # drop the block's last columns that every row rejected
            attended = self._mask[:, -width:].any(0).nonzero()  # [n, 1]: the block's columns some row attends to
            unused = width - (int(attended[-1]) + 1 if len(attended) else 0)
            if unused:
                self._cache.crop(-unused)
                self._mask = self._mask[:, :-unused]  # [b, T - unused]
        return keep

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch and its cache."""
        if len(keep) == len(self.active):
            return
        if keep:
            index = torch.tensor(keep, device=self.device)
            self._cache.batch_select_indices(index)
            self._mask = self._mask[index]
        else:
            self._cache, self._mask = None, self._mask[:0, :0]
        self.active = [self.active[i] for i in keep]
        self._drafts = [self._drafts[i] for i in keep]
        self._proposed = [self._proposed[i] for i in keep]

    def _next_inputs(self) -> None:
        """Each row's last token and its drafts for the next forward pass: forced tokens, and the
        proposer's drafts that pay (:func:`~constrain.decode.speculative.plan_drafts`)."""
        relative = self._relative_cost(len(self.active))
        # probing and backing off bound what a wrong draft costs: where a wide pass costs no more, none is due
        probe = probe_width(relative, MAX_DRAFT) if self.proposer is not None else None
        drafts = [self._next_drafts(r, probe) for r in self.active]
        forced = [len(d) if is_forced else 0 for d, is_forced in drafts]
        offered = [0 if is_forced else len(d) for d, is_forced in drafts]
        rates = [r.acceptance.estimate(d.prior) for (d, _), r in zip(drafts, self.active, strict=True)]
        runs = [r.acceptance.estimate_run(d.run, d.prior) for (d, _), r in zip(drafts, self.active, strict=True)]
        weights = self._shortening(forced, offered) if any(offered) else None  # (no offer: nothing to weigh)
        planned = plan_drafts(forced, offered, rates, relative, runs, weights)
        # the grammar prunes only what is planned (a proposal's tokens cost an accept each)
        self._drafts = [d if is_forced else self._feedable(r, d[:n])
                        for (d, is_forced), r, n in zip(drafts, self.active, planned, strict=True)]  # fmt: skip
        self._proposed = [0 if is_forced else len(d) for d, (_, is_forced) in zip(self._drafts, drafts, strict=True)]
        width = 1 + max(len(d) for d in self._drafts)
        self._input_ids = torch.tensor(  # [b, width]: the last token, its drafts, padding
            [[r.output_ids[-1], *d] + [self.pad] * (width - 1 - len(d)) for r, d in zip(self.active, self._drafts,
                                                                                          strict=True)],
            device=self.device,
        )  # fmt: skip
        block = self._mask.new_tensor([[1] * (1 + len(d)) + [0] * (width - 1 - len(d)) for d in self._drafts])
        self._positions = self._mask.sum(-1, keepdim=True) + torch.arange(width, device=self.device)  # [b, width]
        self._mask = torch.cat([self._mask, block], dim=1)  # [b, T + width]

    def _shortening(self, forced: list[int], offered: list[int]) -> list[float] | None:
        """Per running row, :func:`~constrain.decode.speculative.shortening` of the rows added together with
        it, given what each is fed or offered this pass (1 for a row on its own); None where every row is
        on its own."""
        kept: dict[int, list[int]] = {}
        moving: dict[int, int] = {}
        for r, f, o in zip(self.active, forced, offered, strict=True):
            if r.group is not None:
                kept.setdefault(r.group, []).append(r.acceptance.kept)
                moving[r.group] = moving.get(r.group, 0) + (f > 0 or o > 0)
        if not kept:
            return None
        share = {group: shortening(counts, moving[group]) for group, counts in kept.items()}
        return [1.0 if r.group is None else share[r.group] for r in self.active]

    def _next_drafts(self, r: InFlight, probe: int | None) -> tuple[Drafts, bool]:
        """:func:`~constrain.decode.drafts.next_drafts` of ``r``; where it raises, ``r`` fails (no drafts;
        it leaves the batch at the next step)."""
        try:
            return next_drafts(r, self.encode, self.proposer, jump_forward=self.jump_forward, probe=probe)
        except Exception as err:
            self._fail(r, err, "drafting")
            return Drafts(), False

    def _feedable(self, r: InFlight, ids: list[int]) -> list[int]:
        """:func:`~constrain.decode.drafts.feedable` of ``r``'s planned drafts; where it raises, ``r`` fails
        (no drafts; it leaves the batch at the next step)."""
        if not ids:
            return []
        try:
            return feedable(r, ids)
        except Exception as err:
            self._fail(r, err, "drafting")
            return []

    def _relative_cost(self, batch: int) -> Callable[[int], float]:
        """The cost of a pass of ``batch`` rows by its width, against one token per row: the given
        :class:`~constrain.models.cost.ForwardCost`, else the model's for this batch size
        (:func:`~constrain.models.cost.forward_cost`: timed once per machine on the batch's rows, up to the
        widest pass a row may feed, where the context window allows. A table that stops at its knee reads
        wider passes in proportion to the tokens, and on an AVX2 CPU, where a one-token pass is a cheap
        matrix-vector product, that knee comes at 3 tokens). The table is looked up at the first call only:
        a step with no choice to make measures nothing."""
        table: cost.ForwardCost | None = self.forward_cost

        def relative(width: int) -> float:
            nonlocal table
            if table is None:
                table = cost.forward_cost(self.handle.model, batch=batch, width=1 + MAX_DRAFT)
            return table.relative(batch, width)

        return relative


@contextlib.contextmanager
def project_only(
    model: Any,
    # ([P] long, [P] long): the (row, column) of each slot whose logits are needed, or None for all
    slots: tuple[torch.Tensor, torch.Tensor] | None,
) -> Iterator[bool]:
    """Within the block, the model's output layer sees only the hidden states of ``slots`` (its logits
    come out as ``[1, P, V]``), so that padding in a block of drafts costs no vocabulary projection.
    Yields whether it applies (a model without an output-embedding module computes every position).
    Only this thread's forward passes are changed (a server's beam search runs the model beside the loop)."""
    head = model.get_output_embeddings() if slots is not None else None
    if head is None:
        yield False
        return
    owner = threading.get_ident()

    def gather(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if threading.get_ident() != owner:
            return None
        hidden = args[0]  # [B, T, H]
        return (hidden[slots].unsqueeze(0), *args[1:])  # [1, P, H]

    hook = head.register_forward_pre_hook(gather)
    try:
        yield True
    finally:
        hook.remove()


def run(
    handle: ModelHandle,
    requests: list[InFlight],
    timings: dict[str, float] | None = None,
    *,
    overlap: bool | None = None,
    jump_forward: bool = True,
    speculative: bool | Proposer = True,
    forward_cost: cost.ForwardCost | None = None,
    cancelled: threading.Event | None = None,
    together: bool = True,
) -> None:
    """Decode every request to its end, as one batch (see :class:`DecodeLoop` for the options); once
    ``cancelled`` is set (from any thread), the requests still running end as ``"cancelled"``. ``together``
    (default): the caller waits for them all (:meth:`DecodeLoop.add`); False: drafts are planned for each
    on its own."""
    with DecodeLoop(handle, timings, overlap=overlap, jump_forward=jump_forward, speculative=speculative,
                    forward_cost=forward_cost) as loop:  # fmt: skip
        loop.add(requests, together=together)
        while loop.busy:
            if cancelled is not None and cancelled.is_set():
                for r in requests:
                    loop.cancel(r)
            loop.step()


@dataclass(frozen=True)
class _Idle:
    """A failed row's slots in a sampler call's retry: greedy, no penalties (their tokens are unused)."""

    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


_IDLE: Any = _Idle()


def _sample(
    sampler: Sampler,
    batch: SamplingBatch,
    histories: list[tuple[InFlight, list[int]]],
    # [P, V] float: one row per slot; overwritten (the loop's own logits)
    logits: torch.Tensor,
    # [c, ceil(V / 32)] int32 or None
    bitmask: torch.Tensor | None,
    rows: list[int],
    *,
    sync: bool = False,
    draw: int = 0,
) -> Any:
    """One sampler call for every slot: its request's parameters, and its history (output + drafts);
    ``draw`` > 0 draws those slots again, with fresh randomness.

    The requests' sampling tensors persist in ``batch`` (:class:`~constrain.sampler.SamplingBatch`): they
    are rebuilt only when requests join or leave, and each step appends the tokens the rows took, so a step
    costs O(rows) Python, not O(rows x history). ``sync`` (the step's call for every slot) makes the slots'
    requests the batch's rows; other calls (redraws, the retries that isolate a failing row) take rows the
    batch holds, updating it only if it does not hold them all."""
    requests = list({id(r): r for r, _ in histories}.values())
    if sync or not batch.holds(requests):
        batch.update(requests)
    metadata = batch.metadata(
        slots=[(batch.row(r), extra) for r, extra in histories],
        token_bitmask=bitmask,
        bitmask_rows=rows if rows else None,
        draw=draw,
    )
    return sampler(logits, metadata)
