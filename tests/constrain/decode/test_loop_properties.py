"""A differential property test of the decode loop (issue 26): drafts change no token, whatever the request.

Drafts (jump-forward's forced text, the proposer's guesses) are verified by sampling at every draft
position exactly as plain decoding would, so a greedy or seeded request must come out the same,
token for token, with speculation on or off and jump-forward on or off. Each test here draws
requests that mix what the loop must get right together (a JSON schema, hand-written or drawn, a
regex, an EBNF grammar, choices or free text; tools under every ``tool_choice``; ``reasoning=``;
stop strings and regexes; ``n``; greedy or seeded sampling with top-k/top-p, penalties and logprobs;
small ``max_tokens``; batches of several requests), runs each four ways, and checks that:

- nothing raises (a :class:`~constrain.errors.BudgetError` at admission, before any pass, is a
  refusal: the same in every setting; counted);
- every setting yields plain decoding's token ids, text, finish reason, reasoning and budget
  counters (logprobs up to float noise: a wider pass can change the logits' last bits);
- every constrained output is valid (no violations; a schema's text validates with ``jsonschema``,
  each tool call's arguments against its tool's parameters), unless a stop string or regex cut it,
  or the closing budget was turned off and the output ran out of tokens.

Speculation is forced on with a flat :class:`~constrain.models.cost.ForwardCost`, so every draft on
offer is fed. A random-weight model rarely repeats itself, so the draws lean towards output that
drafts can predict (small alphabets, prompts that repeat, a logit bias that favours one token, or
steers a tools reply into its format's trigger and separator). Each test counts the drafts fed and
the row steps they saved, and asserts that drafts were fed and accepted and that the draws covered
every kind of request, so that it cannot pass by testing nothing; the counts are written to the
terminal at the end of the module. The draws are derandomized: the same examples on every run.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal
from unittest import mock

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from pydantic import Field

import constrain
from constrain.decode.speculative import plan_drafts
from constrain.errors import BudgetError
from constrain.models.cost import ForwardCost
from constrain.tools.formats import TOOL_FORMATS, tool_format

COST = ForwardCost((1, 64), (1.0, 1.0))
"""A pass costs the same whatever its width: every draft on offer is fed."""

Setting = tuple[bool, bool]
"""(speculative, jump_forward)."""

PLAIN: Setting = (False, False)
JUMP_FORWARD: Setting = (False, True)
BOTH: Setting = (True, True)
SPECULATIVE_ALONE: Setting = (True, False)
SETTINGS = (PLAIN, BOTH, JUMP_FORWARD, SPECULATIVE_ALONE)
"""Plain decoding first: the reference of the others."""


def _settings(max_examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings for a deterministic run: the same draws on every machine, no example database
    (each test also fixes its seed, so that its draws do not change with its source, as derandomize's do)."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# ---------------------------------------------------------------- what the requests draw from

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Madrid", "Paris", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["ab", "ba"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
            },
        },
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["items"],
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 12},
        "ok": {"type": "boolean"},
    },
    "required": ["tags", "ok"],
}

REGEXES = (
    r"[ab]{8,24}",
    r"(ab|ba|b){4,16}",
    r"\d{3}-\d{4}",
    r"(yes|no)( (yes|no)){0,7}",
    r"[a-z]{2,5}(, [a-z]{2,5}){1,3}",
)
GRAMMARS = (
    'root ::= "(" item (" " item)* ")"\nitem ::= "ab" | "ba" | [0-9]+',
    'root ::= pair ("; " pair)*\npair ::= key "=" value\nkey ::= [a-z]+\nvalue ::= "on" | "off" | [0-9]{1,3}',
    "arithmetic",  # a shipped grammar, by name
)
CHOICES = (["red", "green", "blue"], ["yes", "no"], ["alpha beta", "alpha gamma", "delta"])
PROMPTS = ("Hello hello hello hello", "a b a b a b a b a b", "Maria Lopez is 42 and lives in Madrid.", "JSON:")
STOPS = (None, None, None, [","], ["e"], [" the", "}"], ["\n"])
STOP_REGEXES = (None, None, None, None, r"\d\d", r"[A-Z]")
CHAT_STOPS = (None, None, None, ["e"], ["\n\n"])
"""Fewer, rarer stop strings for tools replies, which a stop string inside a call leaves invalid."""


def get_weather(
    city: Annotated[str, Field(description="The city", max_length=20)],
    unit: Literal["celsius", "fahrenheit"] = "celsius",
) -> str:
    """Get the current weather in a city."""
    return f"22 degrees {unit} in {city}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


PING = {"type": "function", "function": {"name": "ping", "description": "Check that the service is up."}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the notes.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "tags": {"type": "array", "items": {"enum": ["work", "home"]}, "maxItems": 2},
            },
            "required": ["query"],
        },
    },
}
TOOLS = (get_weather, add, PING, SEARCH)


@dataclass(frozen=True)
class Constraint:
    """A request's constraint: ``kind`` (a coverage label) and the keyword that sets it (none: free text)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)


