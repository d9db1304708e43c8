"""What a forward pass costs, by the number of tokens it feeds: measured once per model, machine and batch size
(rounded down to a power of two), saved on disk.

Speculative decoding pays only where a wider pass costs little more than a narrow one. A batch of
``b`` rows, each fed ``w`` tokens (the last token and its drafts, rows padded to the widest), feeds
``b * w`` tokens; its cost against plain decoding (``w = 1``) is ``seconds(b * w) / seconds(b)``
(:meth:`ForwardCost.relative`), read from passes timed on that batch's rows (:func:`forward_cost`), each
with its own context, as the batch runs. Measured with SmolLM2-135M in bfloat16 on this project's 2-core CPU
(Intel Xeon, AVX-512; :func:`measure_forward_cost`, 0.47 s): 33 ms for 1 token, 37 for 4, 46 for 16, 85 for
64; batch 8 at width 2 took 50 ms (the curve: 46) and at width 5, 70 ms (the curve: 66). So one draft per
row costs 4% more at batch 1 and 15% at batch 8. In float32 on an AMD EPYC (AVX2), 8 rows of 2 tokens took
1.19x 8 rows of 1, where one row's table read 1.01x for 16 tokens against 8.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import inspect
import json
import os
import platform
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from constrain.caches import register
from constrain.models.loading import PrepackedLinear, cache_dir

__all__ = [
    "BUSY",
    "DRIFT",
    "KNEE",
    "MEASURE_TOKENS",
    "METHOD",
    "ForwardCost",
    "batch_rows",
    "cache_keyword",
    "forward_cost",
    "measure_forward_cost",
    "non_decreasing",
    "saved_cost_path",
]

MEASURE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 1024)
"""Tokens per row of each timed forward pass, in order, until one costs :data:`KNEE` times a one-token pass:
dense where decoding runs (a row one draft wide feeds 2 tokens), so that the curve is read where it was
measured, not interpolated across a knee."""

DRIFT = 2.0
"""A saved cost is measured again when a one-token pass now takes this many times more than it says
(another machine under the same name, a driver update): the fastest of five passes, so that a busy moment
of a shared machine does not pass for a drift. (A pass faster than it says: :data:`BUSY`.)"""

BUSY = 1.25
"""A saved cost whose one-token pass took this many times the pass the machine now makes (the fastest of
five) or more was timed while something else ran, and is measured again: load slows a pass, nothing speeds
one up. On a 2-core AMD EPYC (AVX2), a table timed on a slowed machine had one row's pass at 163.6 ms,
flat from 1 to 12 tokens, where the machine makes it in 82: within :data:`DRIFT`, later processes would
have kept it and fed drafts as if free."""

KNEE = 2.0
"""A measurement stops at the first pass that costs this many times a one-token pass and reaches the widest
pass asked about: past it the cost grows about in proportion to the tokens, as :meth:`ForwardCost.seconds_for`
extrapolates (SmolLM2-135M on 2 CPU cores stops at 64 tokens, about half a second in all; a GPU, flat much
longer, goes on to larger passes)."""

CONTEXT_TOKENS = 16
"""Tokens already in the throwaway KV cache of each timed pass, as in decoding."""


def cache_keyword(model: Any) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache`` in recent
    transformers (5.24 deprecates ``past_key_values``, with a warning), else ``past_key_values``. Read
    from the class, so that a wrapper of the instance's ``forward`` (a counter in a test) changes nothing."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one forward pass by the number of tokens it feeds (all rows together), linear between
    the points given and, past the last one, in proportion to the tokens (a table of one point: every
    pass costs the same, a cost under which drafts are free).

    Past the last point the cost is not read along the last segment: a table measured flat so far (a
    pass's cost set by reading the weights, on a CPU with little memory bandwidth: 1 to 16 tokens took
    177 ms each for SmolLM2-135M in float32 on an AMD EPYC, AVX2) would call any wider pass free, and a
    batch of 8 rows then fed 14 drafts each in passes that cost 2 to 3 times a plain one. In proportion is
    what a compute-bound pass costs, so a pass past the table is never taken for cheaper than it is.

    Parameters
    ----------
    tokens : tuple of int
        Tokens fed per pass, strictly increasing from 1.
    seconds : tuple of float
        Seconds of a pass of that many tokens: positive and non-decreasing (a pass that feeds more
        tokens is never cheaper). Only ratios are used, so any unit works.

    Raises
    ------
    ValueError
        On a table that breaks these rules.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens or self.tokens[0] != 1:
            raise ValueError(f"tokens must start at 1 with one time each, got {self.tokens} and {self.seconds}")
        if any(a >= b for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"tokens must be strictly increasing, got {self.tokens}")
        if not all(0 < s < float("inf") for s in self.seconds) or any(
            a > b for a, b in zip(self.seconds, self.seconds[1:], strict=False)
        ):
            raise ValueError(f"seconds must be positive, finite and non-decreasing, got {self.seconds}")

    def seconds_for(self, tokens: int) -> float:
        """Seconds of a pass feeding ``tokens`` tokens (at least 1)."""
        if len(self.tokens) == 1:
            return self.seconds[0]
        if tokens > self.tokens[-1]:
            return self.seconds[-1] * tokens / self.tokens[-1]
        k = max(bisect.bisect_left(self.tokens, tokens), 1)  # segment [k - 1, k]
        (t0, t1), (s0, s1) = self.tokens[k - 1 : k + 1], self.seconds[k - 1 : k + 1]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)

    def relative(self, batch: int, width: int) -> float:
        """Cost of a pass of ``batch`` rows ``width`` tokens wide against one token per row (1.0 at
        width 1; padding counts, as the model computes it)."""
        return self.seconds_for(batch * width) / self.seconds_for(batch)


def measure_forward_cost(
    model: Any, *, tokens: tuple[int, ...] = MEASURE_TOKENS, repeats: int = 3, upto: int = 1, rows: int = 1
) -> ForwardCost:
    """Time forward passes of ``model`` (a transformers causal LM, where its parameters live) feeding
    ``rows`` rows of ``tokens[i]`` tokens each, after :data:`CONTEXT_TOKENS` per row in a throwaway KV
    cache, and a one-token pass first: a table of ``1, rows * tokens[0], rows * tokens[1]...`` tokens.
    The first sweep stops after the first size that costs :data:`KNEE` times the first and reaches
    ``upto`` tokens per row (the widest pass the caller will ask about), or at the model's context window;
    ``repeats`` sweeps in all, each size keeping its fastest pass (the others met a busy machine, and
    sweeping rather than repeating in place spreads a burst of load over sizes), made non-decreasing by
    :func:`non_decreasing`. Does not change the model."""
    if not tokens or tokens[0] != 1 or repeats < 1 or rows < 1:
        raise ValueError(f"tokens must start at 1, repeats and rows be at least 1, got {tokens}, {repeats}, {rows}")
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    keyword = cache_keyword(model)
    room = int(getattr(model.config, "max_position_embeddings", 1 << 30)) - CONTEXT_TOKENS

    def timed(b: int, n: int) -> float:
        ids = (torch.arange(b * n, device=device) % vocab).view(b, n)  # [b, n]
        mask = torch.ones(b, CONTEXT_TOKENS + n, dtype=torch.long, device=device)  # [b, C + n]
        positions = torch.arange(CONTEXT_TOKENS, CONTEXT_TOKENS + n, device=device).expand(b, n)  # [b, n]
        cache = {keyword: copy.deepcopy(getattr(contexts[b], keyword))}
        began = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
        out.logits[0, -1, 0].item()  # waits for the device
        return time.perf_counter() - began

    shapes: list[tuple[int, int]] = []  # (rows, tokens per row) of each size
    best: list[float] = []  # seconds of a pass of each shape
    with torch.inference_mode():
        contexts = {b: model(input_ids=torch.zeros(b, CONTEXT_TOKENS, dtype=torch.long, device=device), use_cache=True)
                    for b in {1, rows}}  # fmt: skip
        for b, n in [(1, 1)] + [(rows, n) for n in tokens if rows > 1 or n > 1]:
            if n > room or (len(best) > 1 and best[-1] >= KNEE * best[0] and shapes[-1][1] >= upto):
                break
            shapes.append((b, n))
            best.append(timed(b, n))
        for _ in range(repeats - 1):
            best = [min(t, timed(b, n)) for t, (b, n) in zip(best, shapes, strict=True)]
    return ForwardCost(tuple(b * n for b, n in shapes), tuple(non_decreasing(best)))


def non_decreasing(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in squared error (pool adjacent violators): a run that
    decreases is replaced by its mean. Not a running maximum: one pass timed slow (a busy moment, or a
    kernel that handles 3 rows worse than 8) would then flatten every size after it, and a flat stretch
    reads as free drafts (on an AMD EPYC, AVX2: 3 tokens timed at 201 ms made 4 to 16 tokens cost the same,
    so a batch of 8 fed a draft per row for 1% more, where it cost 19% more). Pure."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of each pooled run
    for value in values:
        total, count = value, 1
        while blocks and blocks[-1][0] * count > total * blocks[-1][1]:  # the run before has the higher mean
            before, n = blocks.pop()
            total, count = total + before, count + n
        blocks.append((total, count))
    return [total / count for total, count in blocks for _ in range(count)]


_measured: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, str, int], ForwardCost]] = weakref.WeakKeyDictionary()
"""Per model (dropped with it), per (device, dtype) of its parameters, attention and rows measured: its cost."""
register("models.forward_cost", lambda: {"entries": sum(map(len, list(_measured.values()))), "maxsize": -1})


METHOD = "rows, pooled"
"""How a saved cost was measured, part of its name: a cost measured another way is measured again."""


def batch_rows(batch: int) -> int:
    """The rows of the passes timed for a batch of ``batch`` rows: the largest power of two not above it, so
    that a batch that shrinks as its rows finish reads a table measured once for its size class."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    return 1 << (batch.bit_length() - 1)


