"""The orchestrator: logits -> token ids, for a batch with per-row parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .metadata import SamplingMetadata, TokenIds
from .ops import sampling as sampling_ops
from .ops.bitmask import apply_token_bitmask, apply_token_bitmask_inplace
from .ops.blocks import block_argmax, block_max, block_topk
from .ops.logprobs import gather_logprobs
from .ops.penalties import apply_logit_bias_inplace, apply_penalties_inplace
from .ops.sampling import sample_top_p_rejection, sample_window
from .ops.topk_topp import apply_top_k_top_p_min_p, top_k_threshold
from .params import SamplingParams
from .rng import Stream, uniforms

__all__ = ["LogprobsOutput", "Sampler", "SamplerOutput", "sample"]

_LOG2E = 1.4426950408889634
"""``log2(e)``: ``exp(x) == 2 ** (x * log2(e))``."""
_MIN_P_FLOOR = 2.0**-100
"""Smaller ``min_p`` count as this one, so that ``1 / min_p`` stays a finite float32 weight."""
_BELOW_ONE = 1.0 - 2.0**-24
"""The float32 just below 1: ``threshold_`` keeps weights strictly above it, i.e. ``>= 1``."""


@dataclass(slots=True)
class LogprobsOutput:
    """Logprobs for the rows that asked; NaN / -1 in rows that did not."""

    sampled: torch.Tensor  # [B] float32: the sampled token's logprob
    top_token_ids: torch.Tensor  # [B, N] int64, N = the batch's largest request
    top_logprobs: torch.Tensor  # [B, N] float32, descending


@dataclass(slots=True)
class SamplerOutput:
    """One step's result."""

    token_ids: torch.Tensor  # [B] int64; -1 where no token was allowed
    no_token_allowed: torch.Tensor  # [B] bool: every logit was -inf after the bitmask (and bias/penalties)
    logprobs: LogprobsOutput | None  # None when no row asked