def _leaves() -> st.SearchStrategy[dict[str, Any]]:
    integers = st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 300),
    )
    enums = st.lists(st.sampled_from(["red", "green", "a b", "x", "yes"]), min_size=1, max_size=4, unique=True)
    strings = st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n})
    return st.one_of(integers, enums.map(lambda values: {"enum": values}), strings, st.just({"type": "boolean"}))


def _arrays(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda item, low, extra: {"type": "array", "items": item, "minItems": low, "maxItems": low + extra},
        items,
        st.integers(0, 2),
        st.integers(0, 3),
    )


@st.composite
def small_schemas(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    """An object of 1 to 3 keys, each required or not: integers in a range, enums, short strings,
    booleans, arrays of those with min/maxItems, and (at the top) a nested object."""
    values = st.one_of(_leaves(), _arrays(_leaves()))
    if depth == 0:
        values = st.one_of(values, small_schemas(depth=1))
    keys = st.lists(st.sampled_from(["id", "name", "tags", "size", "ok", "sub"]), min_size=1, max_size=3, unique=True)
    names = draw(keys)
    properties = {name: draw(values) for name in names}
    return {"type": "object", "properties": properties, "required": [n for n in names if draw(st.booleans())]}


CONSTRAINTS = st.one_of(
    st.sampled_from([PERSON, ORDER, TAGS]).map(lambda s: Constraint("schema", {"schema": s})),
    small_schemas().map(lambda s: Constraint("schema", {"schema": s})),
    st.sampled_from(REGEXES).map(lambda r: Constraint("regex", {"regex": r})),
    st.sampled_from(GRAMMARS).map(lambda g: Constraint("grammar", {"grammar": g})),
    st.sampled_from(CHOICES).map(lambda c: Constraint("choices", {"choices": c})),
    st.just(Constraint("free")),
)


@st.composite
def samplings(draw: st.DrawFn) -> dict[str, Any]:
    """Greedy, or temperature 1 with a seed (either one reproducible); sometimes top-k or top-p, a
    penalty (whose history includes the drafts) and logprobs."""
    sampling: dict[str, Any] = {"temperature": 0}
    if draw(st.booleans()):
        sampling = {"temperature": 1.0, "seed": draw(st.integers(0, 1000))}
        sampling.update(draw(st.sampled_from([{}, {"top_k": 20}, {"top_p": 0.9}])))
    penalties = [{}, {}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.0}]
    sampling.update(draw(st.sampled_from(penalties)))
    if draw(st.integers(0, 3)) == 0:
        sampling["logprobs"] = 2
    return sampling


def reasonings() -> st.SearchStrategy[dict[str, int] | None]:
    """No thinking (mostly), or a short budget (the tiny model's template does not open the thinking:
    the start tag is forced, and the budget forces the end tag)."""
    return st.one_of(st.none(), st.none(), st.integers(8, 16).map(lambda n: {"max_tokens": n}))


FAVOUR = 15.0
"""The logit bias of a favoured token: on the tiny model's near-uniform logits, most of the probability
(so the output repeats it, where the constraint allows, and prompt lookup drafts the repeats)."""


@dataclass(frozen=True)
class Drawn:
    """A drawn request, its constraint's kind, and a text whose first token its sampling favours (None: none)."""

    request: constrain.Request
    kind: str
    favoured: str | None

    def prepared(self, handle: constrain.ModelHandle) -> constrain.Request:
        """The request, with the favoured token's logit bias."""
        if self.favoured is None:
            return self.request
        token = handle.tokenizer.encode(self.favoured, add_special_tokens=False)[0]
        return replace(self.request, sampling={**self.request.sampling, "logit_bias": {token: FAVOUR}})


