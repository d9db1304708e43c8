"""The running batch's sampling state, kept as tensors between steps (vLLM's ``InputBatch``).

:meth:`SamplingMetadata.build <constrain.sampler.metadata.SamplingMetadata.build>` turns Python lists
of parameters and token histories into tensors on every call: O(B x history) Python work per step,
for rows whose parameters never change. A :class:`SamplingBatch` holds the rows' parameters as
tensors and their histories in padded id tensors, and splits the work by how often it changes:

- **When rows join or leave** (:meth:`SamplingBatch.update` with a different list of requests): the
  per-row tensors (temperature, top-k, top-p, min-p, seeds, penalties), the row groups
  (greedy / window / full), the logit-bias triples and the logprob rows are rebuilt from the rows'
  :class:`~constrain.sampler.params.SamplingParams` (O(B) Python); the rows that stay keep their
  history rows (one gather), a joining row's history is copied in from its lists once.
- **Every step**: the ids each penalised row's output gained since the last update are appended
  (O(new tokens)); the counter-based keys are derived from the rows' output lengths and fresh seeds
  for the rows without one (a few ``[B]`` integer ops); the bitmask is checked and moved to the device.
  With drafts (several slots per row), the per-row tensors are gathered to slots and the drafts
  appended to the slots' histories.

The metadata it returns equals ``SamplingMetadata.build``'s for the same rows, histories, bitmask and
fresh seeds (the same generator state), so that the sampler returns the same tokens and logprobs; the
id tensors of the penalties may be wider (more padding, which the penalty kernels ignore).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .metadata import WINDOW_MAX_K, Penalties, RowFacts, SamplingMetadata, check_bitmask, logprob_rows
from .params import MAX_SEED, SamplingParams
from .rng import row_keys

__all__ = ["SamplingBatch", "SamplingRequest"]

_GREEDY, _WINDOW, _FULL = 0, 1, 2
"""A row's group: argmax, sampled inside its top-k window, sampled over the vocabulary."""


