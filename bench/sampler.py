"""Sampler benchmark: µs per step, side by side in one run.

Systems, each given the same fresh logits every step (copied in, untimed), interleaved rep by rep
(so that a load drift on a shared machine hits them alike):

- ``public``: the call :func:`constrain.generate` and the server make per step: a persistent
  ``SamplingBatch`` is ``update``-d with the step's requests (each gained one output token since the
  last step: the batch appends it to its histories), its ``metadata()`` is taken (fresh keys, views of
  the histories) and ``Sampler()(logits, metadata)`` samples in place (the loop owns its logits).
- ``sampler``: the inner ``Sampler()(logits, metadata)`` with prebuilt metadata; ``+build`` adds
  ``SamplingMetadata.build`` from Python lists per step.
- ``sample()``: the stateless ``sample(logits, params, prompt_token_ids=, output_token_ids=)`` (logits
  left unchanged: it copies where the pipeline writes; builds its metadata and a fresh ``Sampler``);
  ``sample(sampler=)`` passes a kept ``Sampler`` (warm scratch buffers).
- ``row loop``: the per-request Python loop our design documents warn
  against: each row alone through bias, penalties, temperature, top-k, a
  sort-based top-p, min-p and ``torch.multinomial``.
- ``hf rows``: transformers' ``LogitsProcessorList`` (RepetitionPenalty,
  Temperature, TopK, TopP, MinP) + ``torch.multinomial``, row by row with each
  row's parameters (transformers has no frequency/presence penalty; those rows
  get the rest of their chain).
- ``hf batch``: the same chain batched with one set of parameters for all rows
  (repetition 1.1, temperature 0.8, top-k 50, top-p 0.9, min-p 0.05), for scale.

Rows cycle through eight parameter sets (greedy, top-p without top-k, top-k +
top-p, min-p, penalties, ...). Logits are ``randn * 3``; every row has a
128-token prompt and a 64-token output for the penalties.

``passes`` divides a system's time by one ``copy_`` of the ``[B, V]`` float32 logits into a warm buffer:
the memory passes it costs, if it were bandwidth-bound.

Usage: ``python bench/sampler.py [--device cpu|cuda] [--quick] [--shapes 64x128256,...] [--bitmask-only]
[--json PATH]`` (``--shapes``: only these ``BxV`` pipelines, and no bitmask table; ``--bitmask-only``: the
bitmask table alone; ``--json``: the machine and every table's µs, e.g. ``bench/results/sampler.json``,
which ``bench/plots.py`` reads)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# This file shares its name with the package: import the package, not itself.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from transformers import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from bench.machine import machine_info, machine_line  # noqa: E402
from constrain.sampler import (  # noqa: E402
    Sampler,
    SamplingBatch,
    SamplingMetadata,
    SamplingParams,
    apply_token_bitmask_inplace,
    sample,
)
from constrain.sampler.ops.bitmask import Kernel  # noqa: E402

KERNELS = tuple(k for k in typing.get_args(Kernel) if k != "auto")
"""The bitmask op's kernels, each timed in the bitmask table."""

MIX = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(top_k=50, top_p=0.95),
    SamplingParams(min_p=0.05),
    SamplingParams(top_k=40, repetition_penalty=1.1),
    SamplingParams(top_p=0.8, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=1.2, top_k=100, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.9, repetition_penalty=1.05, top_p=0.95),
]
COMMON = SamplingParams(temperature=0.7, top_p=0.9)
"""The common case: temperature and top-p, no top-k, no penalties."""
ISSUE_MIX = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(top_k=50, top_p=0.9),
    SamplingParams(min_p=0.05, repetition_penalty=1.1),
    SamplingParams(temperature=0.0),
]
"""Issue 16's mix, measured there on an AVX2-only CPU at B = 64, V = 128,256 with a 200-token prompt."""


def timed(fn: Callable[[], object], setup: Callable[[], object], reps: int, device: str) -> float:
    """Median µs of ``fn`` over ``reps`` runs, each after an untimed ``setup``."""
    times = []
    for i in range(reps + 1):
        setup()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first run warms up
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


