"""What users call: ``generate``, ``stream`` and their async variants, over :mod:`constrain.decode.loop`.

Every argument is checked and every constraint compiled before the first forward pass; a list of
prompts (each a :class:`Request` with its own constraint and parameters) runs as one batch.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, cast

from typing_extensions import Unpack

from constrain.backends.tokenizer import tokenizer_info
from constrain.compiler.compiler import compile
from constrain.constraints.constraint import (
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
    choice,
    grammar,
    json_schema,
    regex,
)
from constrain.decode.beams import BeamSearch, check_beam_options, check_sampling
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.drafts import resolve_proposer
from constrain.decode.feed import Feed
from constrain.decode.loop import run as _run
from constrain.decode.reasoning import Reasoning, Thinking, prompt_opens, reasoning_options, template_tags
from constrain.decode.request import InFlight
from constrain.decode.speculative import Proposer
from constrain.decode.stopping import StopText
from constrain.errors import BeamSearchError, ContextWindowError
from constrain.models.cost import ForwardCost
from constrain.models.loading import ModelHandle, model_handle
from constrain.results import GenerationResult, StreamEvent
from constrain.sampler import InvalidSamplingParamsError, SamplingParams
from constrain.tools.formats import tool_format
from constrain.tools.prompts import render_prompt, template_roles

__all__ = [
    "ChatOptions",
    "GenerateOptions",
    "ReplyOptions",
    "Request",
    "SamplingOptions",
    "StreamOptions",
    "admit",
    "admit_beam_search",
    "agenerate",
    "astream",
    "check_options",
    "generate",
    "prompt_ids",
    "resolve_constraint",
    "stream",
]

DEFAULT_MAX_TOKENS = 256
"""``max_tokens`` when none is given (fewer where the prompt leaves less of the model's context window)."""

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
"""A completion prompt, chat messages (``[{"role": ..., "content": ...}]``) for the chat template, or the
prompt's token ids."""


def resolve_constraint(
    schema: Any, regex_: str | None, grammar_: str | None, choices: Sequence[str] | None, constraint: Any
) -> Constraint | None:
    """The constraint of a request's ``schema=``/``regex=``/``grammar=``/``choices=``/``constraint=`` (at most
    one given; None: free text). A schema takes generation mode (:func:`~constrain.constraints.json_schema`)."""
    given = [x is not None for x in (schema, regex_, grammar_, choices, constraint)]
    if sum(given) > 1:
        raise ValueError("pass at most one of schema=, regex=, grammar=, choices=, constraint=")
    if schema is not None:
        # generation mode: closed objects, keys in the schema's order, compact formatting (json_schema's docs)
        return schema if isinstance(schema, JsonSchema) else json_schema(schema)
    if regex_ is not None:
        return regex(regex_)
    if grammar_ is not None:
        return grammar(grammar_)
    if choices is not None:
        return choice(choices)
    if constraint is not None and not isinstance(constraint, (JsonSchema, Regex, Grammar, Choice)):
        raise ValueError("constraint= takes a value from constrain.json_schema/regex/grammar/choice")
    return constraint


def _calls(message: dict[str, Any]) -> bool:
    """Whether a chat message is an assistant's tool calls (its content may then be left out)."""
    return message.get("role") == "assistant" and bool(message.get("tool_calls"))


def prompt_ids(handle: ModelHandle, prompt: Prompt) -> list[int]:
    """The token ids ``prompt`` feeds the model: token ids as they are, a string encoded (an empty one: the BOS
    token alone), or chat messages through the chat template (a ``developer`` message as a system message
    where the template has no such role: :func:`~constrain.tools.prompts.template_roles`)."""
    tokenizer = handle.tokenizer
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):  # token ids
        ids = [int(t) for t in cast(Sequence[int], prompt)]
        if not all(0 <= t < handle.vocab_size for t in ids):
            raise ValueError(f"a prompt's token ids are in [0, {handle.vocab_size}): {handle.name}'s vocabulary")
        return ids
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
        if not ids and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id]  # an empty prompt: the model starts from its BOS alone
        if not ids:
            raise ValueError(f"the prompt is empty, and {handle.name}'s tokenizer has no BOS token to start from")
        return ids
    if not prompt or not all(isinstance(m, dict) and "role" in m and ("content" in m or _calls(m)) for m in prompt):
        raise ValueError(
            "a prompt is a string, a non-empty list of {'role': ..., 'content': ...} messages, or token ids"
        )
    messages = cast(Sequence[dict[str, Any]], prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{handle.name} has no chat template: pass the prompt as a string")
    if any(m["role"] == "tool" or _calls(m) for m in messages):
        # a conversation that called tools, continued without them: its calls and their results written as a
        # prompt with tools writes them (a template may know no tool messages, nor an assistant's calls)
        format = tool_format(handle.name)
        return prompt_ids(
            handle, render_prompt(handle, messages, tools=(), choice="none", multiple=False, format=format)
        )
    text = tokenizer.apply_chat_template(
        template_roles(tokenizer, messages), add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Request:
    """One prompt with its own constraint and parameters, for a mixed batch:
    ``generate(model, [Request(p1, schema=A), Request(p2, regex=r"...", sampling={"temperature": 0})])``.

    Its fields but ``prompt`` and ``sampling`` are the per-prompt keyword arguments of :func:`generate`
    (with the same defaults: this class is where they are written); ``sampling`` holds the
    :class:`constrain.sampler.SamplingParams` fields.
    """

    prompt: Prompt
    schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    choices: Sequence[str] | None = None
    constraint: Constraint | None = None
    max_tokens: int | None = None
    stop: Sequence[str] | str | None = None
    stop_regex: Sequence[str] | str | None = None
    n: int = 1
    close_in_budget: bool = True
    repetition_guard: bool | None = None
    reasoning: Any = None
    num_beams: int = 1
    length_penalty: float = 1.0
    sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, (str, list, tuple)):
            raise ValueError(f"a prompt is a string or a list of chat messages, got {type(self.prompt).__name__}")


REQUEST_OPTIONS = tuple(f.name for f in fields(Request) if f.name not in ("prompt", "sampling"))
"""The keyword arguments of :func:`generate` that set a :class:`Request` field (the others but the
decoding options are sampling parameters)."""

STREAM_OPTIONS = tuple(name for name in REQUEST_OPTIONS if name not in ("n", "num_beams", "length_penalty"))
"""Those :func:`stream` takes: one completion, no beam search."""

DECODING_OPTIONS = ("jump_forward", "speculative", "forward_cost")
"""The keyword arguments of :func:`generate` that set how the batch decodes, not a request."""


class SamplingOptions(TypedDict, total=False):
    """The keyword options that set a :class:`~constrain.sampler.SamplingParams` field, with its defaults."""

    temperature: float
    top_k: int | None
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: dict[int, float]
    seed: int | None
    logprobs: int | None
    logprobs_mode: Literal["processed", "raw"]


class ReplyOptions(SamplingOptions, total=False):
    """The keyword options every public call takes: the sampling ones, how a reply ends, and how it decodes."""

    max_tokens: int | None
    stop: Sequence[str] | str | None
    stop_regex: Sequence[str] | str | None
    close_in_budget: bool
    repetition_guard: bool | None
    reasoning: bool | dict[str, Any] | Reasoning | None
    jump_forward: bool
    speculative: bool | Proposer
    forward_cost: ForwardCost | None


class ChatOptions(ReplyOptions, total=False):
    """The keyword options of :func:`constrain.chat`: those of :func:`generate` but the constraint and ``n``."""

    num_beams: int
    length_penalty: float


class StreamOptions(ReplyOptions, total=False):
    """The keyword options of :func:`stream` (:func:`generate`'s but ``n``, ``num_beams``, ``length_penalty``)."""

    schema: Any
    regex: str | None
    grammar: str | None
    choices: Sequence[str] | None
    constraint: Constraint | None


class GenerateOptions(StreamOptions, total=False):
    """The keyword options of :func:`generate`: every :class:`Request` field but ``prompt`` and ``sampling``,
    every :class:`~constrain.sampler.SamplingParams` field, and the decoding options (:data:`DECODING_OPTIONS`).
    Spelled out so that editors complete them and type checkers check them; the defaults are
    :class:`Request`'s and :class:`~constrain.sampler.SamplingParams`'."""

    n: int
    num_beams: int
    length_penalty: float


def admit(
    handle: ModelHandle,
    spec: Request,
    *,
    on_event: Callable[[int, StreamEvent], None] | None = None,
    partials: bool = True,
) -> list[InFlight]:
    """Admission: the ``n`` in-flight requests of one :class:`Request`, for a :class:`~constrain.decode.loop.DecodeLoop`
    or an :class:`~constrain.serving.engine.Engine`. Every argument is checked and the constraint compiled here, up
    front: a bad request raises (``ValueError``, a :class:`ConstraintError`, ``InvalidSamplingParamsError``)
    before anything runs, and each request is started (:meth:`InFlight.start`: a :class:`BudgetError` when
    nothing fits in ``max_tokens``). A beam search (``num_beams > 1``) is admitted by :func:`admit_beam_search`.

    ``on_event(k, event)``: called with completion ``k``'s :class:`StreamEvent` s, on the thread that runs
    the loop (None: no events). ``partials``: whether events of a JSON schema carry the partial value
    (a parse of the whole text per token; servers without a use for it save that)."""
    if spec.max_tokens is not None and (
        isinstance(spec.max_tokens, bool) or not isinstance(spec.max_tokens, int) or spec.max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be a positive integer, got {spec.max_tokens!r}")
    if isinstance(spec.n, bool) or not isinstance(spec.n, int) or spec.n < 1:
        raise ValueError(f"n must be a positive integer, got {spec.n!r}")
    params = SamplingParams(**spec.sampling)
    outside = [t for t in params.logit_bias if not 0 <= t < handle.vocab_size]
    if outside:  # checked here: inside a batch it would fail every row of the step
        raise InvalidSamplingParamsError("logit_bias", outside[0], f"token ids in [0, {handle.vocab_size})")
    constraint = resolve_constraint(spec.schema, spec.regex, spec.grammar, spec.choices, spec.constraint)
    compiled = None
    if constraint is not None:
        compiled = compile(
            constraint, handle.tokenizer, vocab_size=handle.vocab_size, eos_token_ids=list(handle.eos_token_ids)
        )
    limit = int(getattr(handle.model.config, "max_position_embeddings", 1 << 30))

    def encode(text: str) -> list[int]:
        return list(handle.tokenizer.encode(text, add_special_tokens=False))

    ids = prompt_ids(handle, spec.prompt)
    max_tokens = _answer_budget(spec.max_tokens, len(ids), limit)
    thinking = _thinking(handle, spec, ids, max_tokens, encode)
    out = []
    for k in range(spec.n):
        row_params = params
        if params.seed is not None and k:  # n samples of one seeded request differ, reproducibly
            row_params = SamplingParams(**{**spec.sampling, "seed": (params.seed + k) % (1 << 63)})
        out.append(
            InFlight(
                prompt_ids=ids,
                params=row_params,
                compiled=compiled,
                max_tokens=max_tokens,
                stop=StopText(() if spec.stop is None else spec.stop, spec.stop_regex or ()),
                detok=IncrementalDetokenizer(handle.tokenizer, context_ids=ids),
                eos=frozenset(handle.eos_token_ids),
                context_limit=limit,
                encode=encode if spec.close_in_budget else None,
                repetition_guard=spec.repetition_guard if spec.repetition_guard is not None else compiled is not None,
                thinking=thinking(),
                on_event=None if on_event is None else functools.partial(on_event, k),
                partials=partials,
            ).start()  # the closing search: BudgetError here, before any forward pass
        )
    return out


def _answer_budget(max_tokens: int | None, prompt_tokens: int, context_window: int) -> int:
    """The tokens an answer may take: ``max_tokens``, or (None) :data:`DEFAULT_MAX_TOKENS` or what the context
    window leaves after the prompt where that is less. Raises :class:`ContextWindowError` (a ``ValueError``)
    where the prompt fills the window, or a given ``max_tokens`` does not fit beside it (as OpenAI's and vLLM's
    servers refuse it: a constrained output's closing budget must know where it ends)."""
    room = context_window - prompt_tokens
    if room < 1:
        message = f"the prompt has {prompt_tokens} tokens; the model's context window is {context_window}"
        raise ContextWindowError("prompt", message)
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise ContextWindowError(
            "max_tokens",
            f"max_tokens={max_tokens} does not fit: the prompt has {prompt_tokens} tokens and the model's context "
            f"window is {context_window}, so at most {room} can follow it",
        )
    return max_tokens


def _thinking(
    handle: ModelHandle, spec: Request, prompt_ids: list[int], max_tokens: int, encode: Callable[[str], list[int]]
) -> Callable[[], Thinking | None]:
    """A maker of the request's :class:`Thinking` (one per completion), checked now."""
    options = reasoning_options(spec.reasoning)
    if options is None:
        return lambda: None
    start, end = template_tags(handle.tokenizer)
    tags = (options.start or start, options.end or end)
    info = tokenizer_info(handle.tokenizer, vocab_size=handle.vocab_size, eos_token_ids=list(handle.eos_token_ids))
    opened = prompt_opens(handle.tokenizer, prompt_ids, tags[0])
    special = list(getattr(handle.tokenizer, "all_special_ids", []))

    def make() -> Thinking:
        return Thinking(info, tags, options.max_tokens or max_tokens, encode, opened=opened,
                        eos=handle.eos_token_ids, special_ids=special)  # fmt: skip

    make()  # a budget too small for the tags raises here
    return make


def admit_beam_search(handle: ModelHandle, spec: Request) -> BeamSearch:
    """The beam search of ``spec`` (any ``num_beams``), every argument checked: see :mod:`constrain.decode.beams`."""
    check_beam_options(spec.num_beams, spec.length_penalty)
    check_sampling(spec.sampling)
    for name in ("stop", "stop_regex", "reasoning"):
        if getattr(spec, name):
            raise BeamSearchError(name, "beam search takes no stop strings or reasoning: end the output with a grammar")
    one = admit(handle, replace(spec, n=1, sampling={}, close_in_budget=False, repetition_guard=False))[0]
    return BeamSearch(handle, one.prompt_ids, one.compiled, num_beams=spec.num_beams,
                      length_penalty=spec.length_penalty, max_tokens=one.max_tokens, n=spec.n)  # fmt: skip


def _plan(handle: ModelHandle, spec: Request) -> list[InFlight] | BeamSearch:
    """How ``spec`` runs: its ``n`` completions in the batch, or a beam search (``num_beams > 1``)."""
    check_beam_options(spec.num_beams, spec.length_penalty)
    return admit_beam_search(handle, spec) if spec.num_beams > 1 else admit(handle, spec)


def _plans(handle: ModelHandle, specs: list[Request]) -> list[list[InFlight] | BeamSearch]:
    """Each request's :func:`_plan`, in order; the error of a request in a batch of several says which
    one it was (a note on the exception: ``request 2 of the 3 in this batch``), and that none was run."""
    plans = []
    for index, spec in enumerate(specs):
        try:
            plans.append(_plan(handle, spec))
        except Exception as err:
            if len(specs) > 1 and hasattr(err, "add_note"):  # (Python 3.11 and later)
                err.add_note(f"request {index} of the {len(specs)} in this batch; none of them was run")
            raise
    return plans


SAMPLING_OPTIONS = tuple(f.name for f in fields(SamplingParams))
"""The keyword arguments that set a :class:`~constrain.sampler.SamplingParams` field."""


def check_options(call: str, options: Collection[str], known: Collection[str]) -> None:
    """A ``ValueError`` naming the first of ``options`` (keyword names given to ``call``) not in ``known``,
    and the option it was likely meant to be."""
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(sorted(known))}"
            raise ValueError(f"{call}() got an unknown option {name!r}{hint}")


def _requests(
    call: str, prompt: Any, options: dict[str, Any], names: Collection[str]
) -> tuple[list[Request], dict[str, Any], bool]:
    """The requests of a call to ``call``, its decoding options, and whether it was a single prompt: the
    ``options`` in ``names`` set those :class:`Request` fields, the sampling ones its ``sampling`` (the same
    for every prompt given as a string or messages; a :class:`Request` keeps its own). An option of no
    kind is a ``ValueError`` that names it (and the option it was likely meant to be)."""
    check_options(call, options, (*names, *SAMPLING_OPTIONS, *DECODING_OPTIONS))
    if not isinstance(prompt, (str, Request, list, tuple)):
        raise ValueError(
            f"prompt is a string, chat messages, a Request, or a list of those (a batch); got {type(prompt).__name__}"
        )
    single = not isinstance(prompt, (list, tuple)) or (bool(prompt) and isinstance(prompt[0], dict))
    items = list(prompt) if isinstance(prompt, (list, tuple)) and not single else [prompt]
    if not items:
        raise ValueError("no prompt given")
    template = {k: v for k, v in options.items() if k in names}
    sampling = {k: v for k, v in options.items() if k in SAMPLING_OPTIONS}
    SamplingParams(**sampling)  # checked before the model loads
    decoding = {k: v for k, v in options.items() if k in DECODING_OPTIONS}
    specs = [p if isinstance(p, Request) else Request(p, **template, sampling=sampling) for p in items]
    return specs, decoding, single


def generate(
    model: Any, prompt: Prompt | Request | Sequence[Prompt | Request], **options: Unpack[GenerateOptions]
) -> Any:
    """Generate completions, constrained by at most one of schema/regex/grammar/choices/constraint.

    The options are :class:`GenerateOptions`. Every one but ``jump_forward``, ``speculative`` and
    ``forward_cost`` sets a :class:`Request` field (their defaults are its) or a sampling parameter: each
    prompt given as a string or messages becomes ``Request(prompt, **those, sampling=the rest)``. An
    unknown option is a ``ValueError`` that names it, raised before the model loads.

    Parameters
    ----------
    model : ModelHandle, or anything ``load_model`` takes (None: the default model)
    prompt : a string, chat messages, or a list of those (one batch)
    schema, regex, grammar, choices, constraint : the constraint, default: None (free text)
        A JSON schema (dict, pydantic model or type), a regex, a grammar (EBNF, xgrammar's dialect), a list of
        strings, or a value of ``constrain.json_schema/regex/grammar/choice``.
    max_tokens : int or None, default: None (256, or what the context window leaves after the prompt)
        A ``ValueError`` where the prompt and ``max_tokens`` together exceed the model's context window.
    stop, stop_regex : stop strings / regexes (cut from the text, with what follows)
    n : int, default: 1
        Completions per prompt (seeded requests use seed, seed + 1, ...).
    close_in_budget : bool, default: True
        Constrained output ends complete and valid within ``max_tokens``: near the end, a token
        after which no completion fits is replaced by the closing path (``closed_early``,
        ``finish_reason="length"``); :class:`BudgetError` up front when nothing fits at all.
    repetition_guard : bool or None, default: None (on when constrained)
        Forbid the separator after a JSON item repeated 3 times in a row (``guard_steps``).
    reasoning : bool, dict, Reasoning or None, default: None
        Think first, then answer: the model writes freely between the thinking tags (the chat
        template's, or given), the constraint applies from the end tag on. ``{"max_tokens": N}``
        bounds the thinking (the end tag is forced when it runs out). See :mod:`constrain.decode.reasoning`.
    num_beams : int, default: 1
        Beam search under the constraint when > 1: every finished beam is complete and valid
        (``GenerationResult.beams``, best first); ``n`` then returns the ``n`` best. See :mod:`constrain.decode.beams`.
    length_penalty : float, default: 1.0
        Beams are ranked by ``logprob / max(length, 1) ** length_penalty`` (length: the text's tokens as
        the tokenizer writes it, whichever tokens the beam took).
    jump_forward : bool, default: True
        Feed the text the grammar forces as drafts, verified in one forward pass (the same tokens
        as without it, in fewer passes).
    speculative : bool or Proposer, default: True
        Where nothing is forced, also verify drafts: ``True`` drafts from the prompt and output
        (:class:`NgramProposer`, pays off when the output copies the prompt); a
        :class:`DraftModelProposer` drafts with a small model of the same vocabulary; ``False``
        drafts nothing. Same verification, same tokens. Each step feeds only the drafts expected to
        pay for the wider pass, from each proposal's prior, the request's acceptance so far and the
        model's forward cost (measured once per machine and batch size, on the batch's rows rounded down
        to a power of two, up to 17 tokens per row, and saved: :func:`constrain.models.cost.forward_cost`;
        for 8 rows on a 2-core AMD EPYC with AVX2, three sweeps of passes up to 192 tokens, 12 s once);
        a probe's drafts until drafts have paid (one, or as many as a pass costs no more for:
        :func:`~constrain.decode.speculative.probe_width`), and none for a while after drafts that were all
        rejected.
    forward_cost : ForwardCost or None, default: None
        The model's forward cost by tokens fed, for hardware you know (None: the saved or measured one).
        The drafts fed depend on it, and a pass of several tokens can change the logits' last bits
        (visible in bfloat16): processes on one machine read the same saved cost; give one (or
        ``speculative=False``) where seeded runs must match across machines.
    temperature, top_k, top_p, min_p, seed, logprobs : SamplingParams fields
        Every :class:`~constrain.sampler.SamplingParams` field (:class:`SamplingOptions`: the penalties,
        ``logit_bias`` and ``logprobs_mode`` too), with its defaults and ranges.

    Returns
    -------
    A :class:`GenerationResult` for one prompt and ``n == 1``; else a list (per prompt, of ``n``
    results when ``n > 1``).

    Raises
    ------
    ValueError, ConstraintError
        Bad arguments or constraints, before any token is generated.
    """
    specs, decoding, single = _requests("generate", prompt, dict(options), REQUEST_OPTIONS)
    handle = model_handle(model)
    plans = _plans(handle, specs)  # every error surfaces before any forward
    expanded = [plan for plan in plans if not isinstance(plan, BeamSearch)]
    _run(handle, [r for group in expanded for r in group], **decoding)
    results = [p.run() if isinstance(p, BeamSearch) else [r.result() for r in p] for p in plans]  # searches one by one
    flat = [group if spec.n > 1 else group[0] for group, spec in zip(results, specs, strict=True)]
    return flat[0] if single else flat


def stream(
    model: Any, prompt: Prompt | Request, **options: Unpack[StreamOptions]
) -> Iterator[StreamEvent | GenerationResult]:
    """Like :func:`generate` for one prompt, yielding :class:`StreamEvent` s as text is produced and
    the :class:`GenerationResult` last. Deltas concatenate exactly to the final text; text that
    could start a stop string is held back until it cannot. Closing the iterator early (``break``
    out of a ``for`` loop, then ``close()`` or garbage collection) cancels the request: the worker
    stops after its current step.

    Takes the keyword arguments of :func:`generate` but ``n``, ``num_beams`` and ``length_penalty``
    (:data:`STREAM_OPTIONS`). Arguments are checked at the first ``next()``, like the rest of the body."""
    one, no_beams = "stream() takes one prompt and n=1: use generate() for a batch", "use generate() for beam search"
    if "n" in options:
        raise ValueError(one)
    for name in ("num_beams", "length_penalty"):
        if name in options:
            raise BeamSearchError(name, no_beams)
    specs, decoding, single = _requests("stream", prompt, dict(options), STREAM_OPTIONS)
    if not single or specs[0].n != 1:  # a list of prompts, or a Request of several completions
        raise ValueError(one)
    if specs[0].num_beams != 1:
        raise BeamSearchError("num_beams", no_beams)
    handle = model_handle(model)
    feed: Feed[StreamEvent] = Feed()
    requests = admit(handle, specs[0], on_event=lambda _, event: feed.put(event))
    resolve_proposer(handle, decoding.get("speculative", True))  # a bad draft model raises here, not in the worker

    def decode(cancelled: threading.Event) -> None:
        _run(handle, requests, cancelled=cancelled, **decoding)

    yield from feed.run(decode)
    yield requests[0].result()


async def agenerate(
    model: Any, prompt: Prompt | Request | Sequence[Prompt | Request], **options: Unpack[GenerateOptions]
) -> Any:
    """:func:`generate` on a worker thread, for async servers."""
    return await asyncio.to_thread(functools.partial(generate, model, prompt, **options))


async def astream(
    model: Any, prompt: Prompt | Request, **options: Unpack[StreamOptions]
) -> AsyncIterator[StreamEvent | GenerationResult]:
    """:func:`stream` for async servers: events arrive as the worker thread produces them."""
    iterator = stream(model, prompt, **options)
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, iterator, sentinel)
        if item is sentinel:
            return
        yield item  # type: ignore[misc]