class Sampler:
    """Turns a batch of logits into one token per row. Per-row parameters come
    as a :class:`SamplingMetadata`; the batch is never looped over in Python,
    and a stage that no row uses is skipped.

    Pipeline, in this order:

    1. Logits are computed on in float32 (fp16/bf16 input is converted).
    2. Token bitmask: disallowed tokens of constrained rows become ``-inf``.
    3. Logit bias is added.
    4. Penalties: repetition (prompt and output), presence, frequency.
    5. Greedy rows (``temperature == 0``) take the argmax here; steps 6-9 skip them.
       (Greedy rows and small top-k rows share one read: maxima of 256-token blocks.)
    6. Temperature divides the logits.
    7. Top-k: keep logits >= the k-th largest (a window of the blocks with the
       largest maxima for k <= 128, a threshold otherwise).
    8. Top-p over the top-k survivors, renormalised; no vocabulary sort (inside
       the window, or rejection with a rising pivot).
    9. Min-p: keep probabilities >= ``min_p`` x the largest (intersected with
       the nucleus of step 8, which is a share of the mass before min-p).
    10. Draw: inverse CDF with one counter-based uniform per row, keyed by
        ``(seed, output length)``; a row whose tokens are all ``-inf`` yields
        ``-1`` and is flagged in ``no_token_allowed``.
    11. Logprobs for the rows that asked, from the distribution of step 10
        (``"processed"``) or of the input logits (``"raw"``).

    The sampler keeps scratch buffers between calls (it is not thread-safe;
    use one per thread). A call may overwrite float32 ``logits`` (stages 2-4
    in place, and the weights of steps 6-10 when no row asks for logprobs),
    unless it is given ``inplace=False``.
    """

    def __init__(self) -> None:
        self._scratch: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A reusable float32 ``[rows, cols]`` buffer (fresh pages cost a pass)."""
        buf = self._scratch.get(name)
        if buf is None or buf.device != device or buf.shape[1] != cols or buf.shape[0] < rows:
            buf = torch.empty(rows, cols, dtype=torch.float32, device=device)
            self._scratch[name] = buf
        return buf[:rows]

    def __call__(
        self,
        # [B, V] float32 / float16 / bfloat16; float32 input may be overwritten (see ``inplace``)
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        *,
        inplace: bool = True,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` with the rows' parameters in ``metadata``.

        Parameters
        ----------
        logits : ``[B, V]`` float tensor
            The model's next-token logits, one row per row of ``metadata``.
        metadata : SamplingMetadata
            The rows' parameters (:meth:`SamplingMetadata.build` or :meth:`SamplingBatch.metadata
            <constrain.sampler.batch.SamplingBatch.metadata>`); not modified.
        inplace : bool, default: True
            Whether the call may write into float32 ``logits`` (a decode loop's own logits: no copy). With
            False they are left unchanged: the first stage that writes works on a copy (fused with the
            bitmask's add where every row has a bitmask row: no extra pass), and steps 6-10 write into
            the sampler's scratch buffers. 16-bit logits are converted to a new tensor either way.

        Raises
        ------
        ValueError
            ``logits`` do not match the metadata's ``[B, V]`` or are not floating point.
        """
        if logits.dim() != 2 or logits.shape[0] != metadata.batch_size or logits.shape[1] != metadata.vocab_size:
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}; the metadata was built for "
                f"[{metadata.batch_size}, {metadata.vocab_size}]"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        md = metadata
        device = logits.device
        batch, vocab = logits.shape
        raw_logprobs = None
        if md.raw_logprob_rows.numel():  # 11 (raw), read before anything changes the logits
            raw_logprobs = torch.log_softmax(logits[md.raw_logprob_rows].float(), dim=-1)  # [r, V]

        logits, owned = _process(logits, md, inplace=inplace, buffer=self._buffer)  # 1.-4.; owned: may overwrite

        token_ids = torch.full((batch,), -1, dtype=torch.int64, device=device)  # [B]
        dead = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
        maxima = None  # [B, ceil(V / 256)] block maxima: one read serves the argmax and small top-k
        if md.greedy_rows.numel() or md.window_rows.numel():
            maxima = block_max(logits)
        if maxima is not None and md.greedy_rows.numel():  # 5.
            best, best_ids = block_argmax(logits, md.greedy_rows, maxima)  # [g] each
            token_ids[md.greedy_rows] = best_ids
            dead[md.greedy_rows] = best == float("-inf")
        facts = md.facts
        u = md.keys.new_empty((0, 0), dtype=torch.float64)  # [B, rounds + 1]: the uniforms of the sampled rows
        if md.batch_size > md.greedy_rows.numel():  # drawn for every row in one set of ops (one launch each on a GPU)
            u = uniforms(md.keys, Stream.SAMPLE, sampling_ops.MAX_REJECTION_ROUNDS + 1)
        rows, kth = md.full_rows, None  # kth: [f] top-k thresholds, None when no full row has a top-k
        if rows.numel() and (facts.full_top_k if facts else bool((md.top_k[rows] < vocab).any())):
            kth = _kth(logits, md, rows)
        tied_rows = None  # [t] window rows whose k-th logit ties beyond the window: drawn again on the full path
        if maxima is not None and md.window_rows.numel():  # 6.-10. for small top-k
            tied_rows, tied_kth = self._sample_windows(logits, md, maxima, u, token_ids, dead)
        if rows.numel():  # 6.-10. for the rest
            n_min_p, any_top_p = (facts.full_min_p, facts.full_top_p) if facts else (None, None)
            self._sample_full(logits, md, rows, kth, u, token_ids, dead, owned, n_min_p, any_top_p, maxima)
        if tied_rows is not None and tied_rows.numel():
            self._sample_full(logits, md, tied_rows, tied_kth, u, token_ids, dead, False, None, None, maxima)
        token_ids[dead] = -1

        logprobs = None
        if md.max_num_logprobs is not None:  # 11.
            logprobs = self._logprobs(logits, md, token_ids, raw_logprobs)
        return SamplerOutput(token_ids=token_ids, no_token_allowed=dead, logprobs=logprobs)

    def _sample_windows(
        self,
        # [B, V] float32
        logits: torch.Tensor,
        md: SamplingMetadata,
        # [B, ceil(V / 256)]: block_max(logits)
        maxima: torch.Tensor,
        # [B, rounds + 1] float64: the step's uniforms (column 0 here)
        u: torch.Tensor,
        # [B] int64 / bool, written for the window rows
        token_ids: torch.Tensor,
        dead: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the small-top-k rows inside their ``topk`` window.

        A row whose k-th and (k+1)-th logits tie may keep more than the window
        holds: it is handed to the full path. Returns those rows ``[t]`` and
        their top-k thresholds ``[t]``.
        """
        rows = md.window_rows  # [w]
        k = md.top_k[rows]  # [w]
        width = min((md.facts.window_k_max if md.facts else int(k.max())) + 1, md.vocab_size)
        values, ids = block_topk(logits, rows, maxima, width)  # [w, width] each, descending
        kth = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)  # [w]
        after = values.gather(1, k.clamp(max=width - 1).unsqueeze(1)).squeeze(1)  # [w] the (k+1)-th
        tied = (k < width) & (after == kth) & (kth > float("-inf"))
        row_dead = values[:, 0] == float("-inf")
        dead[rows] = row_dead
        # Every window row is drawn (no subset: on a GPU, picking rows waits for the device); a dead row's
        # values become 0 so that its draw stays finite, and its token is overwritten (-1) by the caller; a tied
        # row's by the full path.
        v = torch.where(row_dead.unsqueeze(1), 0.0, values / md.temperature[rows].unsqueeze(1))  # [w, width]
        past_k = torch.arange(width, device=logits.device) >= k.unsqueeze(1)  # [w, width]
        v.masked_fill_(past_k, float("-inf"))
        token_ids[rows] = sample_window(v, ids, md.top_p[rows], md.min_p[rows], u[rows, 0])
        tied_at = tied.nonzero().squeeze(1)  # [t]: one wait for the device, where window rows exist
        return rows[tied_at], kth[tied_at]

    def _sample_full(
        self,
        # [B, V] float32
        logits: torch.Tensor,
        md: SamplingMetadata,
        # [f] int64
        rows: torch.Tensor,
        # [f] float32 or None: top-k thresholds on the unscaled logits (-inf: none)
        kth: torch.Tensor | None,
        # [B, rounds + 1] float64: the step's uniforms
        u: torch.Tensor,
        # [B] int64 / bool, written for ``rows``
        token_ids: torch.Tensor,
        dead: torch.Tensor,
        owned: bool,
        n_min_p: int | None,
        any_top_p: bool | None,
        # [B, ceil(V / 256)] or None: block_max(logits), where another stage read it
        maxima: torch.Tensor | None,
    ) -> None:
        """Sample rows over the whole vocabulary, without sorting; ``owned``: ``logits`` may be overwritten.
        ``n_min_p`` (how many of ``rows`` have a min-p) and ``any_top_p`` (whether one has a top-p), where
        the host knows them (None: read from the tensors; on a GPU each waits for the device). The rows'
        maxima come from ``maxima`` where given (top-k keeps each row's maximum), saving a pass.

        The weights are ``2 ** ((x - max) * log2(e) / T)``: a softmax without its normalising
        pass (``exp2`` vectorises on CPUs, where ``exp`` takes a slow path for ``-inf``). Min-p
        rows are placed first and scaled by ``1 / min_p``, so that one scalar threshold (1) on
        that slice keeps ``p >= min_p * max p``; top-p stays a share of the mass before min-p.
        A row with no token allowed has weights 0: its draw is arbitrary, and it is flagged ``dead``.
        """
        min_p = md.min_p[rows]  # [f]
        if n_min_p is None:
            n_min_p = int((min_p > 0).sum())
        if n_min_p:  # min-p rows first
            order = torch.argsort((min_p > 0).to(torch.int8), descending=True, stable=True)  # [f]
            rows, min_p = rows[order], min_p[order]
            kth = kth[order] if kth is not None else None
        f, vocab = rows.numel(), md.vocab_size
        if owned and kth is None and not n_min_p and f == logits.shape[0] and md.max_num_logprobs is None:
            scaled = logits  # every row, in order, and nothing reads the logits later: in place
        else:
            scaled = self._buffer("scaled", f, vocab, logits.device)  # [f, V]
            torch.index_select(logits, 0, rows, out=scaled)
            if kth is not None:  # 7. (k > 128, or ties at the k-th logit)
                scaled.masked_fill_(scaled < kth.unsqueeze(1), float("-inf"))
        row_max = maxima[rows].amax(-1) if maxima is not None else scaled.amax(-1)  # [f]
        row_dead = row_max == float("-inf")
        dead[rows] = row_dead
        scale = _LOG2E / md.temperature[rows]  # [f]  6.
        offset = torch.where(row_dead, 0.0, row_max)  # [f]: weight 1 at the max
        if n_min_p:  # min-p rows: weight 1 / min_p at the max, in the same pass
            offset[:n_min_p] += min_p[:n_min_p].clamp(min=_MIN_P_FLOOR).log2() / scale[:n_min_p]
        scaled.sub_(offset.unsqueeze(1)).mul_(scale.unsqueeze(1))  # [f, V]
        probs = scaled.exp2_()  # [f, V] unnormalised; 0 on dead rows
        total = None  # [n_min_p] float64: the mass top-p is a share of, where min-p filters
        if n_min_p:  # 9.
            total = probs[:n_min_p].sum(-1).double()
            torch.threshold_(probs[:n_min_p], _BELOW_ONE, 0.0)
        scratch = self._buffer("scratch", 2 * f, vocab, logits.device)
        token_ids[rows] = sample_top_p_rejection(
            probs, md.top_p[rows], u[rows], scratch, total, any_top_p=any_top_p
        )  # 8., 10.

    def _logprobs(
        self,
        # [B, V] float32: after stages 1-4
        logits: torch.Tensor,
        md: SamplingMetadata,
        # [B] int64
        token_ids: torch.Tensor,
        # [r, V] float32 or None
        raw_logprobs: torch.Tensor | None,
    ) -> LogprobsOutput:
        """Stage 11: see :class:`~constrain.sampler.params.SamplingParams` ``logprobs_mode``."""
        batch, n = token_ids.shape[0], max(md.max_num_logprobs or 0, 1)
        out = LogprobsOutput(
            sampled=torch.full((batch,), float("nan"), device=logits.device),
            top_token_ids=torch.full((batch, n), -1, dtype=torch.int64, device=logits.device),
            top_logprobs=torch.full((batch, n), float("nan"), device=logits.device),
        )
        processed = md.processed_logprob_rows
        for rows, logprobs in (
            (md.raw_logprob_rows, raw_logprobs),
            (processed, self._processed_logprobs(logits, md, processed) if processed.numel() else None),
        ):
            if logprobs is None:
                continue
            sampled, top_ids, top_vals = gather_logprobs(logprobs, token_ids[rows], n)
            out.sampled[rows], out.top_token_ids[rows], out.top_logprobs[rows] = sampled, top_ids, top_vals
        if md.max_num_logprobs == 0:
            out.top_token_ids, out.top_logprobs = out.top_token_ids[:, :0], out.top_logprobs[:, :0]
        return out

    @staticmethod
    def _processed_logprobs(
        # [B, V] float32: after stages 1-4
        logits: torch.Tensor,
        md: SamplingMetadata,
        # [p] int64
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """``[p, V]`` log-probabilities of the final sampling distribution of ``rows``."""
        scaled = logits[rows] / md.temperature[rows].unsqueeze(1)  # greedy rows: temperature 1
        greedy = torch.isin(rows, md.greedy_rows)  # [p]
        top_k = torch.where(greedy, md.vocab_size, md.top_k[rows])
        top_p = torch.where(greedy, 1.0, md.top_p[rows])
        min_p = torch.where(greedy, 0.0, md.min_p[rows])
        return torch.log_softmax(apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p), dim=-1)

    def probs(
        self,
        # [B, V] float; float32 input may be modified in place (stages 2-4)
        logits: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Return ``[B, V]`` float32: each row's final sampling distribution.

        Greedy rows get a one-hot at their argmax; rows with no allowed token
        get all zeros. This is the target distribution for the rejection sampler.
        """
        md = metadata
        logits, _ = _process(logits, md, inplace=True)
        sampled = torch.cat([md.window_rows, md.full_rows])
        probs = torch.zeros_like(logits)  # [B, V]
        if sampled.numel():
            probs[sampled] = self._processed_logprobs(logits, md, sampled).exp()
        if md.greedy_rows.numel():
            best, best_ids = logits[md.greedy_rows].max(dim=-1)
            one_hot = torch.zeros_like(logits[md.greedy_rows])
            one_hot.scatter_(1, best_ids.unsqueeze(1), (best > float("-inf")).float().unsqueeze(1))
            probs[md.greedy_rows] = one_hot
        return probs


def _process(
    # [B, V] float; float32 input is modified in place if ``inplace``
    logits: torch.Tensor,
    md: SamplingMetadata,
    *,
    inplace: bool,
    buffer: Callable[[str, int, int, torch.device], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, bool]:
    """Stages 1-4: float32, bitmask, logit bias, penalties. Returns the float32 logits and whether the
    caller may overwrite them (``inplace``, or they are a new tensor: converted, copied or masked).
    ``buffer`` (:meth:`Sampler._buffer`) holds the copy that stages 3-4 need when not ``inplace``."""
    owned = inplace or logits.dtype != torch.float32
    logits = logits.float()  # 1. a no-op for float32
    if not logits.is_contiguous():  # e.g. a model's logits[:, -1, :]: the in-place kernels need rows in one piece
        logits, owned = logits.contiguous(), True
    if md.token_bitmask is not None:  # 2.
        if owned:
            apply_token_bitmask_inplace(logits, md.token_bitmask, md.bitmask_rows)
        else:  # the caller's tensor: the masked logits go to a new one, in the same pass
            logits, owned = apply_token_bitmask(logits, md.token_bitmask, md.bitmask_rows), True
    if not owned and (md.logit_bias is not None or md.penalties is not None):
        # [B, V]: one pass (into a warm buffer: fresh pages cost several), for the sparse writes of stages 3-4
        rows, vocab = logits.shape
        logits = buffer("logits", rows, vocab, logits.device).copy_(logits) if buffer else logits.clone()
        owned = True
    if md.logit_bias is not None:  # 3.
        apply_logit_bias_inplace(logits, *md.logit_bias)
    if md.penalties is not None:  # 4.
        p = md.penalties
        apply_penalties_inplace(logits, p.seen_ids, p.output_ids, p.output_valid, p.repetition, p.frequency, p.presence)
    return logits, owned


def _kth(
    # [B, V] float32
    logits: torch.Tensor,
    md: SamplingMetadata,
    # [f] int64
    rows: torch.Tensor,
) -> torch.Tensor:
    """``[f]`` k-th largest logits of ``rows`` (``-inf`` where top-k is off)."""
    return top_k_threshold(logits[rows], md.top_k[rows])


def sample(
    # [B, V] float32 / float16 / bfloat16, any device; not modified unless ``inplace``
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    *,
    prompt_token_ids: TokenIds = None,
    output_token_ids: TokenIds = None,
    # [B, ceil(V / 32)] int32; a row of all -1 (every bit set) is unconstrained
    token_bitmask: torch.Tensor | None = None,
    inplace: bool = False,
    sampler: Sampler | None = None,
) -> SamplerOutput:
    """Sample one token per row: the stateless convenience over :class:`Sampler`.

    ``params`` is one :class:`SamplingParams` for every row, or a list of B.
    See :class:`Sampler` for the pipeline and :class:`SamplerOutput` for the result.

    Parameters
    ----------
    logits : ``[B, V]`` float tensor
        The next-token logits.
    params : SamplingParams or a sequence of B
        One for every row, or one per row.
    prompt_token_ids, output_token_ids : per-row id sequences, default: None
        The histories the penalties read; ``len(output_token_ids[i])`` is row i's position in its
        seeded random stream.
    token_bitmask : int32 tensor ``[B, ceil(V / 32)]``, default: None
        Allowed tokens, xgrammar's layout.
    inplace : bool, default: False
        Whether ``logits`` may be overwritten. False leaves them unchanged without copying them up
        front: a copy is made only where the pipeline writes (the bitmask writes the masked logits to
        a new tensor in the pass it makes anyway; logit bias or penalties without a bitmask copy the
        logits once; the sampling weights go to scratch buffers). Not copying by default keeps the
        caller's tensor safe to reuse (another sample, logprobs of their own); pass True when the logits
        are yours to spend, e.g. a model's fresh output.
    sampler : Sampler, default: None (a new one per call)
        A sampler to run, keeping its scratch buffers between calls (see the cost below).

    Notes
    -----
    Cost: every call validates ``params`` and turns them, the histories (as Python lists) and the
    bitmask into tensors (:meth:`SamplingMetadata.build`: O(B x history) Python work), and a fresh
    :class:`Sampler` allocates its scratch buffers (up to three ``[B, V]`` float32 buffers, whose first
    touch of fresh pages costs several memory passes each: a ``clone`` 6.5x a ``copy_`` into a warm
    buffer at 64 x 128,256 on an AMD EPYC, family 26). Passing ``sampler`` spares the buffers. A decode
    loop should keep a :class:`~constrain.sampler.batch.SamplingBatch` (per-row tensors updated only when
    rows join or leave, histories appended to) and one :class:`Sampler`, as :func:`constrain.generate`
    and the server do.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if isinstance(params, SamplingParams):
        params = [params] * batch
    elif len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for {batch} logits rows: pass one, or one per row")
    metadata = SamplingMetadata.build(
        params,
        vocab_size=vocab,
        device=logits.device,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        token_bitmask=token_bitmask,
    )
    return (sampler if sampler is not None else Sampler())(logits, metadata, inplace=inplace)
