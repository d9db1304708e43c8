"""What the mask adds to a decode step, at batch 1, 8 and 64, on the default model, side by side in one run.

Per batch size, greedy, at most ``--tokens`` steps (times are per step: the runs need not take as many):

- *unconstrained*: free text;
- *unchecked schema*: a schema the grammar enforces whole (no value checks);
- *checked schemas*: a mix of schemas holding keywords beyond the grammar (``uniqueItems``, ``multipleOf``
  on floats, ``patternProperties``, ``not``, ``maxProperties``), one per row,
  with the value checks on the token drawn (the default for greedy and unfiltered sampling);
- *checked schemas, eager*: the same with every row checked eagerly (what top-p sampling, logprobs or a
  host that samples with no way back get).

Prints, per run, ms per step of each stage (the loop's own timings: forward, mask, sampler, checks,
stop+detokenize) and what the constraint's own stages (mask, checks, stop+detokenize) add per step, as a
share of the unconstrained step, and the whole step against the unconstrained one. Medians of ``--repeats``
runs, taken round robin.

On a GPU the forward pass is launched, not waited for: its time shows in the stage that next waits for
the device (the sampler's), and the mask's is what is left of the fill once the forward is launched (the
loop fills the masks on a worker thread beside it). The step ratio is then the figure to read.

``--random-weights``: the model folder's ``config.json`` with random weights (seed 0) and its tokenizer, for a
machine without the model's package (a GPU machine reaches no registry): the forward costs what the
architecture costs, while the text written, and so the constraint's work, is a random model's.

Usage: ``python bench/overhead.py [--repeats 3] [--tokens 48] [--batches 1,8,64] [--device cuda] [--model NAME_OR_PATH
[--random-weights]] [--json PATH]`` (``--json``: the machine and every row's ms per stage, e.g.
``bench/results/overhead.json``, which ``bench/plots.py`` reads)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_info, machine_line  # noqa: E402
from constrain.decode import loop, masks  # noqa: E402
from constrain.models.loading import default_dtype  # noqa: E402

gen = importlib.import_module("constrain.generation")

PROMPT = [{"role": "user", "content": "Describe a product of a small shop as JSON."}]
UNCHECKED = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}  # fmt: skip
CHECKED: list[tuple[dict[str, Any], str]] = [
    (
        {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "rectangle"]},
         "dimensions": {"type": "object", "properties": {"width": {"type": "number"}, "height": {"type": "number"}},
                        "required": ["width"]}}, "required": ["shape", "dimensions"]},
        "generation",
    ),  # calculate_area (specification mode: BudgetError at 96 tokens, the closing search gives up)
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
      "uniqueItems": True, "maxItems": 6}}, "required": ["tags"], "additionalProperties": False}, "generation"),
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.01, "minimum": 0},
      "name": {"type": "string", "not": {"const": ""}, "maxLength": 30}}, "required": ["name", "price"],
      "additionalProperties": False}, "generation"),
    ({"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
      "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"], "maxProperties": 4},
     "generation"),
]  # fmt: skip


def _requests(handle: constrain.ModelHandle, run: str, batch: int, tokens: int) -> list[Any]:
    greedy = {"temperature": 0}
    specs = []
    for row in range(batch):
        if run == "unconstrained":
            spec = constrain.Request(PROMPT, max_tokens=tokens, sampling=greedy)
        elif run == "unchecked schema":
            spec = constrain.Request(PROMPT, schema=UNCHECKED, max_tokens=tokens, sampling=greedy)
        else:
            schema, mode = CHECKED[row % len(CHECKED)]
            spec = constrain.Request(PROMPT, schema=constrain.json_schema(schema, mode=mode), max_tokens=tokens,
                                     sampling=greedy)  # fmt: skip
        specs += gen.admit(handle, spec)
    return specs


RUNS = ("unconstrained", "unchecked schema", "checked schemas", "checked schemas, eager")
OWN = ("mask", "checks", "stop+detokenize")
"""The stages a constraint adds to (the matcher's fill, its checks of the drawn token, its commit and the
closing budget's vet, in stop+detokenize); the forward and the sampler are the model's whatever the
constraint (a constrained batch also shrinks as its rows end, which makes its forward cheaper per step)."""


def measure(handle: constrain.ModelHandle, run: str, batch: int, tokens: int) -> tuple[float, int, dict[str, float]]:
    """(seconds, steps, per-stage seconds) of one batch decoded to its end."""
    requests = _requests(handle, run, batch, tokens)
    timings: dict[str, float] = {}
    steps, forward = [0], handle.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        return forward(*args, **kwargs)

    lazy = masks.checks_sampled_token
    if run.endswith("eager"):
        masks.checks_sampled_token = lambda params: False  # every row checked before sampling
    handle.model.forward = counted
    start = time.perf_counter()
    try:
        loop.run(handle, requests, timings, speculative=False, jump_forward=False)
    finally:
        del handle.model.forward
        masks.checks_sampled_token = lazy
    return time.perf_counter() - start, steps[0], timings


def load(model: str | None, device: str, random_weights: bool) -> constrain.ModelHandle:
    """The model to time: ``constrain.load_model``'s, or with ``random_weights`` the folder's architecture
    with random weights (seed 0) and its tokenizer, in the device's default dtype."""
    if not random_weights:
        return constrain.load_model(model, device=device)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model is None:
        raise SystemExit("--random-weights needs --model: a folder with config.json and the tokenizer's files")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        weights = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model, local_files_only=True))
    pair = (weights, constrain.load_tokenizer(model))
    return constrain.load_model(pair, device=device, dtype=default_dtype(torch.device(device)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--device", default="cpu", help="the torch device the model runs on (e.g. cuda)")
    parser.add_argument("--model", default=None, help="a packaged model's name, a .gguf file or a model folder")
    parser.add_argument("--random-weights", action="store_true", help="--model's config.json with random weights")
    parser.add_argument("--json", type=Path, default=None, help="also write the machine and every row's ms here")
    args = parser.parse_args()
    print(machine_line(args.device))
    handle = load(args.model, args.device, args.random_weights)
    weights = ", random weights" if args.random_weights else ""
    dtype = next(handle.model.parameters()).dtype
    print(f"model {handle.name}{weights} on {args.device}, {dtype}; greedy, {args.tokens} tokens a row at most, "
          f"no jump-forward nor speculation; ms per step, medians of {args.repeats}\n")  # fmt: skip
    stages = ("forward", "mask", "sampler", "checks", "stop+detokenize")
    print(f"| run | batch | steps | {' | '.join(stages)} | step | constraint's stages / unconstrained step "
          "| step / unconstrained step |")  # fmt: skip
    print(f"|---|---|---|{'---|' * len(stages)}---|---|---|")
    rows: list[dict[str, Any]] = []
    for batch in map(int, args.batches.split(",")):
        measure(handle, "checked schemas", min(batch, len(CHECKED)), args.tokens)  # compiles, warms the caches
        measure(handle, "unconstrained", batch, args.tokens)  # the forward at this batch size (a GPU's kernels)
        results: dict[str, list[tuple[float, int, dict[str, float]]]] = {run: [] for run in RUNS}
        for _ in range(args.repeats):  # round robin: the machine's drifts touch every run alike
            for run in RUNS:
                results[run].append(measure(handle, run, batch, args.tokens))
        base: tuple[float, float] | None = None  # the unconstrained (step, own stages), ms
        for run in RUNS:
            seconds, steps, timings = sorted(results[run], key=lambda r: r[0] / r[1])[len(results[run]) // 2]
            per = {stage: timings.get(stage, 0.0) / steps * 1e3 for stage in stages}
            step, own = seconds / steps * 1e3, sum(per[stage] for stage in OWN)
            base = (step, own) if base is None else base
            split = " | ".join(f"{per[stage]:.2f}" for stage in stages)
            added = (own - base[1]) / base[0]
            ratio = step / base[0] - 1
            print(f"| {run} | {batch} | {steps} | {split} | {step:.2f} | {added:+.1%} | {ratio:+.1%} |", flush=True)
            rows.append({"run": run, "batch": batch, "steps": steps, "stages_ms": per, "step_ms": step,
                         "added_share": added, "step_ratio": ratio})  # fmt: skip
        if args.json:  # after every batch size: a run stopped early keeps what it measured
            report = {
                "benchmark": "overhead",
                "machine": machine_info(args.device),
                "model": handle.name,
                "settings": {
                    "repeats": args.repeats,
                    "tokens": args.tokens,
                    "batches": args.batches,
                    "greedy": True,
                    "device": args.device,
                    "random_weights": args.random_weights,
                },
                "rows": rows,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
    if args.json:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