def saved_cost_path(model: Any, rows: int = 1) -> Path:
    """Where ``model``'s cost timed on ``rows`` rows is saved: under :func:`~constrain.models.loading.cache_dir`,
    named by what the cost depends on (the model's class and configuration, where its parameters live and
    their dtype, whether its linear layers are prepacked, its attention, the processor, torch's thread count and
    version, the rows, :data:`METHOD`), not by the weights' values."""
    parameter = next(model.parameters())
    device = parameter.device
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    config = model.config.to_json_string() if hasattr(model, "config") else ""
    packed = any(isinstance(module.forward, PrepackedLinear) for module in model.modules())
    what = [type(model).__qualname__, config, str(device), str(parameter.dtype), processor,
            str(torch.get_num_threads()), torch.__version__, rows, METHOD]  # fmt: skip
    if packed:  # (new items only where they apply: the tables saved for plain sdpa models keep their names)
        what.append("prepacked")
    attention = _attention(model)
    if attention != "sdpa":
        what.append(attention)
    return cache_dir() / "forward_cost" / f"{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]}.json"


def _attention(model: Any) -> str:
    """``model``'s attention implementation (transformers' name; ``sdpa`` where it has no config)."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa")


def _cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), or the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def forward_cost(model: Any, *, batch: int = 1, width: int = 1) -> ForwardCost:
    """``model``'s :class:`ForwardCost` for a batch of ``batch`` rows where its parameters now live: passes timed
    on :func:`batch_rows` rows, up to ``width`` tokens per row at least (where the context window allows),
    and the same in every process on this machine: read from disk (:func:`saved_cost_path`) where a process
    measured it before, else measured (:func:`measure_forward_cost`: a second for one row on a CPU, 10 s
    for 8 rows 17 tokens wide on a 2-core AVX2 CPU) and saved; then remembered for as long as the model
    lives. A saved cost whose one-token pass no longer matches this machine (:data:`DRIFT`), was timed on
    a busy machine (:data:`BUSY`), or stops short of ``width``, is measured again. Since the drafts a batch
    feeds follow from this cost, a cost read from disk makes them, and so seeded outputs, the same across
    processes (where a wider pass changes the logits' last bits: bfloat16)."""
    parameter = next(model.parameters())
    rows = batch_rows(batch)
    key = (str(parameter.device), str(parameter.dtype), _attention(model), rows)
    costs = _measured.setdefault(model, {})
    if key not in costs or not _covers(costs[key], model, rows, width):
        costs[key] = _saved_or_measured(model, rows, width)
    return costs[key]


def _covers(cost: ForwardCost, model: Any, rows: int, width: int) -> bool:
    """Whether ``cost`` was measured up to ``width`` tokens per row, or as far as ``model``'s context window goes."""
    room = int(getattr(model.config, "max_position_embeddings", 1 << 30)) - CONTEXT_TOKENS
    widest = cost.tokens[-1] // rows
    return widest >= min(width, room) or widest == max(n for n in MEASURE_TOKENS if n <= room)


def _saved_or_measured(model: Any, rows: int, width: int) -> ForwardCost:
    path = saved_cost_path(model, rows)
    try:
        saved = json.loads(path.read_text())
        cost = ForwardCost(tuple(saved["tokens"]), tuple(saved["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        cost = None
    if cost is not None and _covers(cost, model, rows, width):
        now = measure_forward_cost(model, tokens=(1,), repeats=5).seconds[0]
        if 1 / BUSY < now / cost.seconds[0] <= DRIFT:
            return cost
    cost = measure_forward_cost(model, upto=max(width, cost.tokens[-1] // rows if cost is not None else 1), rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"tokens": cost.tokens, "seconds": cost.seconds}))
    tmp.replace(path)  # atomic: a process reading it meanwhile gets the old cost or the new one
    return cost
