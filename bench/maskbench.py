"""MaskBench (JSONSchemaBench) run the way MaskBench runs it, for constrain, raw xgrammar and llguidance.

For every schema and engine: compile; then for every test instance, ``json.dumps(data)``,
tokenize (SmolLM2), compute the full token mask before every token and check the
token is allowed, then check the grammar can end. The mask *accepts* an instance
when every token is allowed and the grammar can end after the last.

Per schema, by MaskBench's definitions (mask only, the same for every engine):

* *validation error*: a valid instance the mask rejects;
* *invalidation error*: an invalid instance the mask accepts;
* *passing*: neither. A schema with both counts as a validation error.

For the constrain engines, ``post-validated`` counts the mask-accepted invalid
instances that ``compiled.validate(text)`` flags afterwards. It is a report only:
they remain invalidation errors. For every mask-accepted invalid instance the
violated JSON Schema keywords are found with python ``jsonschema`` against the
original schema (the top-level keyword for anyOf/oneOf; ``unknown`` when
validation raises, ``none`` when jsonschema finds the instance valid).

Engines: ``constrain`` (``mode="specification"``), ``constrain-closed`` (the same
with ``closed=True``), ``constrain-generation`` (``mode="generation"``: closed
objects, keys in schema order, ``json.dumps`` whitespace; valid instances with
other key orders or extra keys are validation errors for it, which is expected:
its interest is the invalidation column), ``xgrammar`` and ``llguidance``.

Each engine runs in a worker process with a per-schema timeout; a crash or a
timeout is recorded for that schema and the worker restarts. Once its tokenizer is loaded, a worker
freezes its heap out of Python's cyclic collector (``gc.freeze()``), as ``constrain serve`` does: a
full collection of the torch and transformers objects otherwise pauses one token every few thousand
for 0.2-0.3 s, whichever engine's token it is. TTFM is compile
plus the first mask, TBM the time of each later token (its mask, the check that the token is
allowed, and its commit), in µs. An engine's compile is what a request waits for before its first
mask: llguidance's includes building its ``LLMatcher``, where it compiles the grammar (until
2026-11-27 this bench built it per instance, outside the timing, and left llguidance's TTFM
25-90 ms short on the largest schemas); each instance then copies a compiled template, as
constrain's llguidance backend does.

Usage: ``python bench/maskbench.py [--sample N] [--timeout S] [--engines constrain,xgrammar,llguidance]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.machine import machine_line  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
ENGINES = ("constrain", "constrain-sampled", "constrain-closed", "constrain-generation", "xgrammar", "llguidance")
"""``constrain``: the eager mask (every token the value checks refuse cleared: what a host that samples
with no way back gets); ``constrain-sampled``: the decode loop's path for unfiltered sampling, the
grammar's mask and the value checks of the token drawn only (``Matcher.allows``; where it refuses, the eager
row decides, as the loop's fallback does): the same verdicts; ``constrain-closed``: constrain with
``closed=True`` (no keys beyond those declared unless allowed); ``constrain-generation``: constrain with
``mode="generation"``."""
TOP_KEYWORDS = 15
NONE = "\u2013"  # an en dash: a cell that does not apply


class Adapter:
    """One engine behind four calls: compile, fresh matcher, fill a mask, accept a token."""

    def __init__(self, engine: str, tokenizer: Any) -> None:
        self.engine = engine
        self.name = name = "constrain" if engine.startswith("constrain") else engine
        self.tokenizer = tokenizer
        if name == "constrain":
            import constrain

            self.info = constrain.tokenizer_info(tokenizer)
            self.info.wait_prepared()  # built once per process in the background: not a schema's cost
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
        self.row = self.bitmask[0]  # [ceil(V / 32)] int32, a view
        self.words = self.bitmask.numpy()  # [1, ceil(V / 32)] int32, the same memory

    def compile(self, schema: Any) -> Any:
        text = json.dumps(schema)
        if self.name == "constrain":
            import constrain

            return constrain.compile(self._constraint(schema), self.info)
        if self.name == "xgrammar":
            return self.compiler.compile_json_schema(text)
        import llguidance

        # its matcher is where llguidance builds the grammar (what a request waits for); each instance copies it
        template = llguidance.LLMatcher(self.lltok, llguidance.LLMatcher.grammar_from_json_schema(text))
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def _constraint(self, schema: Any) -> Any:
        import constrain

        if self.engine == "constrain-generation":
            return constrain.json_schema(schema, mode="generation")
        return constrain.json_schema(schema, mode="specification", closed=self.engine == "constrain-closed")

    def matcher(self, compiled: Any) -> Any:
        if self.name == "constrain":
            return compiled.matcher()
        if self.name == "xgrammar":
            import xgrammar as xgr

            return xgr.GrammarMatcher(compiled)
        return compiled.deep_copy()

    def fill(self, matcher: Any) -> None:
        if self.engine == "constrain-sampled":
            matcher.fill_next_token_bitmask(self.bitmask, checks=False)
        elif self.name == "constrain":
            matcher.fill_next_token_bitmask(self.bitmask)
        elif self.name == "xgrammar":
            matcher.fill_next_token_bitmask(self.bitmask)
        else:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, 0)

    def allowed(self, matcher: Any, token: int) -> bool:
        """Whether the mask allows ``token``: its bit, read through a numpy view made once (a tensor's element
        read costs microseconds, which no sampler pays per token), for every engine alike; and where
        constrain checks the drawn token, its check, given the row as a view made once, as the decode loop
        holds its rows."""
        granted = bool((int(self.words[0, token >> 5]) >> (token & 31)) & 1)
        if not granted or self.engine != "constrain-sampled" or matcher.allows(token, self.row):
            return granted
        matcher.check_row(self.row)  # refused: the eager row decides (a dead end keeps the token)
        return bool((int(self.words[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, matcher: Any, token: int) -> bool:
        if self.name == "llguidance":
            return bool(matcher.consume_token(token)) and not matcher.is_error()
        return bool(matcher.accept_token(token))

    def can_end(self, matcher: Any) -> bool:
        if self.name == "llguidance":
            return bool(matcher.is_accepting())
        return bool(matcher.is_completed())


def violated_keywords(schema: Any, data: Any) -> list[str]:
    """The JSON Schema keywords ``data`` violates, by python ``jsonschema`` (anyOf/oneOf: the top-level keyword)."""
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator = cls(schema, format_checker=jsonschema.FormatChecker())
        keywords = sorted({str(error.validator) for error in validator.iter_errors(data)})
    except Exception:
        return ["unknown"]
    return keywords or ["none"]


def post_validates(compiled: Any, text: str) -> bool:
    """Whether constrain's ``compiled.validate`` flags ``text`` (a raise counts as not flagged)."""
    try:
        return bool(compiled.validate(text))
    except Exception:
        return False