@st.composite
def requests(draw: st.DrawFn) -> Drawn:
    constraint = draw(CONSTRAINTS)
    prompt = draw(st.sampled_from(PROMPTS))
    if draw(st.booleans()):
        prompt = [{"role": "user", "content": prompt}]  # through the chat template
    request = constrain.Request(
        prompt,
        **constraint.options,
        max_tokens=draw(st.integers(8, 48)),
        stop=draw(st.sampled_from(STOPS)),
        stop_regex=draw(st.sampled_from(STOP_REGEXES)),
        n=draw(st.sampled_from([1, 1, 2, 3])),
        close_in_budget=draw(st.sampled_from([True, True, True, False])),
        reasoning=draw(reasonings()),
        sampling=draw(samplings()),
    )
    return Drawn(request, constraint.kind, draw(st.sampled_from([None, None, " hello", "a", "1"])))


@st.composite
def chats(draw: st.DrawFn) -> dict[str, Any]:
    """The keyword arguments of a :func:`constrain.chat` call with tools, and ``steer`` (how to bias the
    model into calling: :func:`_steering`)."""
    tools = draw(st.lists(st.sampled_from(TOOLS), min_size=1, max_size=3, unique_by=id))
    named = constrain.tool(draw(st.sampled_from(tools))).name
    choice = draw(st.sampled_from(["auto", "auto", "required", "named", "named as a dict"]))
    if choice == "named":
        choice = named
    elif choice == "named as a dict":
        choice = {"type": "function", "function": {"name": named}}
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": draw(st.booleans()),
        "tool_format": draw(st.sampled_from([None, *TOOL_FORMATS])),
        "steer": draw(st.sampled_from([None, "trigger", "trigger", "again"])),
        "max_tokens": draw(st.integers(32, 80)),
        "stop": draw(st.sampled_from(CHAT_STOPS)),
        "stop_regex": draw(st.sampled_from(STOP_REGEXES)),
        "reasoning": draw(reasonings()),
        **draw(samplings()),
    }


def _steering(handle: constrain.ModelHandle, fmt: str | None, steer: str | None) -> dict[str, Any]:
    """Sampling options under which the random model calls tools even when ``"auto"`` lets it write text:
    with ``steer="trigger"`` it writes its format's trigger (``<tool_call>``) token by token, each
    trigger token biased a little less than the one before, and a presence and frequency penalty
    pushing each one written below the next; ``"again"`` also biases, below those, the separator's
    first token where it parts from the end of the calls, so that it calls again."""
    if steer is None:
        return {}
    spelling = tool_format(fmt or handle.name)
    trigger = handle.tokenizer.encode(spelling.trigger, add_special_tokens=False)
    bias = {token: 20.0 - 0.5 * k for k, token in enumerate(trigger)}
    if steer == "again":
        common = len(spelling.end) if spelling.separator.startswith(spelling.end) else 0  # hermes: "\n</tool_call>"
        separator = handle.tokenizer.encode(spelling.separator[common:], add_special_tokens=False)
        bias[separator[0]] = 20.0 - 0.5 * len(trigger)
    return {"logit_bias": bias, "presence_penalty": 2.0, "frequency_penalty": 2.0}


# ---------------------------------------------------------------- running a call four ways


@dataclass
class Work:
    """What one run asked of the model. ``row_steps``: the rows of every forward pass, summed; each
    row of a pass yields its sampled token and the drafts it accepted, so where two settings yield the
    same tokens, the difference in row steps is the number of drafts one accepted more than the other."""

    passes: int = 0
    row_steps: int = 0
    forced_fed: int = 0  # jump-forward drafts fed
    proposed_fed: int = 0  # proposer drafts fed


@contextlib.contextmanager
def _observed(handle: constrain.ModelHandle) -> Iterator[Work]:
    """Counts the model's forward passes and the drafts the loop plans to feed, while the block runs."""
    work = Work()
    original = handle.model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        work.passes += 1
        work.row_steps += kwargs["input_ids"].shape[0]
        return original(*args, **kwargs)

    def plan(forced: list[int], offered: list[int], rates: list[float], cost: Any, *args: Any) -> list[int]:
        proposed = plan_drafts(forced, offered, rates, cost, *args)
        work.forced_fed += sum(forced)
        work.proposed_fed += sum(proposed)
        return proposed

    handle.model.forward = forward
    try:
        with mock.patch("constrain.decode.loop.plan_drafts", plan):
            yield work
    finally:
        del handle.model.forward


