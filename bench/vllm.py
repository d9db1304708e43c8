"""constrain inside vLLM against vLLM's own structured outputs, through vLLM's own OpenAI server.

Runs in vLLM's environment (``make test-vllm`` builds ``.venv-vllm``): ``.venv-vllm/bin/python bench/vllm.py``.
The packaged SmolLM2 is exported (``constrain.export_model``, float32) and served by
``python -m vllm.entrypoints.openai.api_server``, started once per configuration, one at a time:

- *constrain backend*: ``CONSTRAIN_VLLM=1`` in the server's environment, requests with ``response_format``;
- *vLLM xgrammar* / *vLLM guidance*: ``--structured-outputs-config`` naming vLLM's backend, the same requests;
- *constrain processor*: the xgrammar server with ``--logits-processors``, constrain's arguments in
  ``vllm_xargs`` instead of ``response_format``.

The requests: ``--schemas`` MaskBench dev schemas (a seeded sample of those under 2,000 characters), each
prompted "write a JSON instance of this schema", greedy, ``max_tokens``, sent with the ``openai`` client
``--concurrency`` at a time; each configuration first sends every request once with ``max_tokens=1`` (so
schemas compile before the timed runs). A request the server refuses counts as refused, not valid.

The three servers run at once (idle but for the run being timed), and the timed runs go round robin,
``--repeats`` rounds: a drift of the machine touches every configuration alike. Prints, per configuration,
output tokens/s (completion tokens over the wall clock of a timed run: the median of the rounds, with
their lowest and highest), valid outputs (``jsonschema``, formats asserted), outputs ended by
``max_tokens``, and tokens/s as a share of vLLM xgrammar's in the same round (the median of the rounds,
with their lowest and highest). Greedy decoding writes the same tokens every round: the counts are the
first round's, and a round that differs is reported.

Usage: ``.venv-vllm/bin/python bench/vllm.py [--schemas 16] [--max-tokens 128] [--concurrency 4] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.machine import machine_line  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
SERVER = ["--served-model-name", "m", "--gpu-memory-utilization", "0.15", "--max-model-len", "4096",
          "--enforce-eager", "--dtype", "float32"]  # fmt: skip
PROCESSOR = "constrain.integrations.vllm:ConstrainLogitsProcessor"


def schemas(count: int) -> list[dict[str, Any]]:
    """``count`` MaskBench dev schemas, a seeded sample of those under 2,000 characters (the prompt holds one)."""
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    small = [e["schema"] for e in entries if len(json.dumps(e["schema"])) < 2000]
    return random.Random(0).sample(small, count)


def valid(schema: dict[str, Any], text: str) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return bool(cls(schema, format_checker=jsonschema.FormatChecker()).is_valid(value))
    except Exception:
        return False


class Server:
    """vLLM's OpenAI server on a free port, with ``args`` and ``env`` added; stopped on exit."""

    def __init__(self, folder: Path, args: list[str], env: dict[str, str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--port", str(self.port), *SERVER, *args]  # fmt: skip
        self.log = open(folder.parent / f"vllm-{self.port}.log", "w")  # kept open while it runs
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def __enter__(self) -> Server:
        return self

    def wait(self) -> str:
        """The server's URL once it answers (exits the benchmark if it does not start)."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
        for _ in range(300):
            try:
                client.models.list()
                return f"http://127.0.0.1:{self.port}/v1"
            except openai.APIConnectionError:
                if self.process.poll() is not None:
                    break
                time.sleep(2)
        self.process.kill()
        sys.exit(f"vLLM's server did not start: see {self.log.name}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


async def run(
    url: str, chosen: list[dict[str, Any]], style: str, max_tokens: int, concurrency: int, *, warm: bool
) -> dict[str, Any]:
    """Every request once (``max_tokens``), ``concurrency`` at a time: tokens, seconds, valid, cut, refused.
    ``warm``: first every request with ``max_tokens=1`` (compiles every schema), untimed."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(schema: dict[str, Any], budget: int) -> tuple[int, bool, bool, bool]:
        text = f"Write a JSON instance of this schema: {json.dumps(schema)}"
        extra: dict[str, Any] = {}
        if style == "processor":
            extra["extra_body"] = {"vllm_xargs": {"constrain": json.dumps({"json_schema": schema})}}
        else:
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        async with gate:
            try:
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=budget, **extra
                )
            except openai.APIStatusError:
                return 0, False, False, True
        choice = reply.choices[0]
        tokens = reply.usage.completion_tokens if reply.usage else 0
        return tokens, valid(schema, choice.message.content or ""), choice.finish_reason == "length", False

    try:
        if warm:
            await asyncio.gather(*(one(s, 1) for s in chosen))  # compiles every schema
        start = time.perf_counter()
        results = await asyncio.gather(*(one(s, max_tokens) for s in chosen))
        seconds = time.perf_counter() - start
    finally:
        await client.close()  # inside the loop: closed after it, the client's transport raises at exit
    return {
        "tokens": sum(r[0] for r in results), "seconds": seconds, "valid": sum(r[1] for r in results),
        "cut": sum(r[2] for r in results), "refused": sum(r[3] for r in results),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, round robin over the configurations")
    args = parser.parse_args()

    import vllm

    import constrain

    print(machine_line())
    chosen = schemas(args.schemas)
    folder = constrain.export_model("smollm2-135m-instruct", Path(tempfile.mkdtemp()) / "m", dtype="float32")
    print(f"vLLM {vllm.__version__}'s OpenAI server, SmolLM2-135M float32, {len(chosen)} MaskBench schemas, greedy, "
          f"max_tokens={args.max_tokens}, {args.concurrency} at a time; the servers run at once, "
          f"{args.repeats} timed rounds round robin\n")  # fmt: skip
    xgrammar = ["--structured-outputs-config", '{"backend": "xgrammar"}']
    configurations = [
        ("vLLM xgrammar", [*xgrammar, "--logits-processors", PROCESSOR], {}, ["response_format", "processor"]),
        ("vLLM guidance", ["--structured-outputs-config", '{"backend": "guidance"}'], {}, ["response_format"]),
        ("constrain backend", [], {"CONSTRAIN_VLLM": "1"}, ["response_format"]),
    ]
    runs: list[tuple[str, str, str]] = []  # (label, url, style), vLLM xgrammar's first
    with contextlib.ExitStack() as stack:
        servers = [  # each stopped on the way out
            (name, stack.enter_context(Server(folder, server_args, env)), styles)
            for name, server_args, env, styles in configurations
        ]
        for name, server, styles in servers:
            url = server.wait()
            runs += [("constrain processor" if style == "processor" else name, url, style) for style in styles]
        rounds: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
        for round_ in range(args.repeats):
            for label, url, style in runs:
                rounds[label].append(
                    asyncio.run(run(url, chosen, style, args.max_tokens, args.concurrency, warm=round_ == 0))
                )
    print("| run | output tokens | tokens/s (lowest to highest) | valid outputs | ended by max_tokens | refused "
          "| vs vLLM xgrammar (lowest to highest) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    base = [r["tokens"] / r["seconds"] for r in rounds[runs[0][0]]]
    for label, results in rounds.items():
        rates = [r["tokens"] / r["seconds"] for r in results]
        shares = [rate / b for rate, b in zip(rates, base, strict=True)]
        first = results[0]
        counts = ("tokens", "valid", "cut", "refused")
        differs = [i for i, r in enumerate(results) if any(r[k] != first[k] for k in counts)]
        note = f" (rounds {differs} differ: {[[r[k] for k in counts] for r in results]})" if differs else ""
        print(f"| {label} | {first['tokens']} | {_spread(rates, '{:.1f}')} | {first['valid']} of {len(chosen)} "
              f"| {first['cut']} | {first['refused']} | {_spread(shares, '{:.0%}')} |{note}", flush=True)  # fmt: skip


def _spread(values: list[float], form: str) -> str:
    """The median of ``values`` with their lowest and highest, each written with ``form``."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{form.format(mid)} ({form.format(low)} to {form.format(high)})"


if __name__ == "__main__":
    main()
