"""End to end: constrain beside transformers, xgrammar, llguidance and Outlines on the same model, in one run.

On the default model (SmolLM2-135M-Instruct), greedy and sampled (temperature 0.7, seed 0), batch 1 and 8
(copies of one prompt; constrain's sampled rows take seeds 0..7), the same prompts through the same chat
template, the same ``max_tokens`` and EOS ids for every system. Workloads:

- extraction: a Pydantic model of 8 fields (a nested object, an array) from a paragraph;
- function call: the arguments of a few GlaiveAI tool schemas from MaskBench (``../shared/maskbench``);
- regex: an ISO date and a phone number; choice: a ticket label among 5; grammar: ``grammars/sql_select``;
- unconstrained: free text of exactly the length of constrain's greedy extraction.

Systems: ``constrain`` (jump-forward, the default), without jump-forward, with n-gram speculation, with
open objects and sampled whitespace (JSON schemas as generation took them before issue 13);
transformers ``generate`` unconstrained (the yardstick), + xgrammar's logits processor, + llguidance
(:class:`bench.peers.LlguidanceProcessor`); Outlines' ``Generator`` on the same transformers model. Each
peer runs at its defaults and, on the JSON-schema workloads, at its best setting too (", compact":
:data:`bench.peers.COMPACT_JSON`, no whitespace the model may choose); elsewhere the two are the same
setting and run once.

The yardstick is unconstrained generation of the same text's length: on every workload, transformers
``generate`` from the same prompt, at the same batch and decoding, without a constraint and with EOS
forbidden, produces exactly as many tokens per sequence as constrain's greedy output for that item (set
before the timed runs). A forward pass costs the same whatever token it yields, so this is the time the
model takes to write that text freely: prefill, then one pass per token.

Per system x workload x decoding x batch: compile time (cold: the first compile of that constraint in the
process, after each engine's tokenizer setup; warm: the second), output tokens, forward passes (counted on
``model.forward``), tokens/s, ms per token of one sequence, validity (JSON: parses and validates with
``jsonschema``; regex, choice, grammar: ``constrain``'s ``validate``), tokens/s over the yardstick's, and s per
valid object: the seconds of all its runs over the number of valid outputs among them (every output of the
yardstick and of free text counts). For constrain, that figure's speedups: the best peer's (the lowest s per
valid object among every peer and setting on the workload) over constrain's, and the yardstick's over
constrain's. The configurations run round robin ``--repeats`` times (medians per item, summed over a
workload's items, except s per valid object: all runs). Writes ``e2e.md``, ``tokens_per_s.png`` and
``ratio.png`` (the yardstick's s per object over each system's s per valid object) to ``--out``.

Usage: ``python bench/e2e.py [--repeats 3] [--quick] [--workloads extraction,regex] [--systems constrain,xgrammar]``
(``--quick``: one item per workload, batch 1, greedy, one repeat, into ``bench/results/quick``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jsonschema  # noqa: E402
import torch  # noqa: E402
from pydantic import BaseModel, ConfigDict  # noqa: E402

import constrain  # noqa: E402
from bench import peers  # noqa: E402
from bench.machine import machine_info, machine_line  # noqa: E402

MASKBENCH = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
RESULTS = Path(__file__).resolve().parent / "results"
FUNCTION_CALLS = 2
"""GlaiveAI schemas taken from MaskBench, evenly spaced in name order (more make a full run longer than 20 minutes)."""
TEMPERATURE, SEED = 0.7, 0
DECODINGS = ("greedy", "sampled")
BATCHES = (1, 8)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    street: str
    city: str
    country: str


class Employee(BaseModel):
    """The extraction target: 8 fields, a nested object and an array."""

    model_config = ConfigDict(extra="forbid")
    name: str
    age: int
    email: str
    phone: str
    job_title: str
    employer: str
    address: Address
    skills: list[str]


PARAGRAPH = (
    "Maria Lopez, 42, has worked as a data engineer at Nimbus Analytics since 2015. She lives at 12 Calle "
    "Mayor in Madrid, Spain, and can be reached at maria.lopez@nimbus.io or +34 612 345 678. Her colleagues "
    "rely on her for Python, SQL and Kubernetes, and she mentors two junior engineers."
)


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@dataclass(frozen=True)
class Item:
    """One prompt with its constraint (None: free text, exactly ``max_tokens`` tokens, EOS forbidden), its
    ``max_tokens``, and ``length``: the tokens the yardstick generates for it (set from constrain's greedy
    output before the timed runs)."""

    workload: str
    name: str
    messages: list[dict[str, str]]
    constraint: constrain.Constraint | None
    max_tokens: int
    length: int = 0


def function_calls(count: int) -> list[Item]:
    """Tool-argument items for ``count`` GlaiveAI schemas of MaskBench's dev set (none if it is absent)."""
    if not MASKBENCH.is_file():
        print(f"{MASKBENCH} not found: the function-call workload is skipped", file=sys.stderr)
        return []
    with gzip.open(MASKBENCH, "rt") as f:
        rows = sorted((json.loads(line) for line in f), key=lambda row: row["name"])
    glaive = [row for row in rows if row["name"].startswith("Glaiveai2K---")]
    items = []
    for row in glaive[:: len(glaive) // count][:count]:
        function = row["name"].removeprefix("Glaiveai2K---").rsplit("_", 1)[0]  # book_flight_05dcf13f.json
        system = f"You can call the function `{function}`. Its arguments follow this JSON Schema:\n"
        messages = [
            {"role": "system", "content": system + json.dumps(row["schema"])},
            {"role": "user", "content": f"Call `{function}` with realistic arguments. Reply with the arguments "
                                        "as one JSON object."},
        ]  # fmt: skip
        schema = constrain.json_schema(row["schema"])  # as generate(schema=) takes it
        items.append(Item("function call", function, messages, schema, 64))
    return items


def workloads() -> list[Item]:
    """Every item, extraction first (the baseline); the unconstrained item's length is set from it later."""
    extraction = constrain.json_schema(Employee.model_json_schema())  # as generate(schema=) takes it
    return [
        Item("extraction", "employee", user(f"Extract the employee as JSON.\n\n{PARAGRAPH}"), extraction, 128),
        *function_calls(FUNCTION_CALLS),
        Item("regex", "ISO date", user("The Apollo 11 crew landed on the Moon on July 20, 1969. Write that date "
             "in ISO 8601 format (YYYY-MM-DD), nothing else."),
             constrain.regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"), 32),
        Item("regex", "phone", user("Our support line is (415) 555-0132, open on weekdays. Write that phone "
             "number as +1-XXX-XXX-XXXX, nothing else."), constrain.regex(r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}"), 32),
        Item("choice", "ticket label", user("Label this support ticket as billing, technical, account, shipping or "
             "other: 'I was charged twice for my subscription this month and need a refund.'"),
             constrain.choice(["billing", "technical", "account", "shipping", "other"]), 8),
        Item("grammar", "sql_select", user("Write one SQL query for the table employees(name, salary, department): "
             "the names and salaries in the 'sales' department above 50000, highest salary first."),
             constrain.grammar("sql_select"), 64),
        Item("unconstrained", "story", user("Tell me a long story about a lighthouse keeper."), None, 0),
    ]  # fmt: skip


Rows = list[tuple[str, int]]
"""Per sequence of a batch: (text, output tokens without EOS)."""


Role = Literal["constrain", "peer", "yardstick"]


class System:
    """One system under test: compiles a constraint (``engine`` names whose compile it shares) and
    generates a batch."""

    key = ""
    name = ""
    engine = ""
    role: Role

    def __init__(self, handle: constrain.ModelHandle) -> None:
        self.handle = handle

    def takes(self, item: Item) -> bool:
        """Whether this system is meant to run ``item`` (the peers: constrained items only)."""
        return item.constraint is not None

    def prepare(self) -> None:
        """Tokenizer-level setup, once, before compile times are taken."""

    def compile(self, constraint: constrain.Constraint) -> Any:
        raise NotImplementedError

    def generate(self, item: Item, compiled: Any, batch: int, sampled: bool) -> Rows:
        raise NotImplementedError


def constrain_compile(handle: constrain.ModelHandle, constraint: constrain.Constraint) -> constrain.CompiledConstraint:
    """``constrain.compile`` with the arguments ``generate()`` passes, so that it finds the result in the cache."""
    return constrain.compile(
        constraint, handle.tokenizer, vocab_size=handle.vocab_size, eos_token_ids=list(handle.eos_token_ids)
    )


class Constrain(System):
    engine, role = "constrain", "constrain"

    def __init__(
        self, handle: constrain.ModelHandle, key: str, name: str, *, free_text: bool = False, jump_forward: bool = True,
        speculative: bool = False, open_objects: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(handle)
        self.key, self.name, self.free_text = key, name, free_text
        self.jump_forward, self.speculative = jump_forward, speculative
        self.open_objects = open_objects  # the defaults before issue 13: open objects, sampled whitespace

    def constraint(self, constraint: constrain.Constraint | None) -> constrain.Constraint | None:
        if self.open_objects and isinstance(constraint, constrain.JsonSchema):
            return replace(constraint, closed=False, whitespace="single")
        return constraint

    def takes(self, item: Item) -> bool:
        return item.constraint is not None or self.free_text

    def prepare(self) -> None:
        self.compile(constrain.regex("[a-z]"))

    def compile(self, constraint: constrain.Constraint) -> Any:
        return constrain_compile(self.handle, self.constraint(constraint))

    def generate(self, item: Item, compiled: Any, batch: int, sampled: bool) -> Rows:
        sampling: dict[str, Any] = {"temperature": TEMPERATURE, "seed": SEED} if sampled else {"temperature": 0}
        if item.constraint is None:
            sampling["logit_bias"] = dict.fromkeys(self.handle.eos_token_ids, -100.0)
        constraint = self.constraint(item.constraint)
        out = constrain.generate(self.handle, item.messages, constraint=constraint, max_tokens=item.max_tokens,
                                 n=batch, jump_forward=self.jump_forward, speculative=self.speculative,
                                 **sampling)  # fmt: skip
        return [(r.text, len(r.token_ids)) for r in (out if isinstance(out, list) else [out])]


def hf_options(handle: constrain.ModelHandle, item: Item, sampled: bool) -> dict[str, Any]:
    """transformers ``generate`` options: EOS ids, decoding (seeded here), exactly ``max_tokens`` for free text."""
    options: dict[str, Any] = {"eos_token_id": list(handle.eos_token_ids), "do_sample": sampled}
    if sampled:  # top_k=0 and top_p=1: the generation config's default top_k of 50 would cut the distribution
        options |= {"temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0}
        torch.manual_seed(SEED)
    if item.constraint is None:
        options["min_new_tokens"] = item.max_tokens
    return options


class HFGenerate(System):
    """transformers ``generate`` with the logits processor :meth:`processor` makes of the compiled constraint."""

    def processor(self, compiled: Any) -> Any:
        raise NotImplementedError

    def generate(self, item: Item, compiled: Any, batch: int, sampled: bool) -> Rows:
        ids = peers.prompt_ids(self.handle, item.messages)
        options = hf_options(self.handle, item, sampled)
        processor = self.processor(compiled)
        rows = peers.hf_generate(
            self.handle, ids, batch=batch, max_new_tokens=item.max_tokens, processor=processor, **options
        )
        return [(self.handle.tokenizer.decode(row), len(row)) for row in rows]


class Transformers(HFGenerate):
    """The yardstick: every item unconstrained, exactly ``item.length`` tokens (free text: ``max_tokens``)."""

    key, name, engine, role = "transformers", "transformers", "", "yardstick"

    def takes(self, item: Item) -> bool:
        return True

    def processor(self, compiled: Any) -> Any:
        return None

    def generate(self, item: Item, compiled: Any, batch: int, sampled: bool) -> Rows:
        if item.constraint is not None:
            item = replace(item, constraint=None, max_tokens=item.length)
        return super().generate(item, None, batch, sampled)


class Peer(System):
    """A peer at its defaults or, ``compact``, at its best JSON-schema setting (:data:`bench.peers.COMPACT_JSON`):
    then a system of its own (key ``<key>-compact``, its own engine) that runs the JSON-schema items only."""

    role = "peer"

    def __init__(self, handle: constrain.ModelHandle, *, compact: bool = False) -> None:
        super().__init__(handle)
        self.compact = compact
        if compact:
            self.key, self.name, self.engine = f"{self.key}-compact", f"{self.name}, compact", f"{self.engine}-compact"

    def takes(self, item: Item) -> bool:
        return isinstance(item.constraint, constrain.JsonSchema) if self.compact else item.constraint is not None


class XGrammar(Peer, HFGenerate):
    key, name, engine = "xgrammar", "transformers + xgrammar", "xgrammar"

    def prepare(self) -> None:
        self.compiler = peers.xgrammar_compiler(self.handle)
        self.compile(constrain.regex("[a-z]"))

    def compile(self, constraint: constrain.Constraint) -> Any:
        return peers.xgrammar_grammar(self.compiler, constraint, compact=self.compact)

    def processor(self, compiled: Any) -> Any:
        return peers.xgrammar_processor(compiled)


class Llguidance(Peer, HFGenerate):
    key, name, engine = "llguidance", "transformers + llguidance", "llguidance"

    def prepare(self) -> None:
        self.tokenizer = peers.llguidance_tokenizer(self.handle)
        self.compile(constrain.regex("[a-z]"))

    def compile(self, constraint: constrain.Constraint) -> Any:
        return peers.llguidance_checked_grammar(self.tokenizer, constraint, compact=self.compact)

    def processor(self, compiled: Any) -> Any:
        return peers.LlguidanceProcessor(self.tokenizer, compiled, self.handle.eos_token_ids)


class Outlines(Peer):
    key, name, engine = "outlines", "Outlines", "outlines"

    def prepare(self) -> None:
        import outlines

        self.model = outlines.from_transformers(self.handle.model, self.handle.tokenizer)
        self.compile(constrain.regex("[a-z]"))

    def compile(self, constraint: constrain.Constraint) -> Any:
        import outlines

        return outlines.Generator(self.model, peers.outlines_type(constraint, compact=self.compact))

    def generate(self, item: Item, compiled: Any, batch: int, sampled: bool) -> Rows:
        from outlines.inputs import Chat

        options = {"max_new_tokens": item.max_tokens, **hf_options(self.handle, item, sampled)}
        chats = [Chat(item.messages)] * batch
        with peers.Meter(self.handle) as meter:  # Outlines returns text only: its token ids, as generated
            texts = compiled.batch(chats, **options) if batch > 1 else [compiled(chats[0], **options)]
        return [(text, len(ids)) for text, ids in zip(texts, meter.generated, strict=True)]


def systems(handle: constrain.ModelHandle) -> list[System]:
    return [
        Constrain(handle, "constrain", "constrain", free_text=True),
        Constrain(handle, "constrain-nojf", "constrain, no jump-forward", jump_forward=False),
        Constrain(handle, "constrain-spec", "constrain, speculative", speculative=True),
        Constrain(handle, "constrain-open", "constrain, open objects + sampled whitespace", open_objects=True),
        Transformers(handle),
        *(peer(handle, compact=compact) for peer in (XGrammar, Llguidance, Outlines) for compact in (False, True)),
    ]


@dataclass
class Run:
    """One timed generation of a batch."""

    seconds: float
    tokens: int
    forwards: int
    valid: int
    texts: list[str]


@dataclass
class Compiled:
    """One engine's compile of one item's constraint: the result and its cold and warm seconds, or the error."""

    value: Any = None
    cold: float = 0.0
    warm: float = 0.0
    error: str | None = None


@dataclass
class Cell:
    """One system on one workload at one decoding and batch: medians per item, summed over the items."""

    workload: str
    system: str
    role: Role
    batch: int
    note: str = ""  # why it is n/a
    cold_ms: float | None = None
    warm_ms: float | None = None
    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    valid: int = 0
    rows: int = 0
    total_seconds: float = 0.0  # of all runs, not medians
    free: bool = False  # free text or the yardstick: no validity, every output counts

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def per_valid(self) -> float:
        """Seconds per valid output over all runs (inf when none is valid)."""
        valid = self.rows if self.free else self.valid
        return self.total_seconds / valid if valid else math.inf


def is_valid(handle: constrain.ModelHandle, constraint: constrain.Constraint | None, text: str) -> bool:
    """JSON: parses and validates with ``jsonschema`` (formats as annotations, the 2020-12 default); regex
    (full match), choice (membership) and grammar (a complete sentence): constrain's ``validate``."""
    if constraint is None:
        return True
    if isinstance(constraint, constrain.JsonSchema):
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.schema))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return not constrain_compile(handle, constraint).validate(text)


def greedy_length(handle: constrain.ModelHandle, item: Item) -> int:
    """Output tokens of constrain's greedy generation for ``item``: how many the yardstick generates for it."""
    out = constrain.generate(handle, item.messages, constraint=item.constraint, max_tokens=item.max_tokens,
                             temperature=0)  # fmt: skip
    return len(out.token_ids)


def timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start


class Bench:
    """The systems and items of one run, what each engine compiled, and every timed run."""

    def __init__(self, handle: constrain.ModelHandle, systems: list[System], items: list[Item]) -> None:
        self.handle, self.systems, self.items = handle, systems, items
        self.compiled: dict[tuple[str, str], Compiled] = {}  # (engine, item name)
        self.runs: dict[tuple[str, str, str, int], list[Run]] = defaultdict(list)  # (system, item, decoding, batch)

    def compile(self) -> None:
        """Every engine's tokenizer setup, then each constraint's first (cold) and second (warm) compile."""
        from tqdm import tqdm

        engines = {s.engine: s for s in self.systems if s.engine}
        for system in tqdm(engines.values(), desc="tokenizer setup", file=sys.stderr):
            system.prepare()
        jobs = [(s, i) for s in engines.values() for i in self.items if s.takes(i) and i.constraint is not None]
        for system, item in tqdm(jobs, desc="compile", file=sys.stderr):
            assert item.constraint is not None
            try:
                _, cold = timed(system.compile, item.constraint)
                value, warm = timed(system.compile, item.constraint)
            except Exception as err:  # a constraint a peer cannot take is a result: n/a, with the reason
                first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
                self.compiled[system.engine, item.name] = Compiled(error=f"{type(err).__name__} {first}".strip())
                continue
            self.compiled[system.engine, item.name] = Compiled(value, cold, warm)

    def unavailable(self, system: System, item: Item) -> str | None:
        """Why ``system`` cannot run ``item`` (its compile failed), or None."""
        if item.constraint is None or not system.engine:
            return None
        error = self.compiled[system.engine, item.name].error
        return f"compile failed: {error}" if error else None

    def runs_item(self, system: System, item: Item) -> bool:
        return system.takes(item) and self.unavailable(system, item) is None

    def generate(self, system: System, item: Item, batch: int, sampled: bool) -> Run:
        constraint = item.constraint if system.role != "yardstick" else None
        compiled = self.compiled[system.engine, item.name].value if constraint is not None else None
        with peers.Meter(self.handle) as meter:
            start = time.perf_counter()
            rows = system.generate(item, compiled, batch, sampled)
            seconds = time.perf_counter() - start
        texts = [text for text, _ in rows]
        valid = sum(is_valid(self.handle, constraint, text) for text in texts)
        return Run(seconds, sum(tokens for _, tokens in rows), meter.forwards, valid, texts)

    def run(self, repeats: int, decodings: tuple[str, ...], batches: tuple[int, ...]) -> None:
        """A warm-up, then every configuration ``repeats`` times, round robin."""
        from tqdm import tqdm

        # each system once on its shortest item: first calls and lazy imports stay out of the timings
        for system in tqdm(self.systems, desc="warm-up", file=sys.stderr):
            runnable = [i for i in self.items if self.runs_item(system, i)]
            if runnable:
                self.generate(system, min(runnable, key=lambda i: i.max_tokens), 1, False)
        configs = [(d, b, i, s) for d in decodings for b in batches for i in self.items for s in self.systems
                   if self.runs_item(s, i)]  # fmt: skip
        with tqdm(total=repeats * len(configs), desc="generate", file=sys.stderr) as bar:
            for _ in range(repeats):  # round robin, so that the machine's drifts touch every configuration alike
                for decoding, batch, item, system in configs:
                    bar.set_postfix_str(f"{system.key} {item.name} {decoding} b{batch}")
                    run = self.generate(system, item, batch, decoding == "sampled")
                    self.runs[system.name, item.name, decoding, batch].append(run)
                    bar.update()

    def cell(self, system: System, workload: str, decoding: str, batch: int) -> Cell | None:
        """None where the system is not meant to run the workload."""
        group = [i for i in self.items if i.workload == workload]
        if not all(system.takes(i) for i in group):
            return None
        free = system.role == "yardstick" or all(i.constraint is None for i in group)
        cell = Cell(workload, system.name, system.role, batch, free=free)
        notes = [(i.name, reason) for i in group if (reason := self.unavailable(system, i)) is not None]
        if notes:
            cell.note = "n/a: " + ("; ".join(f"{name}: {r}" for name, r in notes) if len(group) > 1 else notes[0][1])
            return cell
        compiled = [self.compiled[system.engine, i.name] for i in group if system.engine and i.constraint is not None]
        if compiled:
            cell.cold_ms = statistics.mean(c.cold for c in compiled) * 1e3
            cell.warm_ms = statistics.mean(c.warm for c in compiled) * 1e3
        for item in group:
            runs = self.runs[system.name, item.name, decoding, batch]
            median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
            cell.seconds += median.seconds
            cell.tokens += median.tokens
            cell.forwards += median.forwards
            cell.valid += sum(r.valid for r in runs)
            cell.rows += batch * len(runs)
            cell.total_seconds += sum(r.seconds for r in runs)
        return cell

    def cells(self, decoding: str, batch: int) -> list[Cell]:
        workloads = dict.fromkeys(i.workload for i in self.items)
        cells = [self.cell(s, w, decoding, batch) for w in workloads for s in self.systems]
        return [c for c in cells if c is not None]


COLUMNS = ("workload", "system", "compile cold ms", "warm ms", "tokens", "forward passes", "passes/token",
           "tokens/s", "ms/token", "valid", "tokens/s ratio", "s per valid object", "speedup vs best peer",
           "speedup vs unconstrained", "note")  # fmt: skip


def yardstick(cells: list[Cell], workload: str) -> Cell | None:
    """The yardstick's cell on ``workload`` (None if it did not run)."""
    return next((c for c in cells if c.workload == workload and c.role == "yardstick" and not c.note), None)


def best_peer(cells: list[Cell], workload: str) -> float | None:
    """The lowest s per valid object among the peers, every setting, on ``workload`` (None if none ran)."""
    return min((c.per_valid for c in cells if c.workload == workload and c.role == "peer" and not c.note), default=None)


def speedup(reference: float | None, seconds: float) -> float | None:
    """``reference / seconds``, how many times faster than the reference (None without one, or if both are inf)."""
    if reference is None or (math.isinf(reference) and math.isinf(seconds)):
        return None
    return math.inf if math.isinf(reference) else reference / seconds


def table(cells: list[Cell]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for c in cells:
        if c.note:
            lines.append(f"| {c.workload} | {c.system} |" + " n/a |" * (len(COLUMNS) - 3) + f" {c.note} |")
            continue
        compile_ms = ("-", "-") if c.cold_ms is None else (f"{c.cold_ms:.1f}", f"{c.warm_ms:.2f}")
        per_sequence = c.tokens / c.batch
        valid = "-" if c.free else f"{c.valid}/{c.rows}"
        base = yardstick(cells, c.workload)
        ratio = f"{c.rate / base.rate:.2f}" if base and base.rate else "-"
        best = best_peer(cells, c.workload) if c.role == "constrain" else None
        speedups = [speedup(best, c.per_valid), speedup(base.per_valid if base else None, c.per_valid)]
        vs_best, vs_unconstrained = ("-" if x is None else f"{x:.2f}" for x in speedups)
        lines.append(
            f"| {c.workload} | {c.system} | {compile_ms[0]} | {compile_ms[1]} | {c.tokens} | {c.forwards} "
            f"| {c.forwards / per_sequence:.2f} | {c.rate:.1f} | {c.seconds * 1e3 / per_sequence:.1f} | {valid} "
            f"| {ratio} | {c.per_valid:.2f} | {vs_best} | {vs_unconstrained} | |"
        )
    return "\n".join(lines)


Panels = dict[tuple[str, int], list[Cell]]
"""The cells per (decoding, batch)."""


def title(panel: tuple[str, int]) -> str:
    return f"{panel[0]}, batch {panel[1]}"


def plot(
    panels: Panels, value: Callable[[tuple[str, int], Cell], float | None], ylabel: str, path: Path,
    line: float | None = None,
) -> None:  # fmt: skip
    """Grouped bars, one panel per decoding and batch: workloads along x, one bar per system (none if n/a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (panel, cells) in zip(axes[:, 0], panels.items(), strict=True):
        workloads = list(dict.fromkeys(c.workload for c in cells))
        names = list(dict.fromkeys(c.system for c in cells))
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            values = [(workloads.index(c.workload), value(panel, c)) for c in cells if c.system == name and not c.note]
            bars = [(x + (k - (len(names) - 1) / 2) * width, y) for x, y in values if y is not None]
            ax.bar([x for x, _ in bars], [y for _, y in bars], width, label=name)
        if line is not None:
            ax.axhline(line, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(ylabel)
        ax.set_title(title(panel))
    axes[0, 0].legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_code(text: str, width: int = 90) -> str:
    text = text if len(text) <= width else text[: width - 1] + "..."
    return "`" + text.replace("|", "\\|").replace("\n", "\\n").replace("`", "'") + "`"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # a run of constrain's systems alone needs no peer installed
        return "not installed"


def render(bench: Bench, panels: Panels, notes: str) -> str:
    packages = ("torch", "transformers", "xgrammar", "llguidance", "outlines")
    versions = ", ".join(f"{p} {_version(p)}" for p in packages)
    limits = ", ".join(f"{w} {m}" for w, m in dict.fromkeys((i.workload, i.max_tokens) for i in bench.items))
    lines = [
        "# End-to-end benchmark (`python bench/e2e.py`)",
        "",
        machine_line(),
        "",
        f"Model {bench.handle.name} ({bench.handle.model.dtype}, {torch.get_num_threads()} threads); {versions}. "
        f"max_tokens: {limits}. {notes}",
        "",
        "Columns: compile ms (cold: the first compile of the constraint in the process; warm: the second; mean "
        "per item), output tokens and forward passes of the batch, passes/token and ms/token per sequence, "
        "tokens/s of the batch, valid outputs over all runs, tokens/s ratio: over the yardstick's on the same "
        "workload; s per valid object: seconds of all runs over the valid outputs among them (the yardstick and "
        "free text: over all outputs); speedups (s per valid object): the best peer's (the lowest of every peer "
        "and setting on the workload) over constrain's, and the yardstick's over the system's. The yardstick, "
        "`transformers`, generates on every workload without a constraint (EOS forbidden) exactly as many tokens "
        "per sequence as constrain's greedy output for that item, from the same prompt. The peers run the "
        "constrained workloads at their defaults, and at their best setting (`, compact`: no whitespace the "
        "model may choose) on the JSON-schema ones; `constrain` runs all (its variants the constrained ones); "
        "n/a: a system that cannot run a workload, and why.",
    ]
    for panel, cells in panels.items():
        lines += ["", f"## {title(panel)}", "", table(cells)]
    decoding, batch = first = next(iter(panels))
    lines += ["", f"## Outputs ({title(first)}, first run, first sequence)", "", "| item | system | output |",
              "|---|---|---|"]  # fmt: skip
    for item in bench.items:
        for system in bench.systems:
            runs = bench.runs.get((system.name, item.name, decoding, batch))
            if runs:
                lines.append(f"| {item.name} | {system.name} | {markdown_code(runs[0].texts[0])} |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, bench: Bench, panels: Panels, repeats: int, seconds: float) -> None:
    """The machine, the versions and every cell (with its tokens/s and s per valid object) as JSON."""
    packages = ("torch", "transformers", "xgrammar", "llguidance", "outlines")
    report = {
        "benchmark": "e2e",
        "machine": machine_info(),
        "model": bench.handle.name,
        "dtype": str(bench.handle.model.dtype),
        "versions": {p: _version(p) for p in packages},
        "settings": {"repeats": repeats, "items": len(bench.items), "run_s": seconds},
        "panels": [
            {
                "decoding": decoding,
                "batch": batch,
                "cells": [{**asdict(c), "rate": c.rate, "per_valid": c.per_valid} for c in cells],
            }
            for (decoding, batch), cells in panels.items()
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of every configuration (medians)")
    parser.add_argument("--quick", action="store_true", help="one item per workload, batch 1, greedy, one repeat")
    parser.add_argument("--workloads", help="comma-separated workloads (default: all)")
    known = (
        "constrain,constrain-nojf,constrain-spec,constrain-open,transformers,xgrammar,xgrammar-compact,"
        "llguidance,llguidance-compact,outlines,outlines-compact"
    )
    parser.add_argument("--systems", help=f"comma-separated keys: {known} (default: all)")
    parser.add_argument("--out", type=Path, help="report folder (default: bench/results, or bench/results/quick)")
    parser.add_argument("--json", type=Path, help="also write the machine and every cell here (for bench/plots.py)")
    args = parser.parse_args()
    print(machine_line())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' per-call notices would break the progress bars
    began = time.perf_counter()
    repeats, decodings, batches = (1, DECODINGS[:1], BATCHES[:1]) if args.quick else (args.repeats, DECODINGS, BATCHES)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    handle = constrain.load_model()
    chosen = systems(handle)
    if args.systems:
        keys = args.systems.split(",")
        if unknown := set(keys) - {s.key for s in chosen}:
            parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
        chosen = [s for s in chosen if s.key in keys]
    try:
        import outlines  # noqa: F401
    except ImportError:
        print("Outlines is not installed (pip install outlines): skipped", file=sys.stderr)
        chosen = [s for s in chosen if not isinstance(s, Outlines)]
    items = workloads()
    extraction = items[0]
    if args.workloads:
        names = args.workloads.split(",")
        if unknown := set(names) - {i.workload for i in items}:
            parser.error(f"unknown or unavailable workloads: {', '.join(sorted(unknown))}")
        items = [i for i in items if i.workload in names]
    if args.quick:
        items = [next(i for i in items if i.workload == w) for w in dict.fromkeys(i.workload for i in items)]

    bench = Bench(handle, chosen, items)
    bench.compile()
    # the yardstick's lengths: constrain's greedy outputs, the extraction's for free text (after the compile
    # times: this compiles)
    lengths = {i.name: greedy_length(handle, i) for i in {i.name: i for i in (extraction, *items)}.values()
               if i.constraint is not None}  # fmt: skip
    length = lengths[extraction.name]
    bench.items = [replace(i, max_tokens=length) if i.constraint is None else replace(i, length=lengths[i.name])
                   for i in items]  # fmt: skip
    bench.run(repeats, decodings, batches)

    panels = {(d, b): bench.cells(d, b) for d in decodings for b in batches}
    notes = (f"Median of {repeats} round-robin run(s) per item, summed over a workload's items (s per valid "
             f"object: all runs); sampled: "
             f"temperature {TEMPERATURE}, seed {SEED}. The unconstrained workload generates exactly {length} tokens "
             f"(constrain's greedy extraction). Run time {time.perf_counter() - began:.0f} s.")  # fmt: skip
    if not MASKBENCH.is_file():
        notes += f" No function-call workload: {MASKBENCH} was not found."
    report = render(bench, panels, notes)
    if args.json:
        write_json(args.json, bench, panels, repeats, time.perf_counter() - began)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.md").write_text(report)
    plot(panels, lambda _, cell: cell.rate, "tokens/s", out / "tokens_per_s.png")

    def vs_unconstrained(panel: tuple[str, int], cell: Cell) -> float | None:
        base = yardstick(panels[panel], cell.workload)
        return speedup(base.per_valid if base else None, cell.per_valid)

    ylabel = "speedup in s per valid object\nover unconstrained generation"
    plot(panels, vs_unconstrained, ylabel, out / "ratio.png", line=1.0)
    print(report.split("\n## Outputs")[0])
    print(
        f"\nwritten to {out}/: e2e.md, tokens_per_s.png, ratio.png; total run time {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
