"""Does ``constrain serve`` plateau? Resident memory over distinct chat requests, with the defaults.

Starts ``constrain serve`` (the CLI, default model, default settings) as its own process and sends
``--requests`` chat requests, ``--concurrency`` at a time, each with a distinct prompt of about
``--prompt-tokens`` tokens and a distinct JSON schema (its own property names), through the ``openai``
client. Reads the server's resident memory (``/proc/PID/status``, VmRSS) after every ``--every``
requests, once the server has been idle for ``--settle`` seconds (an idle engine hands its free heap
back to the system, :func:`constrain.serving.engine.heap_trimmer`), and prints it with what the last
``--every`` added, and the peak (VmHWM) so far.

Usage: ``python bench/server_memory.py [--requests 400] [--concurrency 8] [--prompt-tokens 200]``
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jsonschema  # noqa: E402
import openai  # noqa: E402

from bench.machine import machine_line  # noqa: E402

WORDS = (
    "order invoice customer shipment parcel address city street number amount currency total item "
    "product quantity price discount note status date time weight colour size region warehouse"
).split()


def _status_mib(pid: int, field: str = "VmRSS") -> float:
    """``field`` of ``/proc/PID/status`` in MiB (VmRSS: resident now; VmHWM: the peak)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(k: int, prompt_tokens: int) -> tuple[str, dict]:
    """Request ``k``'s prompt (about ``prompt_tokens`` tokens, distinct) and schema (distinct keys)."""
    rng = random.Random(k)
    words = [rng.choice(WORDS) for _ in range(prompt_tokens - 20)]
    prompt = f"Document {k}: " + " ".join(words) + ". Extract the fields as JSON."
    keys = rng.sample(WORDS, 3)
    schema = {
        "type": "object",
        "properties": {f"{keys[0]}_{k}": {"type": "string", "maxLength": 12},
                       keys[1]: {"type": "integer", "minimum": 0}, keys[2]: {"type": "boolean"}},
        "required": [f"{keys[0]}_{k}", keys[1], keys[2]],
        "additionalProperties": False,
    }  # fmt: skip
    return prompt, schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()
    print(machine_line())
    port = _free_port()
    cli = Path(sys.executable).parent / "constrain"
    server = subprocess.Popen(
        [str(cli), "serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def one(k: int) -> bool:
            prompt, schema = _request(k, args.prompt_tokens)
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
            messages = [{"role": "user", "content": prompt}]
            r = client.chat.completions.create(
                model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, response_format=fmt
            )
            try:
                jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
                return True
            except (ValueError, jsonschema.ValidationError):
                return False

        print(f"{'requests':>9} {'RSS MiB':>8} {'added':>7} {'peak MiB':>9} {'valid':>6} {'s':>6}")
        rows, previous, valid, start = [], _status_mib(server.pid), 0, time.perf_counter()
        print(f"{0:>9} {previous:>8.0f} {'':>7} {_status_mib(server.pid, 'VmHWM'):>9.0f} {'':>6} {0:>6.0f}")
        with ThreadPoolExecutor(args.concurrency) as pool:
            for first in range(0, args.requests, args.every):
                valid += sum(pool.map(one, range(first, min(first + args.every, args.requests))))
                seconds = time.perf_counter() - start
                time.sleep(args.settle)
                rss, peak = _status_mib(server.pid), _status_mib(server.pid, "VmHWM")
                rows.append(rss - previous)
                print(f"{min(first + args.every, args.requests):>9} {rss:>8.0f} {rss - previous:>+7.0f} {peak:>9.0f} "
                      f"{valid:>6} {seconds:>6.0f}", flush=True)  # fmt: skip
                previous = rss
        print(f"the last {args.every} requests added {rows[-1]:.0f} MiB of resident memory")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
