"""Constrained vs unconstrained generation on the default model, side by side in one run.

For batch 1 and batch 8, greedy: a JSON extraction constrained by a schema (default ``max_tokens``:
the grammar ends it; jump-forward on, speculation off), the same without jump-forward, the same with
n-gram speculation (adaptive, the default), the same with the
masks filled on a worker thread beside the forward pass (the default off the CPU), the same with
``max_tokens`` set to its output length (so the termination budget checks every step), and
unconstrained generation of the same number of tokens. Prints tokens/s, forward passes, the ratio
constrained / unconstrained, batch 8 / batch 1, and the split (forward, mask fill, sampler, stop
checks + detokenizer) in ms per forward pass.

Then speculation itself, at batch 1 and 8, greedy and sampled (temperature 0.7, the rows seeded
0..7), on three workloads: a quote extracted verbatim (the output copies the prompt: prompt lookup
drafts it), a story (free text, 64 tokens: drafts mostly rejected) and the JSON extraction above.
Off, adaptive (the default: the drafts that pay, by each proposal's prior, each request's acceptance
and the measured forward cost) and every draft fed (the policy before the cost model), with tokens/s
and forward passes; each ratio to off is the median of the repeats' own ratios (a repeat's
configuration against that repeat's off), with their range; each repeat starts one configuration later
than the one before, so that none always runs first. A cell (workload, batch, decoding) runs
``--repeats`` repeats at least, and more (up to three times as many) until it has taken ``--seconds``:
the short cells, whose runs a busy moment of a shared machine moves most, get the most repeats. Beside
the timings, the median run's tokens per second with its passes priced by the forward cost tables
measured first (each pass by its rows and width), against off's: what the configuration's passes cost,
free of the machine's noise. ``--speculation`` runs only that table.

Usage: ``python bench/generate.py [--repeats 5] [--seconds 60] [--speculation]``
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.decode import loop  # noqa: E402
from constrain.decode.drafts import MAX_DRAFT  # noqa: E402
from constrain.models.cost import ForwardCost, batch_rows, forward_cost  # noqa: E402

gen = importlib.import_module("constrain.generation")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "job": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "job"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Extract as JSON: Maria Lopez, 42, a nurse, lives in Madrid."}]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
QUOTE_SCHEMA = {
    "type": "object",
    "properties": {"speaker": {"type": "string", "maxLength": 40}, "quote": {"type": "string", "maxLength": 300}},
    "required": ["speaker", "quote"],
    "additionalProperties": False,
}
QUOTE = [{"role": "user", "content": "Extract as JSON the speaker and their exact words, quoted verbatim: Maria Lopez "
          'said "The new clinic on Gran Via opens on Monday at nine, and every nurse from the old ward will move there '
          'with their patients."'}]  # fmt: skip
WORKLOADS: dict[str, dict[str, Any]] = {
    "quote": {"prompt": QUOTE, "schema": QUOTE_SCHEMA},
    "story": {"prompt": STORY, "max_tokens": 64},
    "JSON extraction": {"prompt": PROMPT, "schema": SCHEMA},
}
"""The speculation table's workloads: keyword arguments of ``constrain.Request``."""
EVERY_DRAFT = ForwardCost(tokens=(1,), seconds=(1.0,))
"""A cost under which any width is free: the adaptive policy then feeds every draft (the old policy), where the
rows are planned each on its own (``together=False``: a row's drafts count whether or not it ends last)."""
SPECULATION: dict[str, dict[str, Any]] = {
    "off": {"speculative": False},
    "adaptive (default)": {"speculative": True},
    "every draft": {"speculative": True, "forward_cost": EVERY_DRAFT, "together": False},
}
"""The speculation table's configurations: keyword arguments of ``constrain.decode.loop.run``."""


