"""Compile cost, cold and warm (cache hit), for a few schemas with the SmolLM2 tokenizer.

Usage: ``python bench/compile_cache.py``
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "nested": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}}, "c": {"type": "number"}},
        "required": ["a"],
    },
}


def main() -> None:
    tokenizer = constrain.load_tokenizer()
    constrain.tokenizer_info(tokenizer)  # the tokenizer's own one-time cost is not the schema's
    print(machine_line())
    print("| schema | cold compile (ms) | warm compile, constraint built (µs) | warm, incl. json_schema() (µs) |")
    print("|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        constraint = constrain.json_schema(schema)
        start = time.perf_counter()
        constrain.compile(constraint, tokenizer)
        cold = (time.perf_counter() - start) * 1e3
        warm, full = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            constrain.compile(constraint, tokenizer)
            t1 = time.perf_counter()
            constrain.compile(constrain.json_schema(schema), tokenizer)
            t2 = time.perf_counter()
            warm.append((t1 - t0) * 1e6)
            full.append((t2 - t1) * 1e6)
        print(f"| {name} | {cold:.1f} | {statistics.median(warm):.1f} | {statistics.median(full):.0f} |")


if __name__ == "__main__":
    main()
