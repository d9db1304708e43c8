"""MaskBench (JSONSchemaBench) run the way MaskBench runs it, for constrain, raw xgrammar and llguidance.

For every schema and engine: compile; then for every test instance, ``json.dumps(data)``,
tokenize (SmolLM2), compute the full token mask before every token and check the
token is allowed, then check the grammar can end. A schema *passes* when every
valid instance goes through and every invalid one is stopped. For constrain an
invalid instance the mask lets through still counts as stopped when
``compiled.validate`` flags it (its contract: the violation is reported, never
silently passed); the table shows how many relied on that.

Each engine runs in a worker process with a per-schema timeout; a crash or a
timeout is recorded for that schema and the worker restarts. TTFM is compile
plus the first mask, TBM the time of each later mask, in µs.

Usage: ``python bench/maskbench.py [--sample N] [--timeout S] [--engines constrain,xgrammar,llguidance]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
ENGINES = ("constrain", "constrain-closed", "xgrammar", "llguidance")
"""``constrain-closed``: constrain with ``closed=True`` (no keys beyond those declared unless allowed)."""


class Adapter:
    """One engine behind four calls: compile, fresh matcher, fill a mask, accept a token."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        import torch

        self.name = name
        self.closed = name == "constrain-closed"
        if self.closed:
            name = self.name = "constrain"
        self.tokenizer = tokenizer
        if name == "constrain":
            import constrain

            self.info = constrain.tokenizer_info(tokenizer)
            self.info.llg_tokenizer()  # built once per process in the background: not a schema's cost
            self.bitmask = constrain.allocate_token_bitmask(1, self.info.vocab_size)
        elif name == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(tokenizer)
            self.compiler = xgr.GrammarCompiler(info)
            self.bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        else:
            import llguidance.hf
            import llguidance.torch

            self.lltok = llguidance.hf.from_tokenizer(tokenizer)
            self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.lltok.vocab_size)
        self.torch = torch

    def compile(self, schema: Any) -> Any:
        text = json.dumps(schema)
        if self.name == "constrain":
            import constrain

            return constrain.compile(constrain.json_schema(schema, mode="specification", closed=self.closed), self.info)
        if self.name == "xgrammar":
            return self.compiler.compile_json_schema(text)
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise ValueError("; ".join(messages))
        return grammar

    def matcher(self, compiled: Any) -> Any:
        if self.name == "constrain":
            return compiled.matcher()
        if self.name == "xgrammar":
            import xgrammar as xgr

            return xgr.GrammarMatcher(compiled)
        import llguidance

        return llguidance.LLMatcher(self.lltok, compiled)

    def fill(self, matcher: Any) -> None:
        if self.name == "constrain":
            matcher.fill_next_token_bitmask(self.bitmask)
        elif self.name == "xgrammar":
            matcher.fill_next_token_bitmask(self.bitmask)
        else:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, 0)

    def allowed(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher: Any, token: int) -> bool:
        if self.name == "llguidance":
            return bool(matcher.consume_token(token)) and not matcher.is_error()
        return bool(matcher.accept_token(token))

    def can_end(self, matcher: Any) -> bool:
        if self.name == "llguidance":
            return bool(matcher.is_accepting())
        return bool(matcher.is_completed())


def run_schema(adapter: Adapter, entry: dict[str, Any]) -> dict[str, Any]:
    from constrain.testing import token_ids

    start = time.perf_counter()
    try:
        compiled = adapter.compile(entry["schema"])
    except Exception as err:
        return {"status": "compile error", "error": str(err)[:300]}
    compile_us = (time.perf_counter() - start) * 1e6
    ttfm = None
    tbm: list[float] = []
    validation_errors = invalidation_errors = post_validated = 0
    for test in entry["tests"]:
        text = json.dumps(test["data"])
        try:
            ids = token_ids(adapter.tokenizer, text)
        except ValueError:
            ids = adapter.tokenizer.encode(text, add_special_tokens=False)
        matcher = adapter.matcher(compiled)
        passed = True
        for token in ids:
            t0 = time.perf_counter()
            adapter.fill(matcher)
            elapsed = (time.perf_counter() - t0) * 1e6
            if ttfm is None:
                ttfm = compile_us + elapsed
            else:
                tbm.append(elapsed)
            if not adapter.allowed(token) or not adapter.accept(matcher, token):
                passed = False
                break
        passed = passed and adapter.can_end(matcher)
        if test["valid"] and not passed:
            validation_errors += 1
        elif not test["valid"] and passed:
            if adapter.name == "constrain" and compiled.validate(text):
                post_validated += 1
            else:
                invalidation_errors += 1
    status = "passing"
    if validation_errors:
        status = "validation error"
    elif invalidation_errors:
        status = "invalidation error"
    return {
        "status": status,
        "ttfm": ttfm if ttfm is not None else compile_us,
        "tbm": tbm,
        "post_validated": post_validated,
        "validation_errors": validation_errors,
        "invalidation_errors": invalidation_errors,
        "engine": getattr(compiled, "engine", adapter.name),
    }