def run(
    handle: constrain.ModelHandle,
    spec: constrain.Request,
    batch: int,
    overlap: bool | None = None,
    jump_forward: bool = True,
    speculative: bool = False,
    forward_cost: ForwardCost | None = None,
    together: bool = True,
    passes: list[tuple[int, int]] | None = None,
) -> tuple[int, float, dict[str, float], int]:
    """(output tokens, seconds, per-stage seconds, forward passes) of one batched generation: ``batch``
    copies of ``spec`` (each of its ``n`` completions). Each pass's ``(rows, tokens per row)`` is appended to
    ``passes`` where given."""
    requests = [r for _ in range(batch) for r in gen.admit(handle, spec)]
    timings: dict[str, float] = {}
    forward, calls = handle.model.forward, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if passes is not None:
            passes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    handle.model.forward = counted
    start = time.perf_counter()
    try:
        loop.run(handle, requests, timings, overlap=overlap, jump_forward=jump_forward, speculative=speculative,
                 forward_cost=forward_cost, together=together)  # fmt: skip
    finally:
        del handle.model.forward
    seconds = time.perf_counter() - start
    return sum(len(r.output_ids) for r in requests), seconds, timings, calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per row, at least")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="speculation: more repeats (up to 3x) until a cell has taken this long")  # fmt: skip
    parser.add_argument("--speculation", action="store_true", help="only the speculation table")
    args = parser.parse_args()
    print(machine_line())
    handle = constrain.load_model()
    if not args.speculation:
        overview(handle, args.repeats)
    speculation(handle, args.repeats, args.seconds)