class SamplingRequest(Protocol):
    """What a :class:`SamplingBatch` reads from a request: any object with these attributes (the decode
    loop's :class:`~constrain.decode.request.InFlight`, or a small dataclass)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]:
        """Grows by appending only while the request is held (the batch reads the new tail each update)."""
        ...


@dataclass(slots=True)
class _Row:
    """One held row: its request, what its parameters imply, and how much of its output is in the tensors."""

    request: SamplingRequest
    group: int  # _GREEDY, _WINDOW or _FULL
    penalized: bool
    seen: int  # ids of prompt + output in the history tensors (0 unless penalized)
    out: int  # ids of output in them (0 unless penalized)
    length: int  # output ids read so far: the row's position in its seeded random stream


@dataclass(slots=True)
class _Rows:
    """The per-row tensors, rebuilt when the rows change; ``None`` fields: no row uses the stage."""

    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows
    top_k: torch.Tensor  # [R] int64; vocab_size where disabled
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64 on the CPU; 0 where unseeded
    seeded: torch.Tensor  # [R] bool on the CPU
    repetition: torch.Tensor  # [R] float32, 1 where none
    frequency: torch.Tensor  # [R] float32
    presence: torch.Tensor  # [R] float32
    greedy_rows: torch.Tensor  # [g] int64
    window_rows: torch.Tensor  # [w] int64
    full_rows: torch.Tensor  # [f] int64
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, bias), each [n]
    processed_logprob_rows: torch.Tensor  # [p] int64
    raw_logprob_rows: torch.Tensor  # [r] int64
    max_num_logprobs: int | None  # None: no row wants logprobs
    facts: RowFacts


class SamplingBatch:
    """The rows of a running batch as sampling tensors that persist across steps.

    A step is ``batch.update(requests)`` (the rows, in the logits' order: a no-op but for the new output
    ids when they are the same requests as before), then ``batch.metadata(...)`` for the
    :class:`~constrain.sampler.sampler.Sampler`. See the module docstring for what is rebuilt when.

    Parameters
    ----------
    vocab_size : int
        The logits' last dimension; logit-bias and history ids must be below it.
    device : torch.device or str, default: "cpu"
        Where the logits live (and so the tensors built here).
    generator : torch.Generator, default: None (a CPU generator seeded from the OS's entropy)
        Draws each step's seeds for the rows without one; torch's global random state is neither read
        nor advanced. Given the same generator state, :meth:`metadata` draws what
        ``SamplingMetadata.build(generator=...)`` draws.

    Notes
    -----
    Not thread-safe: one thread owns a batch (a decode loop's). Holds references to its requests until
    they leave (an ``update`` without them). Memory: the per-row tensors, and two int64 id tensors
    ``[R, up to twice the longest penalised history]`` (none while no row has a penalty).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(secrets.randbits(63))
        self._rows: list[_Row] = []
        self._index: dict[int, int] = {}  # id(request) -> its row (the batch holds the request: ids stay unique)
        self._tensors = self._build_tensors()
        self._seen = torch.zeros(0, 0, dtype=torch.int64, device=self.device)  # [R, Cs]: prompt + output ids
        self._out = torch.zeros(0, 0, dtype=torch.int64, device=self.device)  # [R, Co]: output ids
        # Both padded per row with the row's first id (0 for an empty row), as the penalty kernels want.

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def requests(self) -> list[SamplingRequest]:
        """The held requests, in row order (a new list)."""
        return [r.request for r in self._rows]

    def row(self, request: SamplingRequest) -> int:
        """The row of a held ``request``; ``KeyError`` if the batch does not hold it."""
        return self._index[id(request)]

    def holds(self, requests: Sequence[SamplingRequest]) -> bool:
        """Whether every one of ``requests`` is held (then :meth:`metadata` may take any of their rows)."""
        return all(id(r) in self._index for r in requests)

    def update(self, requests: Sequence[SamplingRequest]) -> None:
        """Make ``requests`` the batch's rows, in this order, and read the output ids they gained.

        Requests held before (the same objects) keep their tensors and histories; the others are built
        from their parameters and lists; the held ones missing from ``requests`` are dropped. When the
        requests are the same, in the same order, the per-row tensors are reused as they are. Each row's
        ``output_ids`` is read from where the last update stopped (penalised rows append the new ids to
        their history tensors; every row moves its position). Mutates the batch, never the requests.

        Raises
        ------
        ValueError
            A request is given twice, a logit bias or (penalised rows) a history id is outside the
            vocabulary, or a held request's ``output_ids`` shrank. The batch is then unchanged.
        """
        held = self._rows
        same = len(requests) == len(held) and all(a is b.request for a, b in zip(requests, held, strict=True))
        if same:
            self._append(self._new_outputs(self._rows))
        else:
            self._rebuild(requests)

    def metadata(
        self,
        *,
        slots: Sequence[tuple[int, Sequence[int]]] | None = None,
        token_bitmask: torch.Tensor | None = None,
        bitmask_rows: Sequence[int] | torch.Tensor | None = None,
        draw: int = 0,
    ) -> SamplingMetadata:
        """This step's :class:`SamplingMetadata`. Does not change the rows (it draws from ``generator``, and
        may grow the history buffers for drafts). Its tensors may be the batch's own or views of them: use it
        before the next :meth:`update`, and do not write into it (the :class:`Sampler` does not).

        Parameters
        ----------
        slots : sequence of ``(row, drafts)``, default: None (one slot per row, no drafts)
            One logits row per slot: held row ``row`` after its output and the token ids ``drafts``
            (a decode loop's draft positions), in the logits' order. Rows may repeat or be left out.
        token_bitmask : int32 tensor ``[c, ceil(V / 32)]``, default: None
            Allowed tokens (xgrammar's layout) for ``c`` constrained slots.
        bitmask_rows : ``c`` slot indices, default: None
            The slot of each bitmask row; None means ``c`` equals the number of slots, row i is slot i.
        draw : int, default: 0
            Which draw of this step (see ``SamplingMetadata.build``).

        Raises
        ------
        ValueError
            The batch is empty, a slot names no held row, ``draw`` < 0, or the bitmask does not fit.

        Notes
        -----
        Cost: a few ``[P]`` tensor ops and one ``[P]`` host-to-device copy per call, plus, for penalised
        rows, views of the history tensors (with drafts: a gather of their ``[P, L]`` rows).
        """
        if draw < 0:
            raise ValueError(f"draw counts the draws of a step from 0, got {draw}")
        if not self._rows:
            raise ValueError("the batch holds no rows: update() it with the step's requests first")
        t = self._tensors
        identity = slots is None or (
            len(slots) == len(self._rows) and all(row == i and not d for i, (row, d) in enumerate(slots))
        )
        if identity:
            rows = self._rows
            lengths = [r.length for r in rows]
            index = None
        else:
            assert slots is not None
            if any(not 0 <= row < len(self._rows) for row, _ in slots):
                raise ValueError(f"slots name rows outside [0, {len(self._rows)}): {[row for row, _ in slots]}")
            rows = [self._rows[row] for row, _ in slots]
            lengths = [self._rows[row].length + len(d) for row, d in slots]
            index = torch.tensor([row for row, _ in slots], dtype=torch.int64)  # [P] on the CPU
        batch = len(rows)

        fresh = torch.randint(0, MAX_SEED, (batch,), generator=self.generator)  # [P], what build draws
        seeded, seeds = (t.seeded, t.seeds) if index is None else (t.seeded[index], t.seeds[index])
        # [P]: hashed on the host (a few small ops there, not as many launches on a GPU), then one copy
        keys = _to(
            row_keys(torch.where(seeded, seeds, fresh), torch.tensor(lengths, dtype=torch.int64), draw), self.device
        )
        bitmask, rows_tensor = None, None
        if token_bitmask is not None:
            bitmask, rows_tensor = check_bitmask(token_bitmask, bitmask_rows, batch, self.vocab_size, self.device)

        if index is None:
            return SamplingMetadata(
                vocab_size=self.vocab_size,
                temperature=t.temperature,
                top_k=t.top_k,
                top_p=t.top_p,
                min_p=t.min_p,
                keys=keys,
                greedy_rows=t.greedy_rows,
                window_rows=t.window_rows,
                full_rows=t.full_rows,
                logit_bias=t.logit_bias,
                penalties=self._penalties(None, None) if any(r.penalized for r in rows) else None,
                token_bitmask=bitmask,
                bitmask_rows=rows_tensor,
                max_num_logprobs=t.max_num_logprobs,
                processed_logprob_rows=t.processed_logprob_rows,
                raw_logprob_rows=t.raw_logprob_rows,
                facts=t.facts,
            )
        assert slots is not None
        on_device = index.to(self.device)  # [P]
        params = [r.request.params for r in rows]
        longs = functools.partial(torch.tensor, dtype=torch.int64, device=self.device)
        window = [s for s, r in enumerate(rows) if r.group == _WINDOW]
        full = [s for s, r in enumerate(rows) if r.group == _FULL]
        return SamplingMetadata(
            vocab_size=self.vocab_size,
            temperature=t.temperature[on_device],
            top_k=t.top_k[on_device],
            top_p=t.top_p[on_device],
            min_p=t.min_p[on_device],
            keys=keys,
            greedy_rows=longs([s for s, r in enumerate(rows) if r.group == _GREEDY]),
            window_rows=longs(window),
            full_rows=longs(full),
            logit_bias=_bias(params, self.device),
            penalties=self._penalties(slots, on_device) if any(r.penalized for r in rows) else None,
            token_bitmask=bitmask,
            bitmask_rows=rows_tensor,
            **logprob_rows(params, self.device),
            facts=RowFacts.of(params, window, full, self.vocab_size),
        )

    # -- when the rows change -------------------------------------------------------------------------

    def _rebuild(self, requests: Sequence[SamplingRequest]) -> None:
        """Rows become ``requests``: kept rows gather their history rows, new rows are built from lists.
        Validates everything before changing anything."""
        if len({id(r) for r in requests}) != len(requests):
            raise ValueError("a request appears twice in the batch: pass each once (slots may repeat rows)")
        vocab = self.vocab_size
        old = [self._index.get(id(r), -1) for r in requests]  # [R'] the old row of each, -1 if new
        rows: list[_Row] = []
        new_ids: dict[int, tuple[list[int], list[int]]] = {}  # new row -> (prompt + output, output) if penalized
        for i, (request, was) in enumerate(zip(requests, old, strict=True)):
            if was >= 0:
                rows.append(self._rows[was])
                continue
            p = request.params
            for token_id in p.logit_bias:
                if token_id >= vocab:
                    raise ValueError(
                        f"requests[{i}].params.logit_bias names token id {token_id}, outside the vocabulary of {vocab}"
                    )
            if p.greedy:
                group = _GREEDY
            elif p.top_k is not None and p.top_k <= WINDOW_MAX_K and p.top_k < vocab:
                group = _WINDOW
            else:
                group = _FULL
            outputs = list(request.output_ids)
            seen = out = 0
            if p.has_penalties:
                prompt = list(request.prompt_ids)
                _check_ids(f"requests[{i}].prompt_ids", prompt, vocab)
                _check_ids(f"requests[{i}].output_ids", outputs, vocab)
                new_ids[i] = (prompt + outputs, outputs)
                seen, out = len(prompt) + len(outputs), len(outputs)
            rows.append(_Row(request, group, p.has_penalties, seen, out, len(outputs)))
        pending = self._new_outputs([r if was >= 0 else None for r, was in zip(rows, old, strict=True)])

        # the history tensors: kept rows by one gather, new rows copied in from their lists
        if any(r.penalized for r in rows):
            width_seen = max(r.seen for r in rows)
            width_out = max(r.out for r in rows)
            seen_t = _gather_rows(self._seen, old, max(width_seen, self._seen.shape[1]), self.device)  # [R', Cs]
            out_t = _gather_rows(self._out, old, max(width_out, self._out.shape[1]), self.device)  # [R', Co]
            for i, (seen_ids, out_ids) in new_ids.items():
                _write_row(seen_t, i, seen_ids)
                _write_row(out_t, i, out_ids)
        else:
            seen_t = torch.zeros(len(rows), 0, dtype=torch.int64, device=self.device)
            out_t = torch.zeros(len(rows), 0, dtype=torch.int64, device=self.device)

        self._rows = rows
        self._index = {id(r.request): i for i, r in enumerate(rows)}
        self._seen, self._out = seen_t, out_t
        self._tensors = self._build_tensors()
        self._append(pending)

    def _build_tensors(self) -> _Rows:
        """The per-row tensors of the held rows, from their parameters (O(R) Python, a few small copies)."""
        vocab, device = self.vocab_size, self.device
        params = [r.request.params for r in self._rows]
        window = [i for i, r in enumerate(self._rows) if r.group == _WINDOW]
        full = [i for i, r in enumerate(self._rows) if r.group == _FULL]
        floats = functools.partial(torch.tensor, dtype=torch.float32, device=device)
        longs = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return _Rows(
            temperature=floats([p.temperature if not p.greedy else 1.0 for p in params]),
            top_k=longs([min(p.top_k, vocab) if p.top_k is not None else vocab for p in params]),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            seeds=torch.tensor([p.seed if p.seed is not None else 0 for p in params], dtype=torch.int64),
            seeded=torch.tensor([p.seed is not None for p in params], dtype=torch.bool),
            repetition=floats([p.repetition_penalty for p in params]),
            frequency=floats([p.frequency_penalty for p in params]),
            presence=floats([p.presence_penalty for p in params]),
            greedy_rows=longs([i for i, r in enumerate(self._rows) if r.group == _GREEDY]),
            window_rows=longs(window),
            full_rows=longs(full),
            logit_bias=_bias(params, device),
            **logprob_rows(params, device),
            facts=RowFacts.of(params, window, full, vocab),
        )

    # -- every step -----------------------------------------------------------------------------------

    def _new_outputs(self, rows: Sequence[_Row | None]) -> list[tuple[int, list[int]]]:
        """``(row, ids)`` for each of ``rows`` (None: a row just built) whose output gained ids since it was
        last read (``ids`` empty unless penalised). Validates them; changes nothing."""
        pending = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            outputs = r.request.output_ids
            n = len(outputs)
            if n == r.length:
                continue
            if n < r.length:
                raise ValueError(
                    f"requests[{i}].output_ids shrank from {r.length} to {n} ids: a held request's output "
                    "only grows (update() without it, then with it, to start it again)"
                )
            tail = list(outputs[r.length : n]) if r.penalized else []
            _check_ids(f"requests[{i}].output_ids", tail, self.vocab_size)
            pending.append((i, tail))
        return pending

    def _append(self, pending: list[tuple[int, list[int]]]) -> None:
        """Append ``pending`` (from :meth:`_new_outputs`) to the rows' histories and move their positions."""
        at_rows: list[int] = []  # per new id of a penalised row: its row, its columns, the id
        at_seen: list[int] = []
        at_out: list[int] = []
        new_ids: list[int] = []
        first: list[tuple[int, int, bool]] = []  # (row, its first output id, whether it has no seen id yet)
        for i, tail in pending:
            r = self._rows[i]
            r.length = len(r.request.output_ids)
            if not tail:
                continue
            if r.out == 0:
                first.append((i, tail[0], r.seen == 0))
            at_rows += [i] * len(tail)
            at_seen += range(r.seen, r.seen + len(tail))
            at_out += range(r.out, r.out + len(tail))
            new_ids += tail
            r.seen += len(tail)
            r.out += len(tail)
        if not new_ids:
            return
        device = self.device
        self._seen = _reserve(self._seen, max(at_seen) + 1)
        self._out = _reserve(self._out, max(at_out) + 1)
        for i, token, seen_empty in first:  # a row's pads repeat its first id: set them before the ids
            self._out[i].fill_(token)
            if seen_empty:
                self._seen[i].fill_(token)
        rows_t, seen_t, out_t, ids_t = _to(torch.tensor([at_rows, at_seen, at_out, new_ids]), device)  # [n] each
        self._seen.index_put_((rows_t, seen_t), ids_t)
        self._out.index_put_((rows_t, out_t), ids_t)

    def _penalties(
        self,
        slots: Sequence[tuple[int, Sequence[int]]] | None,
        # [P] int64 on the device: each slot's row; None: one slot per row
        index: torch.Tensor | None,
    ) -> Penalties:
        """The penalty stage's tensors: views of the histories (one slot per row), or their slots' rows
        with the drafts appended."""
        t = self._tensors
        if slots is None or index is None:
            seen_len = [r.seen for r in self._rows]
            out_len = [r.out for r in self._rows]
            seen_ids = self._seen[:, : max(seen_len)]  # [R, Ls]
            output_ids = self._out[:, : max(out_len)]  # [R, Lo]
            repetition, frequency, presence = t.repetition, t.frequency, t.presence
        else:
            rows = [self._rows[row] for row, _ in slots]
            drafts = [list(d) if r.penalized else [] for r, (_, d) in zip(rows, slots, strict=True)]
            seen_len = [r.seen + len(d) for r, d in zip(rows, drafts, strict=True)]
            out_len = [r.out + len(d) for r, d in zip(rows, drafts, strict=True)]
            for (row, _), d in zip(slots, drafts, strict=True):
                _check_ids(f"the drafts of row {row}", d, self.vocab_size)
            self._seen = _reserve(self._seen, max(seen_len))
            self._out = _reserve(self._out, max(out_len))
            seen_ids = self._seen[index, : max(seen_len)]  # [P, Ls], a copy
            output_ids = self._out[index, : max(out_len)]  # [P, Lo], a copy
            at_slot = [s for s, d in enumerate(drafts) for _ in d]
            if at_slot:
                ids = torch.tensor([x for d in drafts for x in d], dtype=torch.int64, device=self.device)  # [n]
                slot_t = torch.tensor(at_slot, dtype=torch.int64, device=self.device)  # [n]
                for target, lengths in ((seen_ids, [r.seen for r in rows]), (output_ids, [r.out for r in rows])):
                    empty = [s for s, d in enumerate(drafts) if d and lengths[s] == 0]
                    if empty:  # a row whose first id is a draft: its pads repeat that draft
                        target[empty] = torch.tensor([drafts[s][0] for s in empty], device=self.device).unsqueeze(1)
                    at = [lengths[s] + j for s, d in enumerate(drafts) for j in range(len(d))]
                    target.index_put_((slot_t, torch.tensor(at, dtype=torch.int64, device=self.device)), ids)
            repetition, frequency, presence = t.repetition[index], t.frequency[index], t.presence[index]
        device = self.device
        seen_n, out_n = _to(torch.tensor([seen_len, out_len]), device)  # [P] each
        columns = torch.arange(output_ids.shape[1], device=device)  # [Lo]
        return Penalties(
            seen_ids=seen_ids,
            output_ids=output_ids,
            output_valid=(columns < out_n.unsqueeze(1)).float(),  # [P, Lo]
            repetition=torch.where(seen_n > 0, repetition, 1.0),
            frequency=frequency,
            presence=torch.where(out_n > 0, presence, 0.0),
        )


def _bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The logit-bias triples ``(rows, ids, bias)`` of ``params``' rows; None when no row has a bias."""
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor([t for p in params for t in p.logit_bias], dtype=torch.int64, device=device),
        torch.tensor([b for p in params for b in p.logit_bias.values()], dtype=torch.float32, device=device),
    )


def _to(
    # a CPU tensor, not used by the caller after this call
    host: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """``host`` on ``device``. To a GPU through pinned memory, without waiting: a copy from pageable memory
    waits for the device to finish its queued work (vLLM's ``InputBatch`` copies from pinned buffers too)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary of {vocab_size}")


def _gather_rows(
    # [R, C] int64
    table: torch.Tensor,
    old: list[int],
    width: int,
    device: torch.device,
) -> torch.Tensor:
    """``[len(old), width]``: row ``old[i]`` of ``table`` (padded with its first id), zeros where ``old[i] < 0``."""
    out = torch.zeros(len(old), width, dtype=torch.int64, device=device)
    kept = [i for i, o in enumerate(old) if o >= 0]
    if kept and table.shape[1]:
        source = _reserve(table, width)[torch.tensor([old[i] for i in kept], device=device)]  # [k, >= width]
        out[torch.tensor(kept, device=device)] = source[:, :width]
    return out


def _write_row(
    # [R, C] int64; row ``i`` is overwritten
    table: torch.Tensor,
    i: int,
    ids: list[int],
) -> None:
    """Row ``i`` of ``table`` becomes ``ids`` padded with its first id (0 when empty)."""
    table[i].fill_(ids[0] if ids else 0)
    if ids:
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64, device=table.device)


def _reserve(
    # [R, C] int64, rows padded with their first id
    table: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """``table`` itself when it is ``width`` wide or wider, else a copy grown to twice ``width`` (amortised
    O(1) per appended id), its new columns padded with each row's first id."""
    if table.shape[1] >= width:
        return table
    grown = max(2 * width, 16)
    pad = table[:, :1] if table.shape[1] else torch.zeros(table.shape[0], 1, dtype=table.dtype, device=table.device)
    return torch.cat([table, pad.expand(-1, grown - table.shape[1])], dim=1)  # [R, grown]
