"""Generation coverage in JSONSchemaBench's method: ask the model for an instance of each schema, validate it.

A seeded sample of MaskBench dev schemas (``../shared/maskbench``); for each, the default model
(SmolLM2-135M-Instruct) gets JSONSchemaBench's zero-shot prompt (the system message below, then the
schema as JSON in the user message) through its chat template, and decodes greedily within
``--max-tokens``. Systems, one schema at a time, on the same model handle and the same prompt ids:

- ``constrain``: ``constrain.generate(handle, messages, schema=...)`` (generation mode: closed
  objects, the schema's key order, fixed formatting);
- ``xgrammar``: transformers ``generate`` with xgrammar's logits processor (its default settings);
- ``llguidance``: transformers ``generate`` with :class:`bench.peers.LlguidanceProcessor`.

Each output is checked independently of the engines: ``json.loads``, then ``jsonschema`` against the
original schema (its declared draft, else 2020-12) with that draft's format checker (a bare
``FormatChecker()`` mixes the drafts: its ``time`` is draft 3's, which refuses ``20:00:00Z``).
Statuses: ``valid``, ``invalid`` (does not parse or violates the schema), ``refused`` (the compile
raised), ``error`` (the generation raised), ``timeout`` (``--timeout`` s per schema and system, checked
by ``SIGALRM``: a compile stuck in native code is not interrupted). A schema whose prompt plus
``--max-tokens`` does not fit the model's context window is skipped for every system. Seconds are
compile plus generation.

Prints a table, a row per system, and writes per schema and system (name, status, finish reason, tokens,
seconds, first violation) to ``--report``.

Usage: ``python bench/coverage.py [--sample 100] [--seed 0] [--max-tokens 512] [--timeout 300] [--threads 1]
[--systems constrain,xgrammar,llguidance] [--report bench/results/coverage.json]`` (``--threads 1`` when other
work shares the cores: torch's threads then wait on each other, ~25x slower here). ``--tables-from A.json
B.json`` prints the table of saved reports, merged by schema (a system rerun on the same sample replaces
its earlier results; only schemas with a result for every system count). Greedy decoding makes the
statuses repeatable; seconds are only comparable within one run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jsonschema  # noqa: E402
from jsonschema.exceptions import best_match  # noqa: E402

import constrain  # noqa: E402
from bench import peers  # noqa: E402
from bench.machine import machine_line  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
REPORT = Path(__file__).resolve().parent / "results" / "coverage.json"
SYSTEMS = ("constrain", "xgrammar", "llguidance")
SYSTEM_PROMPT = "You need to generate a JSON object that matches the schema below."
"""JSONSchemaBench's system message (its messages formatter, without few-shot examples)."""
STATUSES = ("valid", "invalid", "refused", "error", "timeout")
MESSAGE_CHARS = 300