def _four_ways(handle: constrain.ModelHandle, call: Callable[..., Any]) -> dict[Setting, tuple[Any, Work]] | None:
    """``call(speculative=..., jump_forward=..., forward_cost=COST)`` in every setting: (its result, its
    work); None where every setting refused it up front (``BudgetError``: no output fits ``max_tokens``)."""
    runs: dict[Setting, tuple[Any, Work]] = {}
    for speculative, jump_forward in SETTINGS:
        with _observed(handle) as work:
            try:
                result = call(speculative=speculative, jump_forward=jump_forward, forward_cost=COST)
            except BudgetError as err:
                result = err
        runs[(speculative, jump_forward)] = (result, work)
    refused = {setting for setting, (result, _) in runs.items() if isinstance(result, BudgetError)}
    if refused:
        assert len(refused) == len(SETTINGS), f"refused in some settings only: {refused}"
        return None
    return runs


def _fingerprint(result: constrain.GenerationResult) -> tuple[Any, ...]:
    """What must not change with the drafts (logprobs apart: compared with a tolerance)."""
    return (
        result.token_ids,
        result.text,
        result.finish_reason,
        result.reasoning,
        result.violations,
        result.closed_early,
        result.forced_tokens,
        result.guard_steps,
    )


def _assert_same(
    plain: list[constrain.GenerationResult], other: list[constrain.GenerationResult], setting: Setting
) -> None:
    for k, (a, b) in enumerate(zip(plain, other, strict=True)):
        where = f"completion {k}, (speculative, jump_forward) = {setting}"
        assert _fingerprint(b) == _fingerprint(a), where
        if a.logprobs is not None:
            assert b.logprobs is not None and len(b.logprobs) == len(a.logprobs), where
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4), where


def _calls(reply: constrain.ChatResult) -> list[tuple[str, str]]:
    """The calls of a reply, without their ids (drawn afresh for each reply)."""
    return [(call.name, call.arguments_json) for call in reply.tool_calls]


def _stopped(handle: constrain.ModelHandle, result: constrain.GenerationResult, stop: Any, stop_regex: Any) -> bool:
    """Whether a stop string or regex occurs in the output (cut from the text, which may then be invalid)."""
    text = handle.tokenizer.decode(result.token_ids)
    return any(s in text for s in stop or ()) or (stop_regex is not None and re.search(stop_regex, text) is not None)


def _check_generation(
    handle: constrain.ModelHandle, result: constrain.GenerationResult, request: constrain.Request, kind: str
) -> None:
    """A constrained output is valid, unless a stop string or regex cut it or it ran out of tokens
    without the closing budget."""
    if _stopped(handle, result, request.stop, request.stop_regex):
        return
    if not request.close_in_budget and result.finish_reason == "length":
        return
    assert result.violations == [] and result.finish_reason != "error", (result.text, result.violations)
    if kind == "schema":
        jsonschema.validate(json.loads(result.text), request.schema)
    elif kind == "regex":
        assert re.fullmatch(request.regex, result.text), result.text  # type: ignore[arg-type]
    elif kind == "choices":
        assert result.text in request.choices, result.text  # type: ignore[operator]


def _check_chat(handle: constrain.ModelHandle, reply: constrain.ChatResult, options: dict[str, Any]) -> None:
    """A reply is valid unless a stop string or regex cut it: its calls' arguments validate against
    their tools' parameters; "required" or a named tool makes calls alone; a named tool or
    ``parallel_tool_calls=False`` one call."""
    if _stopped(handle, reply.generation, options["stop"], options["stop_regex"]):
        return
    assert reply.violations == [] and reply.finish_reason != "error", (reply.generation.text, reply.violations)
    tools = {t.name: t for t in map(constrain.tool, options["tools"])}
    for call in reply.tool_calls:
        jsonschema.validate(json.loads(call.arguments_json), tools[call.name].parameters)
    choice = options["tool_choice"]
    if choice != "auto":
        assert reply.tool_calls and reply.content == "", reply.generation.text
    if choice not in ("auto", "required"):
        name = choice["function"]["name"] if isinstance(choice, dict) else choice
        assert [c.name for c in reply.tool_calls] == [name], reply.generation.text
    if not options["parallel_tool_calls"]:
        assert len(reply.tool_calls) == 1 or (choice == "auto" and not reply.tool_calls), reply.generation.text


