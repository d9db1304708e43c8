"""Guaranteed termination: valid results within ``max_tokens``, constrain beside its peers, in one run.

On the default model (SmolLM2-135M-Instruct), greedy and sampled (temperature 1, seeds 0..S-1), four
schemas without bounds that make small models run on (an unbounded array, deep nesting, long
string fields, a recursive tree), each with a small and a large ``max_tokens``. Engines:

- ``constrain`` (closing in budget + repetition guard, the defaults), and ``constrain-plain``
  (both off: what constrain did before, for the comparison);
- transformers ``generate`` + xgrammar's logits processor;
- transformers ``generate`` + llguidance (a logits processor over its matcher);
- Outlines (``outlines.Generator`` on the same transformers model), when installed.

Prints, per engine, the valid share (parses and validates against the schema) and the tokens used;
per workload in detail with ``--detail``. ``--seeds S`` sampled runs per workload (default 2).

Usage: ``python bench/termination.py [--seeds 2] [--engines constrain,xgrammar,...] [--detail]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jsonschema  # noqa: E402
import torch  # noqa: E402

import constrain  # noqa: E402
from bench import peers  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.testing import TERMINATION_WORKLOADS as WORKLOADS  # noqa: E402

LIMITS = (48, 192)


def run_peer(engine: str, handle: constrain.ModelHandle, prompt: str, schema: dict[str, Any], limit: int,
             seed: int | None) -> tuple[str, int]:  # fmt: skip
    """(text, tokens) from a peer on the same model."""
    tokenizer, model = handle.tokenizer, handle.model
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    sampling: dict[str, Any] = {"do_sample": False} if seed is None else {"do_sample": True, "temperature": 1.0}
    if seed is not None:
        torch.manual_seed(seed)
    if engine == "outlines":
        import outlines

        generator = outlines.Generator(outlines.from_transformers(model, tokenizer), outlines.json_schema(schema))
        out = generator(text, max_new_tokens=limit, **sampling)
        return out, len(tokenizer.encode(out, add_special_tokens=False))
    constraint = constrain.json_schema(schema)
    if engine == "xgrammar":
        processor: Any = peers.xgrammar_processor(peers.xgrammar_grammar(peers.xgrammar_compiler(handle), constraint))
    else:
        grammar = peers.llguidance_grammar(constraint)
        processor = peers.LlguidanceProcessor(peers.llguidance_tokenizer(handle), grammar, handle.eos_token_ids)
    ids = peers.prompt_ids(handle, messages)
    new = peers.hf_generate(handle, ids, max_new_tokens=limit, processor=processor, **sampling)[0]
    return tokenizer.decode(new), len(new)


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="sampled runs per workload and limit")
    parser.add_argument("--engines", default="constrain,constrain-plain,xgrammar,llguidance,outlines")
    parser.add_argument("--detail", action="store_true", help="also print every workload")
    args = parser.parse_args()
    print(machine_line())
    from tqdm import tqdm

    engines = args.engines.split(",")
    if "outlines" in engines:
        try:
            import outlines  # noqa: F401
        except ImportError:
            print("Outlines is not installed (pip install outlines): skipped\n")
            engines.remove("outlines")
    handle = constrain.load_model()
    runs = [(w, limit, seed) for w in WORKLOADS for limit in LIMITS for seed in [None, *range(args.seeds)]]
    rows: dict[str, list[tuple[str, int, bool, int, int, float]]] = defaultdict(list)
    for engine in engines:
        for workload, limit, seed in tqdm(runs, desc=engine, file=sys.stderr):
            prompt, schema = WORKLOADS[workload]
            start = time.perf_counter()
            forced = 0
            if engine.startswith("constrain"):
                plain = engine == "constrain-plain"
                sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
                r = constrain.generate(handle, [{"role": "user", "content": prompt}], schema=schema, max_tokens=limit,
                                       close_in_budget=not plain, repetition_guard=not plain, **sampling)  # fmt: skip
                text, used, forced = r.text, len(r.token_ids), r.forced_tokens + r.guard_steps
            else:
                text, used = run_peer(engine, handle, prompt, schema, limit, seed)
            rows[engine].append((workload, limit, valid(text, schema), used, forced, time.perf_counter() - start))
    print(f"model {handle.name}; {len(runs)} runs per engine: {len(WORKLOADS)} schemas x max_tokens {LIMITS} x "
          f"(greedy + {args.seeds} seeds at temperature 1)\n")  # fmt: skip
    print("| engine | valid | valid at max_tokens 48 | valid at 192 | mean tokens | forced + guarded steps | s |")
    print("|---|---|---|---|---|---|---|")
    for engine, results in rows.items():
        by_limit = {limit: [r for r in results if r[1] == limit] for limit in LIMITS}
        cells = [f"{sum(r[2] for r in rs)}/{len(rs)}" for rs in by_limit.values()]
        print(f"| {engine} | {sum(r[2] for r in results)}/{len(results)} | {' | '.join(cells)} "
              f"| {sum(r[3] for r in results) / len(results):.0f} | {sum(r[4] for r in results)} "
              f"| {sum(r[5] for r in results):.0f} |")  # fmt: skip
    if args.detail:
        print("\n| engine | workload | max_tokens | valid | tokens |\n|---|---|---|---|---|")
        for engine, results in rows.items():
            for workload, limit, ok, used, _, _ in results:
                print(f"| {engine} | {workload} | {limit} | {ok} | {used} |")


if __name__ == "__main__":
    main()