@dataclass(eq=False)
class Request:
    """A request as the decode loop holds it: parameters and token histories (``output_ids`` grows)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


def interleaved(
    systems: dict[str, tuple[Callable[[], object], Callable[[], object], int]],
    device: str,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median µs of each system ``name: (fn, setup, reps)``, the systems run in turn rep by rep (after one
    untimed warm-up each), each after its untimed ``setup``; ``clock``: wall (``perf_counter``) or this
    thread's CPU time (``thread_time``: what a single-threaded system costs, however loaded the machine)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(1 + max(reps for _, _, reps in systems.values())):
        for name, (fn, setup, reps) in systems.items():
            if rep > reps:
                continue
            setup()
            if device == "cuda":
                torch.cuda.synchronize()
            start = clock()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if rep:  # rep 0 warms up
                times[name].append((clock() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def row_loop(
    logits: torch.Tensor, params: list[SamplingParams], seen: torch.Tensor, out_ids: torch.Tensor
) -> torch.Tensor:
    """The per-request loop: every stage row by row, top-p by a full sort."""
    tokens = []
    for i, p in enumerate(params):
        row = logits[i]
        for t, b in p.logit_bias.items():
            row[t] += b
        if p.repetition_penalty != 1.0:
            old = row[seen[i]]
            row[seen[i]] = torch.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(out_ids[i], minlength=row.numel()).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.greedy:
            tokens.append(row.argmax())
            continue
        row = row / p.temperature
        if p.top_k is not None:
            row = torch.where(row >= row.topk(p.top_k).values[-1], row, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = row.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        if p.min_p:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        tokens.append(torch.multinomial(probs, 1)[0])
    return torch.stack(tokens)


def hf_chain(p: SamplingParams) -> LogitsProcessorList:
    chain = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if not p.greedy:
        chain.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k is not None:
            chain.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            chain.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            chain.append(MinPLogitsWarper(p.min_p))
    return chain


def hf_rows(logits: torch.Tensor, chains: list[LogitsProcessorList], params: list[SamplingParams], seen: torch.Tensor):
    tokens = []
    for i, (chain, p) in enumerate(zip(chains, params, strict=True)):
        scores = chain(seen[i : i + 1], logits[i : i + 1])
        tokens.append(scores.argmax(-1)[0] if p.greedy else torch.multinomial(scores.softmax(-1), 1)[0, 0])
    return torch.stack(tokens)


HF_BATCH = LogitsProcessorList(
    [
        RepetitionPenaltyLogitsProcessor(1.1),
        TemperatureLogitsWarper(0.8),
        TopKLogitsWarper(50),
        TopPLogitsWarper(0.9),
        MinPLogitsWarper(0.05),
    ]
)


def bench_pipeline(
    batch: int,
    vocab: int,
    device: str,
    reps: int,
    slow_reps: int,
    mix: list[SamplingParams] = MIX,
    prompt_len: int = 128,
    output_len: int = 64,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(batch * vocab)
    source = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    work = torch.empty_like(source)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
    outputs = torch.randint(0, vocab, (batch, output_len), generator=gen)
    seen = torch.cat([prompts, outputs], 1).to(device)
    params = [mix[(i + 1) % len(mix)] for i in range(batch)]  # B = 1: a sampled row, not greedy
    build = lambda ps: SamplingMetadata.build(
        ps, vocab_size=vocab, device=device, prompt_token_ids=prompts, output_token_ids=outputs
    )
    metadata, common, greedy = build(params), build([COMMON] * batch), build([SamplingParams(temperature=0)] * batch)
    sampler = Sampler()
    refill = lambda: work.copy_(source)
    chains = [hf_chain(p) for p in params]
    # the public path: the decode loop's persistent batch; each step every request gained one token
    requests = [Request(p, prompts[i].tolist(), outputs[i].tolist()) for i, p in enumerate(params)]
    rows = SamplingBatch(vocab, device=device)
    next_token = iter(torch.randint(0, vocab, (10_000, batch), generator=gen).tolist())

    def step_taken() -> None:  # the previous step's tokens (the loop's requests take them), fresh logits
        for r, token in zip(requests, next(next_token), strict=True):
            r.output_ids.append(token)
        work.copy_(source)

    def public() -> object:
        rows.update(requests)
        return sampler(work, rows.metadata())

    rows.update(requests)
    kept = Sampler()  # sample()'s scratch buffers kept between calls
    fast, slow = reps, slow_reps
    return interleaved(
        {
            "public": (public, step_taken, fast),
            "sampler": (lambda: sampler(work, metadata), refill, fast),
            "+build": (lambda: sampler(work, build(params)), refill, fast),
            "sample()": (
                lambda: sample(source, params, prompt_token_ids=prompts, output_token_ids=outputs),
                lambda: None,
                fast,
            ),
            "sample(sampler=)": (
                lambda: sample(source, params, prompt_token_ids=prompts, output_token_ids=outputs, sampler=kept),
                lambda: None,
                fast,
            ),
            "common": (lambda: sampler(work, common), refill, fast),
            "greedy": (lambda: sampler(work, greedy), refill, fast),
            "row loop": (lambda: row_loop(work, params, seen, outputs.to(device)), refill, slow),
            "hf rows": (lambda: hf_rows(work, chains, params, seen), refill, slow),
            "hf batch": (lambda: torch.multinomial(HF_BATCH(seen, work).softmax(-1), 1), refill, slow),
            "clone": (source.clone, lambda: None, fast),
            "copy": (lambda: work.copy_(source), lambda: None, fast),
        },
        device,
        clock,
    )


def profile_issue_mix(device: str) -> None:
    """Where the issue-16 mix's time goes: torch's profiler, op by op with input shapes."""
    batch, vocab = 64, 128_256
    gen = torch.Generator().manual_seed(0)
    source = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    work = torch.empty_like(source)
    prompts = torch.randint(0, vocab, (batch, 200), generator=gen)
    params = [ISSUE_MIX[i % len(ISSUE_MIX)] for i in range(batch)]
    metadata = SamplingMetadata.build(params, vocab_size=vocab, device=device, prompt_token_ids=prompts)
    sampler = Sampler()
    sampler(work.copy_(source), metadata)  # warm the scratch buffers
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(10):
            sampler(work.copy_(source), metadata)
    print("\nWhere the issue-16 mix's time goes (10 steps; the 10 copy_ calls of [64, 128256] refill the input)")
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=28, max_shapes_column_width=60
        )
    )


def count_waits(device: str) -> None:
    """How often one call makes the host wait for the GPU (B = 64, V = 128,256, the pipeline's mix), and where:
    torch's synchronization debug mode, which warns at each op that waits (it does not see every kind)."""
    if device != "cuda":
        raise SystemExit("--waits counts waits for a GPU: pass --device cuda")
    batch, vocab = 64, 128_256
    gen = torch.Generator().manual_seed(0)
    source = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    work = torch.empty_like(source)
    prompts = torch.randint(0, vocab, (batch, 128), generator=gen)
    params = [MIX[(i + 1) % len(MIX)] for i in range(batch)]
    sampler = Sampler()
    print("\nHost waits for the GPU in one call (B = 64, V = 128,256), by source line")
    for name, mix in (("public", params), ("greedy", [SamplingParams(temperature=0)] * batch)):
        requests = [Request(p, prompts[i].tolist(), []) for i, p in enumerate(mix)]
        rows = SamplingBatch(vocab, device=device)
        rows.update(requests)
        sampler(work.copy_(source), rows.metadata())  # warm: the call below reuses the row tensors
        for r in requests:
            r.output_ids.append(7)
        work.copy_(source)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows.update(requests)
            sampler(work, rows.metadata())
        torch.cuda.set_sync_debug_mode(0)
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
        print(f"{name}: {sum(where.values())} waits" + "".join(f", {n} at {at}" for at, n in where.most_common()))


def bench_bitmask(batch: int, vocab: int, device: str, reps: int) -> dict[str, float]:
    """Bitmask application: the sampler's op (its ``"auto"`` kernel, then each kernel), xgrammar's and a
    ``masked_fill_`` of a ready bool mask, interleaved rep by rep, so load drifts hit all alike."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(1)
    source = torch.randn(batch, vocab, generator=gen).to(device)
    work = torch.empty_like(source)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen, dtype=torch.int32).to(device)
    ready = torch.rand(batch, vocab, generator=gen).to(device) < 0.5
    systems = {
        "sampler": lambda: apply_token_bitmask_inplace(work, bitmask),
        **{
            kernel: lambda kernel=kernel: apply_token_bitmask_inplace(work, bitmask, kernel=kernel)
            for kernel in KERNELS
        },
        "xgrammar": lambda: xgr.apply_token_bitmask_inplace(work, bitmask),
        "masked_fill_": lambda: work.masked_fill_(ready, float("-inf")),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(reps):
        for name, fn in systems.items():
            times[name].append(timed(fn, lambda: work.copy_(source), 1, device))
    return {name: statistics.median(t) for name, t in times.items()}


COLUMNS = ("public", "sampler", "+build", "sample()", "sample(sampler=)", "common", "greedy")
"""The fast systems, whose µs and passes the tables print (then the slow ones' µs)."""
HEADER = (
    "| B | V | " + " | ".join(COLUMNS) + " | row loop | hf rows | hf batch | clone | copy_ "
    "| hf rows / public | hf batch / public | hf rows / sampler | " + " | ".join(f"{k} passes" for k in COLUMNS) + " |"
)


def _row(batch: int, vocab: int, r: dict[str, float]) -> str:
    us = " | ".join(f"{r[k]:,.0f}" for k in (*COLUMNS, "row loop", "hf rows", "hf batch", "clone", "copy"))
    passes = " | ".join(f"{r[k] / r['copy']:.1f}" for k in COLUMNS)
    return (
        f"| {batch} | {vocab:,} | {us} | {r['hf rows'] / r['public']:.1f}x | {r['hf batch'] / r['public']:.1f}x "
        f"| {r['hf rows'] / r['sampler']:.1f}x | {passes} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, B <= 64")
    parser.add_argument("--bitmask-only", action="store_true", help="only the bitmask table")
    parser.add_argument("--profile", action="store_true", help="also profile the issue-16 mix op by op")
    parser.add_argument(
        "--waits", action="store_true", help="also count the host's waits for the GPU in one call (cuda only)"
    )
    parser.add_argument("--isa", choices=["avx2"], help="re-run with torch's and oneDNN's CPU kernels capped")
    parser.add_argument("--json", type=Path, default=None, help="also write the machine and every table's µs here")
    parser.add_argument("--shapes", default=None, help="only these pipelines, e.g. 64x128256 (no bitmask table)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time the pipelines by wall clock, or by this thread's CPU time (needs OMP_NUM_THREADS=1; "
        "steadier on a shared machine, where other processes preempt a long step more than a short copy)",
    )
    args = parser.parse_args()
    if args.isa and os.environ.get("ATEN_CPU_CAPABILITY") != args.isa:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": args.isa, "ONEDNN_MAX_CPU_ISA": args.isa.upper()}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    reps = 5 if args.quick else 20
    clock = time.perf_counter
    if args.clock == "cpu":
        if args.device != "cpu" or torch.get_num_threads() != 1:
            parser.error("--clock cpu counts the calling thread's CPU time: run on the CPU with OMP_NUM_THREADS=1")
        clock = time.thread_time
    batches = [1, 16, 64] if args.quick else [1, 16, 64, 256]
    print(machine_line(args.device) + "\n")
    print(
        f"Pipeline, µs per step (median, {args.clock} clock, systems interleaved); ratios are other / public; "
        "passes = system / copy_"
    )
    header = HEADER
    print(header + "\n" + "|---" * (header.count("|") - 1) + "|")
    pipeline: list[dict[str, object]] = []
    bitmasks: list[dict[str, object]] = []
    shapes = [(b, v) for v in (49_152, 128_256) for b in batches]
    if args.shapes:
        shapes = [(int(b), int(v)) for b, v in (shape.split("x") for shape in args.shapes.split(","))]
    for batch, vocab in [] if args.bitmask_only else shapes:
        slow = min(reps, max(5, 200 // batch))  # the slow systems' medians: of 5 at least (they vary most)
        r = bench_pipeline(batch, vocab, args.device, reps, slow, clock=clock)
        pipeline.append({"batch": batch, "vocab": vocab, "us": r})
        print(_row(batch, vocab, r), flush=True)
    mix: dict[str, object] = {}
    if not args.bitmask_only:
        print(
            "\nIssue 16's mix (temperature + top-p, top-k + top-p, min-p + repetition over 200 prompt tokens, greedy)"
        )
        print(header + "\n" + "|---" * (header.count("|") - 1) + "|")
        r = bench_pipeline(64, 128_256, args.device, reps, min(reps, 5), ISSUE_MIX, 200, 0, clock=clock)
        print(_row(64, 128_256, r), flush=True)
        mix = {"batch": 64, "vocab": 128_256, "us": r}
    if args.profile:
        profile_issue_mix(args.device)
    if args.waits:
        count_waits(args.device)
    print("\nBitmask application, µs (median, systems interleaved)")
    print(f"| B | V | sampler (auto) | {' | '.join(KERNELS)} | xgrammar "
          "| masked_fill_ (ready bool mask) |")  # fmt: skip
    print(f"|---|---|---|{'---|' * len(KERNELS)}---|---|")
    for batch, vocab in [] if args.shapes else [(1, 49_152), (1, 128_256), (64, 49_152), (64, 128_256)]:
        r = bench_bitmask(batch, vocab, args.device, reps * 50)
        bitmasks.append({"batch": batch, "vocab": vocab, "us": r})
        kernels = " | ".join(f"{r[kernel]:,.0f}" for kernel in KERNELS)
        print(f"| {batch} | {vocab:,} | {r['sampler']:,.0f} | {kernels} | {r['xgrammar']:,.0f} "
              f"| {r['masked_fill_']:,.0f} |", flush=True)  # fmt: skip
    if args.json:
        report = {
            "benchmark": "sampler",
            "machine": machine_info(args.device),
            "settings": {"device": args.device, "quick": args.quick, "reps": reps, "clock": args.clock},
            "pipeline": pipeline,
            "four_row_mix": mix,
            "bitmask": bitmasks,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