# ---------------------------------------------------------------- coverage


@dataclass
class Coverage:
    """What one test's draws covered: examples, refusals (``BudgetError``), labels, and the drafts fed
    (in the run with both kinds on) and accepted, as the row steps they saved."""

    name: str
    examples: int = 0
    refused: int = 0
    labels: collections.Counter[str] = field(default_factory=collections.Counter)
    forced_fed: int = 0
    proposed_fed: int = 0
    forced_saved: int = 0  # jump-forward alone against plain decoding: forced drafts accepted
    proposed_saved: int = 0  # both kinds against jump-forward alone
    examples_forced_saved: int = 0
    examples_proposed_saved: int = 0
    speculative_alone_fed: int = 0  # drafts fed with speculative=True, jump_forward=False

    def count(self, runs: dict[Setting, tuple[Any, Work]], labels: list[str]) -> None:
        self.examples += 1
        self.labels.update(labels)
        plain, jump, both = runs[PLAIN][1], runs[JUMP_FORWARD][1], runs[BOTH][1]
        self.forced_fed += both.forced_fed
        self.proposed_fed += both.proposed_fed
        forced, proposed = plain.row_steps - jump.row_steps, jump.row_steps - both.row_steps
        self.forced_saved += forced
        self.proposed_saved += proposed
        self.examples_forced_saved += forced > 0
        self.examples_proposed_saved += proposed > 0
        alone = runs[SPECULATIVE_ALONE][1]
        self.speculative_alone_fed += alone.forced_fed + alone.proposed_fed

    def assert_drafts_paid(self, examples: int) -> None:
        """Both kinds of drafts were fed, and each saved row steps in at least ``examples`` examples."""
        assert self.forced_fed and self.proposed_fed, self
        assert min(self.examples_forced_saved, self.examples_proposed_saved) >= examples, self

    def assert_labels(self, *labels: str) -> None:
        """Every one of ``labels`` was drawn at least once."""
        missing = [label for label in labels if not self.labels[label]]
        assert not missing, f"never drawn: {missing}; drawn: {dict(self.labels)}"

    def lines(self) -> list[str]:
        labels = ", ".join(f"{name} {count}" for name, count in sorted(self.labels.items()))
        return [
            f"{self.name}: {self.examples} examples run 4 ways, and {self.refused} refused up front (BudgetError)",
            f"  drafts fed with both kinds on: {self.forced_fed} forced, {self.proposed_fed} proposed; "
            f"with speculative=True, jump_forward=False: {self.speculative_alone_fed}",
            f"  row steps saved: {self.forced_saved} by forced drafts ({self.examples_forced_saved} examples), "
            f"{self.proposed_saved} by proposed ones ({self.examples_proposed_saved} examples)",
            f"  drawn: {labels}",
        ]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Runs the module's models on one thread, then restores torch's setting: the tiny model's matrices are
    too small for a second thread to pay, and on a loaded 2-core machine a 2-thread pass waits for its
    second core (measured here under load: the tiny model 50-80 ms a pass on 2 threads, 5 ms on 1;
    SmolLM2 255 and 54 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def summary(request: pytest.FixtureRequest) -> Iterator[list[Coverage]]:
    """Collects each test's :class:`Coverage` and writes them to the terminal at the end of the module."""
    coverages: list[Coverage] = []
    yield coverages
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not coverages:
        return
    with capture.global_and_fixture_disabled():  # as capsys.disabled() does: to the terminal, not the capture
        reporter.ensure_newline()
        reporter.write_sep("-", "decode loop properties: coverage")
        for coverage in coverages:
            for line in coverage.lines():
                reporter.write_line(line)


def _option_labels(options: dict[str, Any], sampling: dict[str, Any]) -> list[str]:
    """Coverage labels of a request's options and sampling parameters."""
    labels = ["seeded" if sampling.get("seed") is not None else "greedy"]
    parameters = ("top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs")
    labels += [name for name in parameters if name in sampling]
    return labels + [name for name in ("reasoning", "stop", "stop_regex") if options.get(name)]


# ---------------------------------------------------------------- the tests


def _completions(results: list[Any], specs: list[constrain.Request]) -> list[constrain.GenerationResult]:
    """Every completion of a batch, in order: ``generate`` returns a list for a request with ``n > 1``."""
    return [r for group, spec in zip(results, specs, strict=True) for r in (group if spec.n > 1 else [group])]


@_settings(max_examples=50)
@seed(26)
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def _generate_four_ways(handle: constrain.ModelHandle, coverage: Coverage, batch: list[Drawn]) -> None:
    specs = [drawn.prepared(handle) for drawn in batch]
    runs = _four_ways(handle, lambda **decoding: constrain.generate(handle, specs, **decoding))
    if runs is None:
        coverage.refused += 1
        return
    completions = {setting: _completions(results, specs) for setting, (results, _) in runs.items()}
    for setting, results in completions.items():
        _assert_same(completions[PLAIN], results, setting)
    which = [(spec, drawn.kind) for spec, drawn in zip(specs, batch, strict=True) for _ in range(spec.n)]
    for result, (spec, kind) in zip(completions[PLAIN], which, strict=True):
        _check_generation(handle, result, spec, kind)
    labels = [f"batch of {len(specs)}"] + [f"finish {r.finish_reason}" for r in completions[PLAIN]]
    for spec, drawn in zip(specs, batch, strict=True):
        labels += [drawn.kind, f"n={spec.n}", *_option_labels(vars(spec), spec.sampling)]
        labels += ["no closing budget"] if not spec.close_in_budget else []
        labels += ["favoured"] if drawn.favoured else []
    coverage.count(runs, labels)


def test_generate_gives_plain_decodings_tokens_in_every_setting(tiny, summary):
    """Batches of 1 to 3 drawn requests through ``constrain.generation``, four ways each."""
    coverage = Coverage("generate")
    summary.append(coverage)
    _generate_four_ways(tiny, coverage)
    coverage.assert_labels(
        *("schema", "regex", "grammar", "choices", "free", "greedy", "seeded", "logprobs"),
        *("reasoning", "stop", "stop_regex", "n=2", "n=3", "batch of 3", "no closing budget"),
        *("finish length", "finish stop", "favoured"),
    )
    coverage.assert_drafts_paid(examples=3)


def _chat_labels(reply: constrain.ChatResult, options: dict[str, Any], steer: str | None) -> list[str]:
    """Coverage labels of a chat call with tools and of its reply."""
    choice = options["tool_choice"]
    calls = ("no", "1", "2+")[min(len(reply.tool_calls), 2)]
    return [
        f"tool_choice {choice if choice in ('auto', 'required') else 'named'}",
        f"{'auto' if choice == 'auto' else 'constrained'}: {calls} calls",
        f"finish {reply.finish_reason}",
        f"format {options['tool_format']}",
        f"parallel {options['parallel_tool_calls']}",
        f"steer {steer}",
    ]


def _chat_options(**given: Any) -> dict[str, Any]:
    """The options of an explicit chat example, as :func:`chats` draws them: ``given``, else greedy
    "auto" with ``add``, in the model's format, without steering, stop strings or reasoning."""
    defaults = {"tools": [add], "tool_choice": "auto", "parallel_tool_calls": True, "tool_format": None, "steer": None,
                "max_tokens": 64, "stop": None, "stop_regex": None, "reasoning": None, "temperature": 0}  # fmt: skip
    return defaults | given


@_settings(max_examples=24)
@seed(26)
@given(options=chats())
@example(options=_chat_options(steer="trigger"))  # "auto" writes the trigger: a call follows
@example(options=_chat_options(tools=[add, PING], tool_choice="required", tool_format="json_list", steer="again",
                               max_tokens=96))  # two calls  # fmt: skip
def _chat_four_ways(handle: constrain.ModelHandle, coverage: Coverage, options: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "What's the weather in Tokyo, and 2 + 3?"}]
    steer = options["steer"]
    call = {name: value for name, value in options.items() if name != "steer"}
    call.update(_steering(handle, options["tool_format"], steer))
    runs = _four_ways(handle, lambda **decoding: constrain.chat(handle, messages, **call, **decoding))
    if runs is None:
        coverage.refused += 1
        return
    plain = runs[PLAIN][0]
    for setting, (reply, _) in runs.items():
        _assert_same([plain.generation], [reply.generation], setting)
        assert (reply.finish_reason, _calls(reply)) == (plain.finish_reason, _calls(plain)), setting
    _check_chat(handle, plain, options)
    coverage.count(runs, _chat_labels(plain, options, steer) + _option_labels(call, call))