def overview(handle: constrain.ModelHandle, repeats: int) -> None:
    """The first table: constrained configurations against unconstrained generation."""
    base = constrain.generate(handle, PROMPT, schema=SCHEMA, temperature=0, max_tokens=120)
    length = len(base.token_ids)
    print(f"model {handle.name}, {torch_threads()} threads; constrained output: {length} tokens, {base.text!r}\n")
    print("| run | batch | tokens | s | tokens/s | forward passes | forward ms/pass | mask | sampler | stop+detok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rates: dict[tuple[str, int], float] = {}
    specs = {
        "constrained": constrain.Request(PROMPT, schema=SCHEMA, sampling={"temperature": 0}),
        "constrained, no jump-forward": constrain.Request(PROMPT, schema=SCHEMA, sampling={"temperature": 0}),
        "constrained, speculative": constrain.Request(PROMPT, schema=SCHEMA, sampling={"temperature": 0}),
        "constrained, masks beside the forward": constrain.Request(PROMPT, schema=SCHEMA, sampling={"temperature": 0}),
        "constrained, tight": constrain.Request(PROMPT, schema=SCHEMA, max_tokens=length, sampling={"temperature": 0}),
        "unconstrained": constrain.Request(STORY, max_tokens=length, sampling={"temperature": 0}),
    }
    for batch in (1, 8):
        # round robin, so that the machine's drifts touch every configuration alike
        runs: dict[str, list[tuple[int, float, dict[str, float], int]]] = {name: [] for name in specs}
        for _ in range(repeats):
            for name, spec in specs.items():
                overlap, jump = (True if "beside" in name else None), "no jump" not in name
                runs[name].append(run(handle, spec, batch, overlap, jump, speculative="speculative" in name))
        for name in specs:
            tokens, seconds, timings, steps = sorted(runs[name], key=lambda r: r[1])[len(runs[name]) // 2]  # median
            split = {k: v / steps * 1e3 for k, v in timings.items()}
            rates[name, batch] = tokens / seconds
            print(
                f"| {name} | {batch} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} | {steps:.0f} "
                f"| {split.get('forward', 0):.1f} | {split.get('mask', 0):.2f} | {split.get('sampler', 0):.2f} "
                f"| {split.get('stop+detokenize', 0):.2f} |",
                flush=True,
            )
    for batch in (1, 8):
        ratio = rates["constrained", batch] / rates["unconstrained", batch]
        tight = rates["constrained, tight", batch] / rates["unconstrained", batch]
        print(f"\nbatch {batch}: constrained runs at {ratio:.1%} of unconstrained tokens/s "
              f"({tight:.1%} with max_tokens at the output's length)", end="")  # fmt: skip
    print(f"\nbatch 8 / batch 1 tokens/s: constrained {rates['constrained', 8] / rates['constrained', 1]:.2f}x, "
          f"unconstrained {rates['unconstrained', 8] / rates['unconstrained', 1]:.2f}x\n")  # fmt: skip


def speculation(handle: constrain.ModelHandle, repeats: int, seconds: float) -> None:
    """The speculation table: off, adaptive and every draft, per workload, at batch 1 and 8, greedy and
    sampled (medians of ``repeats`` at least, more until a cell has taken ``seconds``, up to 3x)."""
    costs: dict[int, ForwardCost] = {}  # by batch size class
    for batch in (1, 2, 4, 8):  # measured here, outside the timed runs (a batch of 8 shrinks as its rows finish)
        costs[batch] = cost = forward_cost(handle.model, batch=batch, width=1 + MAX_DRAFT)
        curve = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(cost.tokens, cost.seconds, strict=True))
        print(f"forward cost timed on {batch} rows (tokens fed: ms): {curve}; one draft per row costs "
              f"{cost.relative(batch, 2):.2f}x\n")  # fmt: skip

    def priced(passes: list[tuple[int, int]]) -> float:
        """Seconds of these passes by the cost tables (a batch's rows read its size class's table)."""
        return sum(costs[batch_rows(rows)].seconds_for(rows * width) for rows, width in passes)

    print(f"{repeats} repeats per row at least, more (up to {3 * repeats}) until a cell has taken {seconds:.0f} s; "
          "round robin; tokens/s and the ratio to off are medians, with the range (min-max) of the repeats' ratios "
          "(each repeat's configuration against the same repeat's off); \"by the table\": tokens per second of "
          "the median run's passes priced by the cost tables above, against off's\n")  # fmt: skip
    print("| workload | decoding | batch | speculation | repeats | tokens | s | tokens/s | forward passes "
          "| tokens/s vs off | range vs off | by the table vs off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    decodings = (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.7, "seed": 0}))
    for (workload, request), batch, (decoding, sampling) in itertools.product(WORKLOADS.items(), (1, 8), decodings):
        spec = constrain.Request(**request, n=batch, sampling=sampling)  # sampled: seeds 0..batch-1
        runs: dict[str, list[tuple[int, float, dict[str, float], int]]] = {name: [] for name in SPECULATION}
        table: dict[str, list[float]] = {name: [] for name in SPECULATION}  # tokens/s by the cost tables, per run
        began = time.perf_counter()
        while len(runs["off"]) < repeats or (time.perf_counter() - began < seconds and len(runs["off"]) < 3 * repeats):
            turn = len(runs["off"]) % len(SPECULATION)  # round robin, each repeat starting one later: no order bias
            for name in list(SPECULATION)[turn:] + list(SPECULATION)[:turn]:
                passes: list[tuple[int, int]] = []
                runs[name].append(run(handle, spec, 1, **SPECULATION[name], passes=passes))
                table[name].append(runs[name][-1][0] / priced(passes))
        medians = {name: sorted(range(len(r)), key=lambda i: r[i][1])[len(r) // 2] for name, r in runs.items()}
        for name, median in medians.items():
            tokens, secs, _, steps = runs[name][median]
            ratios = sorted(
                (t / s) / (t_off / s_off)
                for (t, s, _, _), (t_off, s_off, _, _) in zip(runs[name], runs["off"], strict=True)
            )
            by_table = table[name][median] / table["off"][medians["off"]]
            print(f"| {workload} | {decoding} | {batch} | {name} | {len(ratios)} | {tokens} | {secs:.2f} "
                  f"| {tokens / secs:.1f} | {steps} | {ratios[len(ratios) // 2]:.1%} "
                  f"| {ratios[0]:.0%}-{ratios[-1]:.0%} | {by_table:.1%} |", flush=True)  # fmt: skip


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