def worker(engine: str, tasks: Any, results: Any) -> None:
    import constrain

    adapter = Adapter(engine, constrain.load_tokenizer())
    results.put(("ready", None))
    while True:
        item = tasks.get()
        if item is None:
            return
        index, entry = item
        results.put((index, run_schema(adapter, entry)))


class Runner:
    """Runs one engine over the schemas in a worker process, restarting it after a crash or timeout."""

    def __init__(self, engine: str, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self.ctx = mp.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.tasks, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=worker, args=(self.engine, self.tasks, self.results), daemon=True)
        self.proc.start()
        self.results.get(timeout=300)  # tokenizer loaded

    def run(self, index: int, entry: dict[str, Any]) -> dict[str, Any]:
        self.tasks.put((index, entry))
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                got_index, result = self.results.get(timeout=0.5)
                if got_index == index:
                    return result
            except Exception:
                pass
            if not self.proc.is_alive() or time.monotonic() > deadline:
                status = "timeout" if self.proc.is_alive() else "crash"
                self.proc.kill()
                self.proc.join()
                self._start()
                return {"status": status}

    def close(self) -> None:
        self.tasks.put(None)
        self.proc.join(timeout=10)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "avg": statistics.fmean(ordered),
        "p50": pct(50),
        "p75": pct(75),
        "p90": pct(90),
        "p95": pct(95),
        "p99": pct(99),
        "p99.9": pct(99.9),
        "max": ordered[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sample", type=int, default=None, help="a random sample of N schemas (seed 0)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per schema and engine")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--json", type=Path, default=None, help="also write per-schema results here")
    args = parser.parse_args()
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    if args.sample:
        entries = random.Random(0).sample(entries, args.sample)
    engines = args.engines.split(",")
    from tqdm import tqdm

    all_results: dict[str, list[dict[str, Any]]] = {}
    for engine in engines:
        runner = Runner(engine, args.timeout)
        all_results[engine] = [runner.run(i, e) for i, e in enumerate(tqdm(entries, desc=engine, file=sys.stderr))]
        runner.close()
    if args.json:
        named = {
            k: [{**r, "tbm": None, "name": e["name"]} for r, e in zip(v, entries, strict=True)]
            for k, v in all_results.items()
        }
        args.json.write_text(json.dumps(named))

    n = len(entries)
    print(f"MaskBench dev: {n} schemas, SmolLM2 tokenizer, timeout {args.timeout:g} s per schema\n")
    print(
        "| engine | passing | compile error | validation error | invalidation error | timeout | crash "
        "| post-validated instances |"
    )
    print("|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    for engine, results in all_results.items():
        count = {
            s: sum(r["status"] == s for r in results)
            for s in ("passing", "compile error", "validation error", "invalidation error", "timeout", "crash")
        }
        post = sum(r.get("post_validated", 0) for r in results)
        if engine.startswith("constrain"):
            served = sum(r.get("engine") == "llguidance" for r in results)
            notes.append(f"{engine}: {served} schemas served by llguidance (engine='auto')")
        print(
            f"| {engine} | {count['passing']} ({count['passing'] / n:.1%}) | {count['compile error']} "
            f"| {count['validation error']} | {count['invalidation error']} | {count['timeout']} "
            f"| {count['crash']} | {post} |"
        )
    print("\n" + "\n".join(notes))
    for metric in ("ttfm", "tbm"):
        print(f"\n{metric.upper()} (µs)\n")
        print("| engine | avg | p50 | p75 | p90 | p95 | p99 | p99.9 | max |")
        print("|---|---|---|---|---|---|---|---|---|")
        for engine, results in all_results.items():
            if metric == "ttfm":
                values = [r["ttfm"] for r in results if "ttfm" in r]
            else:
                values = [v for r in results for v in r.get("tbm", [])]
            p = percentiles(values)
            cells = (
                " | ".join(f"{p[k]:,.0f}" for k in ("avg", "p50", "p75", "p90", "p95", "p99", "p99.9", "max"))
                if p
                else ""
            )
            print(f"| {engine} | {cells} |")


if __name__ == "__main__":
    main()