def test_chat_with_tools_gives_plain_decodings_tokens_in_every_setting(tiny, summary):
    """Drawn ``constrain.conversation`` calls with tools, four ways each."""
    coverage = Coverage("chat with tools")
    summary.append(coverage)
    _chat_four_ways(tiny, coverage)
    coverage.assert_labels(
        *("tool_choice auto", "tool_choice required", "tool_choice named", "parallel True", "parallel False"),
        *("auto: no calls", "auto: 1 calls", "constrained: 2+ calls", "finish tool_calls"),
        *("reasoning", "stop", "steer trigger", "steer again", "greedy", "seeded"),
    )
    coverage.assert_drafts_paid(examples=2)


# ---------------------------------------------------------------- the default model

WEATHER = [{"role": "user", "content": "What's the weather in Tokyo?"}]
QUOTE = "The quick brown fox jumps over the lazy dog, then the dog sleeps in the sun."


def _extraction(handle: constrain.ModelHandle, **decoding: Any) -> constrain.GenerationResult:
    messages = [{"role": "user", "content": "Maria Lopez is 42 and lives in Madrid. Extract her as JSON."}]
    return constrain.generate(handle, messages, schema=PERSON, max_tokens=40, temperature=0, **decoding)


def _weather_auto(handle: constrain.ModelHandle, **decoding: Any) -> constrain.ChatResult:
    return constrain.chat(
        handle, WEATHER, tools=[get_weather], tool_choice="auto", max_tokens=48, temperature=0, **decoding
    )


