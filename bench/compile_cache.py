"""Compile cost, cold and warm (cache hit), for a few schemas with the SmolLM2 tokenizer; then, per packaged
tokenizer, what a process prepares for it with the token texts' file absent and present, and its first request.

The per-tokenizer tables (:mod:`constrain.match.vocab`) are built on a thread of their own once the
tokenizer's info is made, beside llguidance's tokenizer: timed from the info's making to the end of both,
in a fresh process, once with an empty ``CONSTRAIN_CACHE`` (the token texts read out of the engine) and
once with the file that run left; then the first request (a request that comes sooner waits for them).

Usage: ``python bench/compile_cache.py``
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.models import PACKAGED_MODELS  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "nested": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}}, "c": {"type": "number"}},
        "required": ["a"],
    },
}


CHECKED = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
"""The first request's schema: one with a value check, so every table is built."""


def first_request(model: str) -> tuple[float, float]:
    """In this (fresh) process: ms from the tokenizer's info made to all it builds in the background
    (llguidance's tokenizer, the per-tokenizer tables); then ms for compile + matcher + first mask of
    :data:`CHECKED`."""
    tokenizer = constrain.load_tokenizer(model)
    start = time.perf_counter()
    info = constrain.tokenizer_info(tokenizer)
    info.wait_prepared()
    prepared = (time.perf_counter() - start) * 1e3
    bitmask = constrain.allocate_token_bitmask(1, info.vocab_size)
    start = time.perf_counter()
    compiled = constrain.compile(constrain.json_schema(CHECKED, mode="specification"), info)
    compiled.matcher().fill_next_token_bitmask(bitmask)
    return prepared, (time.perf_counter() - start) * 1e3


def first_requests() -> None:
    print(
        "\n| tokenizer | info made and prepared, no token texts' file (ms) | with the file (ms) "
        "| then the first request (ms) |"
    )
    print("|---|---|---|---|")
    for model in PACKAGED_MODELS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CONSTRAIN_CACHE": cache}
            times = []
            for _ in range(2):  # the first run writes the file the second reads
                command = [sys.executable, __file__, "--first-request", model]
                run = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
                if run.returncode:
                    print(f"| {model} | not run: {run.stderr.strip().splitlines()[-1]} | | |")
                    break
                times.append(json.loads(run.stdout.strip().splitlines()[-1]))
            if len(times) == 2:
                print(f"| {model} | {times[0][0]:.0f} | {times[1][0]:.0f} | {times[1][1]:.0f} |")


def main() -> None:
    if sys.argv[1:2] == ["--first-request"]:
        print(json.dumps(first_request(sys.argv[2])))
        return
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
    first_requests()


if __name__ == "__main__":
    main()
