"""The batch's sampling parameters as tensors, with flags that let the sampler skip stages."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .params import MAX_SEED, SamplingParams
from .rng import fresh_seeds, row_keys

__all__ = ["WINDOW_MAX_K", "Penalties", "RowFacts", "SamplingMetadata", "check_bitmask", "logprob_rows"]

WINDOW_MAX_K = 128
"""Rows with ``top_k <= WINDOW_MAX_K`` are sampled inside their ``topk`` window.

Larger k would make the batch's shared ``topk`` call cost more than the
sort-free full-vocabulary path (measured on CPU: topk(51) 4 ms, topk(257) 7 ms
at 64 x 128,256)."""

TokenIds = Sequence[Sequence[int]] | None
"""Per-row token ids (lists, tuples or 1-D tensors); None means none for every row."""


@dataclass(slots=True)
class Penalties:
    """Token ids for the penalty stage, padded per row (see :mod:`constrain.sampler.ops.penalties`)."""

    seen_ids: torch.Tensor  # [B, Ls] int64, prompt and output
    output_ids: torch.Tensor  # [B, Lo] int64
    output_valid: torch.Tensor  # [B, Lo] float32, 1 for real ids
    repetition: torch.Tensor  # [B] float32, 1 on rows without seen ids
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32, 0 on rows without output ids


@dataclass(frozen=True, slots=True)
class RowFacts:
    """What the sampler would otherwise read back from the metadata's tensors, known on the host where the
    metadata is built: on a GPU each such read waits for the device (a few microseconds of launches
    queued behind it are lost each time)."""

    window_k_max: int  # the largest top_k of the window rows (0 when none)
    full_top_k: bool  # some full row has a top_k below the vocabulary
    full_min_p: int  # how many full rows have a min_p (> 0 in float32, as the tensor holds it)
    full_top_p: bool  # some full row has a top_p below 1

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], window: Sequence[int], full: Sequence[int], vocab_size: int
    ) -> RowFacts:
        """The facts of rows ``params`` whose window and full groups are ``window`` and ``full`` (indices)."""
        full_params = [params[i] for i in full]
        return cls(
            window_k_max=max((min(params[i].top_k or vocab_size, vocab_size) for i in window), default=0),
            full_top_k=any(p.top_k is not None and p.top_k < vocab_size for p in full_params),
            full_min_p=sum(_float32(p.min_p) > 0 for p in full_params),
            full_top_p=any(p.top_p < 1 for p in full_params),
        )


def _float32(x: float) -> float:
    """``x`` rounded to float32 (a ``min_p`` below 1e-45 is 0 in the tensor)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters of one sampling step, on the logits' device.

    Built by :meth:`build`; read-only for the sampler. Row groups are disjoint
    and together cover the batch.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [B] int64; vocab_size where disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    keys: torch.Tensor  # [B] int64: rng.row_keys(seed or a fresh random one, output length so far)
    greedy_rows: torch.Tensor  # [g] int64
    window_rows: torch.Tensor  # [w] int64: sampled rows with top_k <= WINDOW_MAX_K
    full_rows: torch.Tensor  # [f] int64: the other sampled rows
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, bias), each [n]; None: no bias
    penalties: Penalties | None  # None: no row has a penalty
    token_bitmask: torch.Tensor | None  # [c, ceil(V / 32)] int32; None: no row constrained
    bitmask_rows: torch.Tensor | None  # [c] int64; None: bitmask row i is batch row i
    max_num_logprobs: int | None  # None: no row wants logprobs; 0: sampled token only
    processed_logprob_rows: torch.Tensor  # [p] int64
    raw_logprob_rows: torch.Tensor  # [r] int64
    facts: RowFacts | None = None  # None: the sampler reads them from the tensors (a GPU waits for each)

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        prompt_token_ids: TokenIds = None,
        output_token_ids: TokenIds = None,
        output_lengths: Sequence[int] | None = None,
        token_bitmask: torch.Tensor | None = None,
        bitmask_rows: Sequence[int] | torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        draw: int = 0,
    ) -> SamplingMetadata:
        """Validate the batch and turn it into tensors on ``device``.

        Parameters
        ----------
        params : sequence of SamplingParams
            One per row.
        vocab_size : int
            The logits' last dimension; ``logit_bias`` ids and token ids must be below it.
        device : torch.device or str
            Where the logits live.
        prompt_token_ids, output_token_ids : per-row id sequences, default: None
            Used by the penalties; ``len(output_token_ids[i])`` is row i's position
            in its seeded random stream.
        output_lengths : per-row ints, default: None
            Row i's position in its seeded random stream, for a caller that passes no
            ``output_token_ids`` (no row has penalties) and so spares copying the ids.
        token_bitmask : int32 tensor ``[c, ceil(V / 32)]``, default: None
            Allowed tokens (xgrammar's layout) for ``c`` constrained rows.
        bitmask_rows : ``c`` row indices, default: None
            The batch row of each bitmask row; None means ``c == B`` and row i is row i.
        generator : torch.Generator, default: None (the OS's entropy: torch's global random state is untouched)
            Draws the per-step seeds of rows without a seed.
        draw : int, default: 0
            Which draw of this step: a row drawn again at the same position (its token refused by a
            check the bitmask could not hold) passes 1, 2, ... and gets randomness independent of the
            earlier draws (seeded rows stay reproducible).

        Raises
        ------
        ValueError
            A list's length differs from the batch, a token id is out of the
            vocabulary, or the bitmask does not fit.
        """
        batch = len(params)
        if draw < 0:
            raise ValueError(f"draw counts the draws of a step from 0, got {draw}")
        if batch == 0:
            raise ValueError("params is empty: pass one SamplingParams per logits row")
        device = torch.device(device)
        prompts = _rows("prompt_token_ids", prompt_token_ids, batch, vocab_size)
        outputs = _rows("output_token_ids", output_token_ids, batch, vocab_size)
        if output_lengths is None:
            output_lengths = [len(o) for o in outputs]
        elif output_token_ids is not None:
            raise ValueError("pass output_token_ids or output_lengths, not both")
        elif len(output_lengths) != batch:
            raise ValueError(f"output_lengths has {len(output_lengths)} rows for a batch of {batch}")

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        greedy, window, full = [], [], []
        for i, p in enumerate(params):
            if p.greedy:
                greedy.append(i)
            elif p.top_k is not None and p.top_k <= WINDOW_MAX_K and p.top_k < vocab_size:
                window.append(i)
            else:
                full.append(i)

        fresh = fresh_seeds(batch, MAX_SEED, generator)
        bias_rows, bias_ids, bias_vals = [], [], []
        for i, p in enumerate(params):
            for token_id, value in p.logit_bias.items():
                if token_id >= vocab_size:
                    raise ValueError(
                        f"params[{i}].logit_bias names token id {token_id}, outside the vocabulary of {vocab_size}"
                    )
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_vals.append(value)
        logit_bias = (longs(bias_rows), longs(bias_ids), floats(bias_vals)) if bias_rows else None

        penalties = None
        if any(p.has_penalties for p in params):
            penalized = [p.has_penalties for p in params]
            seen = [list(prompts[i]) + list(outputs[i]) if penalized[i] else [] for i in range(batch)]
            out = [list(outputs[i]) if penalized[i] else [] for i in range(batch)]
            seen_ids, _ = _pad(seen, device)
            output_ids, output_valid = _pad(out, device)
            penalties = Penalties(
                seen_ids=seen_ids,
                output_ids=output_ids,
                output_valid=output_valid,
                repetition=floats([p.repetition_penalty if seen[i] else 1.0 for i, p in enumerate(params)]),
                frequency=floats([p.frequency_penalty for p in params]),
                presence=floats([p.presence_penalty if out[i] else 0.0 for i, p in enumerate(params)]),
            )

        rows_tensor = None
        if token_bitmask is not None:
            token_bitmask, rows_tensor = check_bitmask(token_bitmask, bitmask_rows, batch, vocab_size, device)

        return cls(
            vocab_size=vocab_size,
            temperature=floats([p.temperature if not p.greedy else 1.0 for p in params]),
            top_k=longs([min(p.top_k, vocab_size) if p.top_k is not None else vocab_size for p in params]),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            keys=row_keys(  # hashed on the host, then one copy
                torch.tensor([p.seed if p.seed is not None else fresh[i] for i, p in enumerate(params)]),
                torch.tensor(list(output_lengths), dtype=torch.int64),
                draw,
            ).to(device),
            greedy_rows=longs(greedy),
            window_rows=longs(window),
            full_rows=longs(full),
            logit_bias=logit_bias,
            penalties=penalties,
            token_bitmask=token_bitmask,
            bitmask_rows=rows_tensor,
            **logprob_rows(params, device),
            facts=RowFacts.of(params, window, full, vocab_size),
        )