class Timer:
    """TTFM (compile plus the first mask) and TBM (each later mask), in µs."""

    def __init__(self, compile_us: float) -> None:
        self.compile_us = compile_us
        self.ttfm: float | None = None
        self.tbm: list[float] = []

    def add(self, elapsed_us: float) -> None:
        if self.ttfm is None:
            self.ttfm = self.compile_us + elapsed_us
        else:
            self.tbm.append(elapsed_us)


def mask_accepts(adapter: Adapter, compiled: Any, ids: list[int], timer: Timer) -> bool:
    """Whether the mask allows every token of ``ids`` and the grammar can end after them. Timed per
    token: the mask, the check of the token and its commit."""
    matcher = adapter.matcher(compiled)
    for token in ids:
        t0 = time.perf_counter()
        adapter.fill(matcher)
        taken = adapter.allowed(matcher, token) and adapter.accept(matcher, token)
        timer.add((time.perf_counter() - t0) * 1e6)
        if not taken:
            return False
    return adapter.can_end(matcher)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    from constrain.testing import token_ids

    try:
        return list(token_ids(tokenizer, text))
    except ValueError:
        return list(tokenizer.encode(text, add_special_tokens=False))


def run_schema(adapter: Adapter, entry: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        compiled = adapter.compile(entry["schema"])
    except Exception as err:
        return {"status": "compile error", "error": str(err)[:300]}
    timer = Timer((time.perf_counter() - start) * 1e6)
    validation_errors = 0
    accepted_invalid: list[dict[str, Any]] = []
    for index, test in enumerate(entry["tests"]):
        text = json.dumps(test["data"])
        accepted = mask_accepts(adapter, compiled, tokenize(adapter.tokenizer, text), timer)
        if test["valid"] and not accepted:
            validation_errors += 1
        elif not test["valid"] and accepted:
            post = post_validates(compiled, text) if adapter.name == "constrain" else None
            keywords = violated_keywords(entry["schema"], test["data"])
            accepted_invalid.append({"test": index, "keywords": keywords, "post_validated": post})
    status = "validation error" if validation_errors else "invalidation error" if accepted_invalid else "passing"
    return {
        "status": status,
        "ttfm": timer.ttfm if timer.ttfm is not None else timer.compile_us,
        "tbm": timer.tbm,
        "validation_errors": validation_errors,
        "invalidation_errors": len(accepted_invalid),
        "post_validated": sum(bool(a["post_validated"]) for a in accepted_invalid),
        "accepted_invalid": accepted_invalid,
        "engine": getattr(compiled, "engine", adapter.name),
        # constrain: whether the matcher checks tokens beyond the grammar (value checks, a key guard)
        "checked": compiled.matcher().checks_tokens if adapter.name == "constrain" else None,
    }


def worker(engine: str, tasks: Any, results: Any) -> None:
    import constrain
    import constrain.testing  # (``tokenize``'s, with the server it imports: loaded before the freeze, not after)

    adapter = Adapter(engine, constrain.load_tokenizer())
    gc.collect()  # what was loaded stays: out of the collector's way, as the server does (``serve``)
    gc.freeze()
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


STATUSES = ("passing", "compile error", "validation error", "invalidation error", "timeout", "crash")
Results = dict[str, list[dict[str, Any]]]


def load_entries(sample: int | None) -> list[dict[str, Any]]:
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    return random.Random(0).sample(entries, sample) if sample else entries


def run_engines(engines: list[str], entries: list[dict[str, Any]], timeout: float) -> Results:
    from tqdm import tqdm

    all_results: Results = {}
    for engine in engines:
        runner = Runner(engine, timeout)
        all_results[engine] = [runner.run(i, e) for i, e in enumerate(tqdm(entries, desc=engine, file=sys.stderr))]
        runner.close()
    return all_results


def engine_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's counts (by status, invalid instances the mask accepted) and TTFM/TBM percentiles (µs)."""
    return {
        "schemas": len(results),
        "statuses": {s: sum(r["status"] == s for r in results) for s in STATUSES},
        "invalid_accepted": sum(r.get("invalidation_errors", 0) for r in results),
        "post_validated": sum(r.get("post_validated", 0) for r in results),
        "ttfm_us": percentiles([r["ttfm"] for r in results if "ttfm" in r]),
        "tbm_us": percentiles([v for r in results for v in r.get("tbm") or []]),
    }


def write_json(
    path: Path, all_results: Results, entries: list[dict[str, Any]], sample: int | None, timeout: float
) -> None:
    """The run's machine and settings, a summary per engine (counts, TTFM/TBM percentiles in µs), and the
    per-schema results without the TBM samples, with each mask-accepted invalid instance's keywords."""
    from bench.machine import machine_info

    named = {
        engine: [{**r, "tbm": None, "name": e["name"]} for r, e in zip(results, entries, strict=True)]
        for engine, results in all_results.items()
    }
    report = {
        "benchmark": "maskbench",
        "machine": machine_info(),
        "settings": {"schemas": len(entries), "sample": sample, "seed": 0, "timeout_s": timeout},
        "versions": versions(),
        "summary": {engine: engine_summary(results) for engine, results in all_results.items()},
        "schemas": named,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


def versions() -> dict[str, str | None]:
    """The installed versions of constrain and the peers (``None`` where one is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in ("constrain", "xgrammar", "llguidance", "transformers", "torch"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def summary_row(engine: str, results: list[dict[str, Any]], n: int) -> str:
    count = {s: sum(r["status"] == s for r in results) for s in STATUSES}
    accepted = sum(r.get("invalidation_errors", 0) for r in results)
    post = str(sum(r.get("post_validated", 0) for r in results)) if engine.startswith("constrain") else NONE
    return (
        f"| {engine} | {count['passing']} ({count['passing'] / n:.1%}) | {count['compile error']} "
        f"| {count['validation error']} | {count['invalidation error']} | {accepted} | {post} "
        f"| {count['timeout']} | {count['crash']} |"
    )


def print_summary(all_results: Results, n: int) -> None:
    print(
        "| engine | passing | compile error | validation error | invalidation error (schemas, mask-only) "
        "| invalid instances accepted by the mask | of which post-validated | timeout | crash |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    for engine, results in all_results.items():
        print(summary_row(engine, results, n))
        if engine.startswith("constrain"):
            served = sum(r.get("engine") == "llguidance" for r in results)
            notes.append(f"{engine}: {served} schemas served by llguidance (engine='auto')")
    print("\n" + "\n".join(notes))


def keyword_counts(results: list[dict[str, Any]]) -> Counter[str]:
    """Violated keywords of the mask-accepted invalid instances, each instance counting once per keyword."""
    return Counter(k for r in results for a in r.get("accepted_invalid", []) for k in a["keywords"])


def print_keywords(all_results: Results) -> None:
    print(f"\nViolated keywords of mask-accepted invalid instances (by instance, top {TOP_KEYWORDS})\n")
    print("| engine | keywords |")
    print("|---|---|")
    for engine, results in all_results.items():
        top = keyword_counts(results).most_common(TOP_KEYWORDS)
        print(f"| {engine} | {', '.join(f'{k} {c}' for k, c in top) or NONE} |")


def print_timings(all_results: Results) -> None:
    # the schemas whose constrain matcher checks nothing beyond the grammar: the fast path
    flags = next((results for engine, results in all_results.items() if engine.startswith("constrain")), [])
    unchecked = {i for i, r in enumerate(flags) if r.get("checked") is False}
    tables = [("ttfm", "TTFM (µs)", None), ("tbm", "TBM (µs)", None)]
    if unchecked:
        title = f"TBM (µs) on the {len(unchecked)} schemas where constrain checks nothing beyond the grammar"
        tables.append(("tbm", title, unchecked))
    for metric, title, only in tables:
        print(f"\n{title}\n")
        print("| engine | avg | p50 | p75 | p90 | p95 | p99 | p99.9 | max |")
        print("|---|---|---|---|---|---|---|---|---|")
        for engine, results in all_results.items():
            kept = [r for i, r in enumerate(results) if only is None or i in only]
            if metric == "ttfm":
                values = [r["ttfm"] for r in kept if "ttfm" in r]
            else:
                values = [v for r in kept for v in r.get("tbm", [])]
            p = percentiles(values)
            keys = ("avg", "p50", "p75", "p90", "p95", "p99", "p99.9", "max")
            cells = " | ".join(f"{p[k]:,.0f}" for k in keys) if p else ""
            print(f"| {engine} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sample", type=int, default=None, help="a random sample of N schemas (seed 0)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per schema and engine")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the machine, a summary per engine and the per-schema results here "
        "(e.g. bench/results/maskbench.json, which bench/plots.py reads)",
    )
    args = parser.parse_args()
    print(machine_line())
    entries = load_entries(args.sample)
    all_results = run_engines(args.engines.split(","), entries, args.timeout)
    if args.json:
        write_json(args.json, all_results, entries, args.sample, args.timeout)
    n = len(entries)
    print(f"MaskBench dev: {n} schemas, SmolLM2 tokenizer, timeout {args.timeout:g} s per schema\n")
    print_summary(all_results, n)
    print_keywords(all_results)
    print_timings(all_results)


if __name__ == "__main__":
    main()