def messages_for(schema: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": json.dumps(schema)}]


def violation(text: str, schema: Any) -> str | None:
    """None when ``text`` parses and validates against ``schema``; else the first (best) violation."""
    try:
        value = json.loads(text)
    except ValueError as err:
        return f"not JSON: {err}"
    try:
        with warnings.catch_warnings():  # an unknown $schema URI: the 2020-12 default, without the warning
            warnings.simplefilter("ignore")
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    except Exception as err:  # an unresolvable $ref, a pattern Python's re cannot read...
        return f"validator failed: {type(err).__name__}: {err}"[:MESSAGE_CHARS]
    return None if error is None else f"{error.json_path}: {error.message}"[:MESSAGE_CHARS]


class Timeout(Exception):
    """The schema ran past ``--timeout`` seconds."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Timeout` after ``seconds`` (at the next Python bytecode; 0: never)."""

    def expire(signum: int, frame: Any) -> None:
        raise Timeout(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Outcome:
    """One system on one schema."""

    status: str
    finish_reason: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    message: str | None = None  # the first violation, the refusal or the exception
    closed_early: bool | None = None
    reported: str | None = None  # constrain's own verdict: its first violation or error
    text: str = ""


@dataclass
class Output:
    text: str
    tokens: int
    finish_reason: str
    closed_early: bool | None = None
    reported: str | None = None


class System:
    """One system under test: compiles a schema (raising: refused), then generates from the prompt."""

    name = ""

    def __init__(self, handle: constrain.ModelHandle, max_tokens: int) -> None:
        self.handle, self.max_tokens = handle, max_tokens

    def prepare(self) -> None:
        """Tokenizer-level setup and a warm-up generation, before any schema is timed."""
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        messages = messages_for(schema)
        self.generate(self.compile(schema), schema, messages, peers.prompt_ids(self.handle, messages))

    def compile(self, schema: Any) -> Any:
        raise NotImplementedError

    def generate(self, compiled: Any, schema: Any, messages: list[dict[str, str]], ids: list[int]) -> Output:
        raise NotImplementedError


class Constrain(System):
    name = "constrain"

    def compile(self, schema: Any) -> Any:
        """The compile ``generate()`` does, with its arguments, so that it finds the result in the cache."""
        h = self.handle
        return constrain.compile(
            constrain.json_schema(schema), h.tokenizer, vocab_size=h.vocab_size, eos_token_ids=list(h.eos_token_ids)
        )

    def generate(self, compiled: Any, schema: Any, messages: list[dict[str, str]], ids: list[int]) -> Output:
        r = constrain.generate(self.handle, messages, schema=schema, temperature=0, max_tokens=self.max_tokens)
        reported = r.violations[0] if r.violations else r.error
        return Output(r.text, len(r.token_ids), r.finish_reason, getattr(r, "closed_early", None), reported)


class HFGenerate(System):
    """transformers ``generate``, greedy, with the logits processor :meth:`processor` makes of the compile."""

    def processor(self, compiled: Any) -> Any:
        raise NotImplementedError

    def generate(self, compiled: Any, schema: Any, messages: list[dict[str, str]], ids: list[int]) -> Output:
        eos = list(self.handle.eos_token_ids)
        rows = peers.hf_generate(
            self.handle, ids, max_new_tokens=self.max_tokens, processor=self.processor(compiled),
            eos_token_id=eos, do_sample=False,
        )  # fmt: skip
        row = rows[0]  # without the EOS: shorter than the budget means an EOS ended it
        return Output(self.handle.tokenizer.decode(row), len(row), "stop" if len(row) < self.max_tokens else "length")


class XGrammar(HFGenerate):
    name = "xgrammar"

    def prepare(self) -> None:
        self.compiler = peers.xgrammar_compiler(self.handle)
        super().prepare()

    def compile(self, schema: Any) -> Any:
        return peers.xgrammar_grammar(self.compiler, constrain.JsonSchema(json.dumps(schema)))

    def processor(self, compiled: Any) -> Any:
        return peers.xgrammar_processor(compiled)


class Llguidance(HFGenerate):
    name = "llguidance"

    def prepare(self) -> None:
        self.tokenizer = peers.llguidance_tokenizer(self.handle)
        super().prepare()

    def compile(self, schema: Any) -> Any:
        return peers.llguidance_checked_grammar(self.tokenizer, constrain.JsonSchema(json.dumps(schema)))

    def processor(self, compiled: Any) -> Any:
        return peers.LlguidanceProcessor(self.tokenizer, compiled, self.handle.eos_token_ids)


def make_systems(handle: constrain.ModelHandle, names: list[str], max_tokens: int) -> list[System]:
    known: dict[str, type[System]] = {"constrain": Constrain, "xgrammar": XGrammar, "llguidance": Llguidance}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown systems {unknown}; choose among {', '.join(SYSTEMS)}")
    return [known[n](handle, max_tokens) for n in names]


def run_one(system: System, schema: Any, messages: list[dict[str, str]], ids: list[int], timeout: float) -> Outcome:
    """Compile and generate; the status from the first step that fails, else from :func:`violation`."""
    start = time.perf_counter()
    step = "compile"
    try:
        with deadline(timeout):
            compiled = system.compile(schema)
            step = "generate"
            out = system.generate(compiled, schema, messages, ids)
    except Timeout as err:
        return Outcome("timeout", seconds=time.perf_counter() - start, message=f"{step}: {err}")
    except Exception as err:
        # constrain checks every argument before its first forward: a ConstraintError there is a refusal too
        refused = step == "compile" or isinstance(err, constrain.ConstraintError)
        message = f"{type(err).__name__}: {err}"[:MESSAGE_CHARS]
        return Outcome("refused" if refused else "error", seconds=time.perf_counter() - start, message=message)
    seconds = time.perf_counter() - start
    problem = violation(out.text, schema)
    return Outcome(
        "valid" if problem is None else "invalid", out.finish_reason, out.tokens, seconds, problem, out.closed_early,
        out.reported and out.reported[:MESSAGE_CHARS], out.text,
    )  # fmt: skip


def load(sample: int, seed: int) -> list[dict[str, Any]]:
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    return random.Random(seed).sample(entries, min(sample, len(entries))) if sample else entries


def table(results: dict[str, list[Outcome]]) -> list[str]:
    lines = [
        "| system | schemas | valid | invalid | refused | error | timeout | valid % of all | valid % of compiled "
        "| s per compiled schema | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, outcomes in results.items():
        count = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
        n, compiled = len(outcomes), [o for o in outcomes if o.status != "refused"]
        mean_s = sum(o.seconds for o in compiled) / len(compiled) if compiled else 0.0
        lines.append(
            f"| {name} | {n} | {count['valid']} | {count['invalid']} | {count['refused']} | {count['error']} "
            f"| {count['timeout']} | {count['valid'] / max(n, 1):.1%} | {count['valid'] / max(len(compiled), 1):.1%} "
            f"| {mean_s:.2f} | {sum(o.tokens for o in outcomes):,} |"
        )
    return lines


def merged(reports: list[Path]) -> dict[str, list[Outcome]]:
    """The outcomes in saved reports, by system, over the schemas every system has a result for (a later
    report's system replaces an earlier one's: rerun one system on the same sample and merge)."""
    rows: dict[str, dict[str, Any]] = {}
    for path in reports:
        for row in json.loads(path.read_text()):
            rows.setdefault(row["name"], {}).update(row)
    names = sorted({key for row in rows.values() for key in row if key in SYSTEMS}, key=SYSTEMS.index)
    complete = [row for row in rows.values() if all(name in row for name in names)]
    return {name: [Outcome(**row[name]) for row in complete] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sample", type=int, default=100, help="a random sample of N schemas (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--max-tokens", type=int, default=512, help="the output budget per schema")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per schema and system (0: none)")
    parser.add_argument("--report", type=Path, default=REPORT, help="per-schema results (JSON), rewritten as it goes")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy machine)")
    parser.add_argument("--tables-from", type=Path, nargs="+", default=None, help="print the table of saved reports")
    args = parser.parse_args()
    if args.tables_from:
        results = merged(args.tables_from)
        count = len(next(iter(results.values()), []))
        print(f"{count} schemas with a result for every system in {len(args.tables_from)} report(s)")
        print("\n" + "\n".join(table(results)))
        return
    entries = load(args.sample, args.seed)
    import torch
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)

    handle = constrain.load_model()
    context = int(getattr(handle.model.config, "max_position_embeddings", 1 << 30))
    systems = make_systems(handle, args.systems.split(","), args.max_tokens)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    for system in systems:
        system.prepare()
    started = time.perf_counter()
    results: dict[str, list[Outcome]] = {s.name: [] for s in systems}
    report: list[dict[str, Any]] = []
    skipped: list[str] = []
    for entry in tqdm(entries, desc="schemas", file=sys.stderr):
        messages = messages_for(entry["schema"])
        ids = peers.prompt_ids(handle, messages)
        if len(ids) + args.max_tokens > context:
            skipped.append(f"{entry['name']} ({len(ids)} prompt tokens)")
            continue
        row: dict[str, Any] = {"name": entry["name"], "prompt_tokens": len(ids)}
        for system in systems:  # side by side: each schema through every system before the next
            outcome = run_one(system, entry["schema"], messages, ids, args.timeout)
            results[system.name].append(outcome)
            row[system.name] = asdict(outcome)
        report.append(row)
        args.report.write_text(json.dumps(report, indent=1))
    elapsed = time.perf_counter() - started
    print(machine_line())
    print(
        f"MaskBench dev: {len(entries)} schemas (seed {args.seed}), {handle.name}, greedy, max_tokens "
        f"{args.max_tokens}, {torch.get_num_threads()} torch threads, {elapsed / 60:.1f} min"
    )
    if skipped:
        print(f"skipped (prompt + max_tokens over the {context}-token context): {', '.join(skipped)}")
    print("\n" + "\n".join(table(results)))
    print(f"\nper schema: {args.report}")


if __name__ == "__main__":
    main()
