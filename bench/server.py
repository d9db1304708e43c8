"""The OpenAI-compatible server under load: concurrent clients with mixed constraints, batched vs one by one.

Starts the real server (uvicorn, loopback) on the default model and drives it with the official
``openai`` client from ``--clients`` threads, each sending ``--requests`` requests in turn, drawn
round robin from five kinds: a JSON schema (extraction), a regex (a date), choices (a label), a
required tool call, and plain chat. Then the same requests against a server whose engine decodes
one request at a time (``max_batch=1``). Prints, per configuration: requests, valid outputs, wall
time, requests/s, output tokens/s, latency p50/p99, and the batched / one-by-one throughput ratio.

Usage: ``python bench/server.py [--clients 32] [--requests 2] [--max-tokens 48]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jsonschema  # noqa: E402
import openai  # noqa: E402

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.testing import PERSON_SCHEMA as PERSON  # noqa: E402
from constrain.testing import WEATHER_TOOL as WEATHER  # noqa: E402
from constrain.testing import LocalServer  # noqa: E402

NAMES = ["Maria Lopez", "Ken Ito", "Ada Byron", "Omar Haddad", "Lena Berg", "Tom Reyes", "Ana Silva", "Raj Mehta"]
DATE = r"\d{4}-\d{2}-\d{2}"
LABELS = ["positive", "negative", "neutral"]


def request(kind: int, k: int, max_tokens: int) -> tuple[dict[str, Any], Any]:
    """(chat.completions.create arguments, a check of the response) for request ``k`` of ``kind``."""
    name = NAMES[k % len(NAMES)]
    if kind == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        args: dict[str, Any] = {"content": f"Extract the person: {name}, {20 + k % 50} years old.",
                                "response_format": fmt}  # fmt: skip
        return args, lambda m: jsonschema.validate(json.loads(m.content), PERSON) is None
    if kind == 1:
        return {"content": f"When was {name} born? Answer with a date.", "extra_body": {"regex": DATE}}, (
            lambda m: re.fullmatch(DATE, m.content) is not None
        )
    if kind == 2:
        return {"content": f"Sentiment of: '{name} loved the trip.'", "extra_body": {"choices": LABELS}}, (
            lambda m: m.content in LABELS
        )
    if kind == 3:
        args = {"content": f"What is the weather where {name} lives, Madrid?", "tools": [WEATHER],
                "tool_choice": "required"}  # fmt: skip
        schema = WEATHER["function"]["parameters"]
        return args, lambda m: all(jsonschema.validate(json.loads(c.function.arguments), schema) is None
                                   for c in m.tool_calls)  # fmt: skip
    return {"content": f"Write one sentence about {name}.", "max_tokens": max_tokens}, lambda m: bool(m.content)


def load(server: LocalServer, clients: int, per_client: int, max_tokens: int) -> dict[str, float]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    latencies: list[float] = []
    valid, tokens = [], []

    def one_client(c: int) -> None:
        for j in range(per_client):
            k = c * per_client + j
            args, check = request(k % 5, k, max_tokens)
            content = args.pop("content")
            start = time.perf_counter()
            r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                               temperature=0, **{"max_tokens": max_tokens, **args})  # fmt: skip
            latencies.append(time.perf_counter() - start)
            tokens.append(r.usage.completion_tokens)
            try:
                valid.append(bool(check(r.choices[0].message)))
            except (ValueError, TypeError, jsonschema.ValidationError):
                valid.append(False)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one_client, range(clients)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "requests": len(latencies),
        "valid": sum(valid),
        "wall": wall,
        "rps": len(latencies) / wall,
        "tps": sum(tokens) / wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "peak": server.app.state.engine.peak_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    print(machine_line())
    handle = constrain.load_model()
    print(f"model {handle.name} ({next(handle.model.parameters()).dtype}); {args.clients} clients x "
          f"{args.requests} requests, max_tokens {args.max_tokens}, greedy\n")  # fmt: skip
    print("| engine | requests | valid | wall s | requests/s | output tokens/s | p50 s | p99 s | peak batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    rates = {}
    for label, max_batch in (("batched (max_batch 32)", 32), ("one by one (max_batch 1)", 1)):
        server = LocalServer(handle, max_batch=max_batch)
        try:
            m = load(server, args.clients, args.requests, args.max_tokens)
        finally:
            server.stop()
        rates[max_batch] = m["rps"]
        print(f"| {label} | {m['requests']:.0f} | {m['valid']:.0f} | {m['wall']:.1f} | {m['rps']:.2f} | "
              f"{m['tps']:.1f} | {m['p50']:.2f} | {m['p99']:.2f} | {m['peak']:.0f} |", flush=True)  # fmt: skip
    print(f"\nbatched / one by one, requests/s: {rates[32] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