def _rows(name: str, rows: TokenIds, batch: int, vocab_size: int) -> list[list[int]]:
    """Normalise per-row ids to lists of ints, checking count and range."""
    if rows is None:
        return [[] for _ in range(batch)]
    if len(rows) != batch:
        raise ValueError(f"{name} has {len(rows)} rows for a batch of {batch}: pass one sequence per row")
    lists = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in rows]
    for i, ids in enumerate(lists):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"{name}[{i}] holds token id {bad}, outside the vocabulary of {vocab_size}")
    return lists


def _pad(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad rows with their own first id (0 for empty rows); return ``(ids [B, L], valid [B, L])``."""
    width = max(len(r) for r in rows)
    ids = [r + [r[0] if r else 0] * (width - len(r)) for r in rows]
    valid = [[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows]
    return (
        torch.tensor(ids, dtype=torch.int64, device=device).view(len(rows), width),
        torch.tensor(valid, dtype=torch.float32, device=device).view(len(rows), width),
    )


def logprob_rows(params: Sequence[SamplingParams], device: torch.device | str) -> dict[str, Any]:
    """The logprob fields of :class:`SamplingMetadata` for rows with ``params``: ``max_num_logprobs`` (None:
    no row wants logprobs), and the rows that want ``"processed"`` and ``"raw"`` ones (``[p]``, ``[r]`` int64)."""
    wants = [p.logprobs for p in params if p.logprobs is not None]

    def rows(mode: str) -> torch.Tensor:
        chosen = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == mode]
        return torch.tensor(chosen, dtype=torch.int64, device=device)

    return {
        "max_num_logprobs": max(wants) if wants else None,
        "processed_logprob_rows": rows("processed"),
        "raw_logprob_rows": rows("raw"),
    }


def check_bitmask(
    # [c, W] int32
    bitmask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None,
    batch: int,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``bitmask`` on ``device`` and its batch rows (``rows`` as an int64 tensor, None: row i is row i), checked
    to fit a batch of ``batch`` rows and a vocabulary of ``vocab_size``; ``ValueError`` naming what does not."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(
            f"token_bitmask must be a 2-D int32 tensor [rows, ceil(V/32)], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    need = (vocab_size + 31) // 32
    if bitmask.shape[1] < need:
        raise ValueError(
            f"token_bitmask has {bitmask.shape[1]} words per row; a vocabulary of {vocab_size} needs {need}"
        )
    if rows is None:
        if bitmask.shape[0] != batch:
            raise ValueError(f"token_bitmask has {bitmask.shape[0]} rows for a batch of {batch}: pass bitmask_rows")
        return bitmask.to(device), None
    rows_t = torch.as_tensor(rows, dtype=torch.int64).flatten()
    if rows_t.numel() != bitmask.shape[0] or (rows_t.numel() and (rows_t.min() < 0 or rows_t.max() >= batch)):
        raise ValueError(f"bitmask_rows must give one batch row in [0, {batch}) per bitmask row, got {rows_t.tolist()}")
    return bitmask.to(device), rows_t.to(device)