def _weather_required_seeded(handle: constrain.ModelHandle, **decoding: Any) -> constrain.ChatResult:
    return constrain.chat(
        handle, WEATHER, tools=[get_weather, add], tool_choice="required", parallel_tool_calls=False,
        max_tokens=48, temperature=1.0, seed=7, **decoding,
    )  # fmt: skip


def _copy_until_stop(handle: constrain.ModelHandle, **decoding: Any) -> constrain.GenerationResult:
    messages = [{"role": "user", "content": f"Repeat exactly: {QUOTE}"}]
    return constrain.generate(handle, messages, max_tokens=32, temperature=0, stop=[" dog"], **decoding)


REAL_CASES = {
    "extraction": (_extraction, JUMP_FORWARD),  # keys, colons and commas are forced text
    "tools auto": (_weather_auto, None),
    "tools required, seeded": (_weather_required_seeded, JUMP_FORWARD),  # the call's spelling is forced text
    "copy until a stop string": (_copy_until_stop, BOTH),  # the quote is in the prompt: prompt lookup drafts it
}
"""Each case's call, and the setting whose drafts it is expected to save passes with (None: no expectation)."""


@pytest.mark.real_model
@pytest.mark.parametrize("case", sorted(REAL_CASES))
def test_default_model_gives_the_same_reply_in_every_setting(smollm2_float32, case):
    """SmolLM2-135M in float32, four ways: the same reply, valid, and fewer passes where the case's drafts
    should pay."""
    smollm2 = smollm2_float32
    call, saver = REAL_CASES[case]
    runs = _four_ways(smollm2, lambda **decoding: call(smollm2, **decoding))
    assert runs is not None
    plain = runs[PLAIN][0]
    for setting, (result, _) in runs.items():
        if isinstance(plain, constrain.ChatResult):
            _assert_same([plain.generation], [result.generation], setting)
            assert _calls(result) == _calls(plain), setting
        else:
            _assert_same([plain], [result], setting)
    assert plain.violations == [] and plain.finish_reason != "error", plain
    if isinstance(plain, constrain.ChatResult):
        for tool_call in plain.tool_calls:
            jsonschema.validate(json.loads(tool_call.arguments_json), tool_call.tool.parameters)
    elif case == "extraction":
        jsonschema.validate(json.loads(plain.text), PERSON)
    if saver is not None:
        without = PLAIN if saver == JUMP_FORWARD else JUMP_FORWARD
        assert runs[saver][1].passes < runs[without][1].passes, {s: work for s, (_, work) in runs.items()}
