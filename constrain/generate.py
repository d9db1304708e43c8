"""The decode loop: forward -> grammar bitmask -> sampler -> stop criteria -> detokenize.

One loop serves a batch: prompts are left-padded into one prefill, then every
step runs one forward for the whole batch (transformers' KV cache), one batched
bitmask fill for the constrained rows, and one sampler call; finished rows leave
the batch (and the cache) at once.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from constrain.closing import Budget, RepetitionGuard
from constrain.compiler import CompiledConstraint, compile
from constrain.constraints import Choice, Constraint, Grammar, JsonSchema, Regex, choice, grammar, json_schema, regex
from constrain.detokenizer import IncrementalDetokenizer
from constrain.matcher import Matcher, allocate_token_bitmask, fill_next_token_bitmasks
from constrain.models import ModelHandle, load_model
from constrain.results import FinishReason, GenerationResult, StreamEvent, Usage
from constrain.speculative import DraftModelProposer, NgramProposer, Proposer
from constrain.stopping import StopText
from constrain.validate import parse_json
from sampler import Sampler, SamplingMetadata, SamplingParams

__all__ = ["Request", "agenerate", "astream", "generate", "stream"]

DEFAULT_MAX_TOKENS = 256
GUARD_WINDOW = 4096
"""Characters of recent output the repetition guard looks at (it needs ``copies x max_period``)."""
"""``max_tokens`` when none is given."""

Prompt = str | Sequence[dict[str, str]]
"""A completion prompt, or chat messages (``[{"role": ..., "content": ...}]``) for the chat template."""


def _constraint(
    schema: Any, regex_: str | None, grammar_: str | None, choices: Sequence[str] | None, constraint: Any
) -> Constraint | None:
    given = [x is not None for x in (schema, regex_, grammar_, choices, constraint)]
    if sum(given) > 1:
        raise ValueError("pass at most one of schema=, regex=, grammar=, choices=, constraint=")
    if schema is not None:
        # Generation takes keys in the schema's order: forced, never repeated (pass a
        # json_schema(..., property_order="any") constraint to let the model choose).
        return schema if isinstance(schema, JsonSchema) else json_schema(schema, property_order="schema")
    if regex_ is not None:
        return regex(regex_)
    if grammar_ is not None:
        return grammar(grammar_)
    if choices is not None:
        return choice(choices)
    if constraint is not None and not isinstance(constraint, (JsonSchema, Regex, Grammar, Choice)):
        raise ValueError("constraint= takes a value from constrain.json_schema/regex/grammar/choice")
    return constraint


def _prompt_ids(handle: ModelHandle, prompt: Prompt) -> list[int]:
    tokenizer = handle.tokenizer
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError("a prompt is a string or a non-empty list of {'role': ..., 'content': ...} messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{handle.name} has no chat template: pass the prompt as a string")
    text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class _Request:
    """One completion in flight."""

    prompt_ids: list[int]
    params: SamplingParams
    compiled: CompiledConstraint | None
    max_tokens: int
    stop: StopText
    detok: IncrementalDetokenizer
    eos: frozenset[int]
    context_limit: int
    on_event: Callable[[StreamEvent], None] | None = None
    encode: Callable[[str], list[int]] | None = None  # closing in budget: tokenize forced text
    repetition_guard: bool = False
    matcher: Matcher | None = None
    budget: Budget | None = None
    guard: RepetitionGuard | None = None
    generated: str = ""  # the last GUARD_WINDOW characters, before stop strings hold any back
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_hit: bool = False  # a stop string or regex ended it (its text is already cut)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.compiled is None:
            return
        self.matcher = self.compiled.matcher()
        if self.encode is not None:
            self.budget = Budget(self.matcher, self.encode, self.max_tokens)  # BudgetError: fails up front
        if self.repetition_guard:
            self.guard = RepetitionGuard(self.compiled.tokenizer)

    def _emit(self, text: str, token_ids: list[int]) -> None:
        self.text += text
        if self.on_event is not None and (text or token_ids):
            self.on_event(StreamEvent(text, token_ids, _partial(self.compiled, self.text)))

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.finish_reason, self.error = reason, error
        if reason == "stop" and self.stop_hit:
            return
        update = self.stop.feed(self.detok.finish())
        if update.stopped:
            self.stop_hit = True
            self._emit(update.text, [])
            self.finish_reason = "stop"
            return
        self._emit(update.text + self.stop.flush(), [])

    def step(self, token: int) -> bool:
        """Take the sampled token; return True when the request is finished."""
        if token < 0:
            self.finish("error", "the grammar allows no token here (a dead end)")
            return True
        if token in self.eos:
            self.finish("stop")
            return True
        if self.budget is not None:
            vetted = self.budget.vet(token, self.max_tokens - len(self.output_ids))
            if vetted is None:  # complete, and only ending keeps it within the budget
                self.finish("length")
                return True
            if vetted != token and self.params.logprobs is not None and self.logprobs:
                self.logprobs[-1] = math.nan  # the sampler's logprob was for the token it drew
            token = vetted
        if self.matcher is not None and not self.matcher.accept_token(token):
            self.finish("error", f"the grammar rejected token {token}")
            return True
        self.output_ids.append(token)
        piece = self.detok.add(token)
        self.generated = (self.generated + piece)[-GUARD_WINDOW:]
        update = self.stop.feed(piece)
        self._emit(update.text, [token])
        if update.stopped:
            self.stop_hit = True
            self.finish("stop")
        elif self.matcher is not None and self.matcher.is_completed() and not self.matcher.can_continue():
            self.finish("stop")
        elif (
            len(self.output_ids) >= self.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= self.context_limit
        ):
            self.finish("length")
        return self.finish_reason is not None

    def record_logprobs(self, logprobs: Any, row: int) -> None:
        """Keep the sampled token's logprob and the top ones this request asked for."""
        self.logprobs.append(float(logprobs.sampled[row]))
        top = zip(logprobs.top_token_ids[row].tolist(), logprobs.top_logprobs[row].tolist(), strict=True)
        self.top_logprobs.append(dict(list(top)[: self.params.logprobs]))

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        forced = self.budget.forced if self.budget is not None else 0
        if forced:  # the closing path ended it: complete, but cut short by the budget
            self.finish_reason = "length"
        violations, value = _check(self.compiled, self.text)
        if self.finish_reason == "error" and not violations:
            violations = [self.error or "generation failed"]
        asked = self.params.logprobs is not None
        return GenerationResult(
            text=self.text,
            value=value,
            finish_reason=self.finish_reason,
            token_ids=list(self.output_ids),
            usage=Usage(len(self.prompt_ids), len(self.output_ids)),
            violations=violations,
            logprobs=self.logprobs if asked else None,
            top_logprobs=self.top_logprobs if asked and self.params.logprobs else None,
            error=self.error,
            closed_early=forced > 0,
            forced_tokens=forced,
            guard_steps=self.guard.steps if self.guard is not None else 0,
        )


def _partial(compiled: CompiledConstraint | None, text: str) -> Any:
    if compiled is None or not isinstance(compiled.constraint, JsonSchema) or not text.strip():
        return None
    from pydantic_core import from_json

    try:
        return from_json(text, allow_partial=True)
    except ValueError:
        return None


def _check(compiled: CompiledConstraint | None, text: str) -> tuple[list[str], Any]:
    """(violations, value) of the finished text."""
    if compiled is None:
        return [], text
    violations = compiled.validate(text)
    if violations:
        return violations, None
    constraint = compiled.constraint
    if not isinstance(constraint, JsonSchema):
        return [], text
    if constraint.python_type is None:
        return [], parse_json(text)
    import pydantic

    try:
        return [], pydantic.TypeAdapter(constraint.python_type).validate_json(text)
    except pydantic.ValidationError as err:
        return [f"{'/'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()], None


class _Clock:
    """Adds the seconds spent in each stage to ``totals`` (a no-op without it)."""

    def __init__(self, totals: dict[str, float] | None) -> None:
        self.totals = totals
        self._stage = ""
        self._start = 0.0

    def __call__(self, stage: str) -> _Clock:
        self._stage = stage
        return self

    def __enter__(self) -> None:
        if self.totals is not None:
            self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.totals is not None:
            self.totals[self._stage] = self.totals.get(self._stage, 0.0) + time.perf_counter() - self._start


_mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constrain-masks")


MAX_DRAFT = 16
"""Jump-forward: at most this many forced tokens are verified in one forward pass."""


def _masks(
    active: list[_Request],
    drafts: list[list[int]],
    vocab: int,
    decode: Callable[[list[int]], str],
) -> tuple[list[int], torch.Tensor | None]:  # (constrained slots, [c, ceil(V / 32)] int32 on the CPU)
    """The bitmasks of every constrained slot: slot ``(i, j)`` is row ``i`` after its first ``j`` drafts
    (slots numbered row by row), repetition guard applied. Changes no matcher (drafts go to forks)."""
    matchers: list[Matcher] = []
    slots: list[int] = []
    texts: list[tuple[_Request, str]] = []
    slot = 0
    for i, r in enumerate(active):
        state = r.matcher
        for j in range(len(drafts[i]) + 1):
            if state is not None:
                if j:
                    state = state.fork()
                    state.accept_token(drafts[i][j - 1])
                matchers.append(state)
                slots.append(slot)
                texts.append((r, r.generated + decode(drafts[i][:j]) if j else r.generated))
            slot += 1
    if not slots:
        return slots, None
    bitmask = allocate_token_bitmask(len(slots), vocab)
    fill_next_token_bitmasks(matchers, bitmask)
    for k, (r, text) in enumerate(texts):
        if r.guard is not None:
            r.guard.apply(text, bitmask[k])
    return slots, bitmask


def _drafts(r: _Request, encode: Callable[[str], list[int]], proposer: Proposer | None) -> list[int]:
    """Drafts for ``r``'s next forward pass: the grammar's forced text (jump-forward), else the
    ``proposer``'s guess (speculative decoding); pruned to what the grammar accepts."""
    room = min(MAX_DRAFT, r.max_tokens - len(r.output_ids) - 1)
    if r.finish_reason is not None or room <= 0:
        return []
    forced = r.matcher.forced_text() if r.matcher is not None else ""
    if forced:
        ids = encode(forced)[:room]
    elif proposer is not None:
        ids = proposer.propose(r.prompt_ids, r.output_ids, room, r.matcher.fork() if r.matcher is not None else None)
    else:
        return []
    if r.matcher is None:
        return ids
    return ids[: r.matcher.fork().accept_tokens(ids)]


def _proposer(handle: ModelHandle, speculative: bool | Proposer) -> Proposer | None:
    """The draft proposer ``speculative`` names; ``ValueError`` for a draft model of another vocabulary."""
    if isinstance(speculative, bool):
        return NgramProposer() if speculative else None
    if isinstance(speculative, DraftModelProposer):
        speculative.check_vocabulary(handle)
    return speculative


def _run(
    handle: ModelHandle,
    requests: list[_Request],
    timings: dict[str, float] | None = None,
    *,
    overlap: bool | None = None,
    jump_forward: bool = True,
    speculative: bool | Proposer = False,
) -> None:
    """Decode every request to its end, as one batch; ``timings`` collects seconds per stage.

    ``jump_forward``: after each token, the text the grammar forces next (``{"name": "``, a closing
    quote) is tokenized and fed in the same forward pass as drafts; the sampler then runs at every
    draft position exactly as plain decoding would (same masks, history and seeded draws), and a
    draft counts only when the sampled token equals it. The output is therefore that of plain
    decoding, token for token (up to the last bits of the logits, which differ between a one-token
    and a many-token forward pass and could flip an exact tie), while one forward pass covers the
    forced stretch. Rejected drafts stay in the KV cache, masked out of attention.

    ``speculative``: where nothing is forced, draft with a :class:`~constrain.speculative.Proposer`
    (``True``: :class:`~constrain.speculative.NgramProposer`, prompt lookup), pruned by the grammar,
    verified the same way. Drafts are deterministic, so "accept while the sampled token equals the
    draft" accepts with the probability rejection sampling would (p of the draft) and emits exactly
    plain decoding's distribution (its very tokens, for seeded requests).

    ``overlap``: fill the grammar masks on a worker thread while the forward pass runs (xgrammar and
    llguidance release the GIL), so that the mask costs nothing on the critical path. Default: when
    the model is not on the CPU; on the CPU the thread competes with the forward for the same cores
    (measured with SmolLM2 on 2 cores, batch 8: the mask wait fell from 0.65 to 0.02 ms a step and the
    forward rose by 1.6 ms).
    """
    clock = _Clock(timings)
    proposer = _proposer(handle, speculative)
    model, device = handle.model, next(handle.model.parameters()).device
    overlap = device.type != "cpu" if overlap is None else overlap
    vocab = handle.vocab_size
    tokenizer = handle.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else handle.eos_token_ids[0]

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    sampler = Sampler()
    active = list(requests)
    drafts: list[list[int]] = [[] for _ in active]
    width = max(len(r.prompt_ids) for r in active)
    input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in active], device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in active], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: left padding must not shift positions
    cache = None
    # the prompt's logits are needed at its last position only ([B, T, V] would dominate the prefill)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode():
        while active:
            # the masks depend only on the tokens so far: fill them beside the forward pass
            pending = _mask_pool.submit(_masks, active, drafts, vocab, decode) if overlap else None
            with clock("forward"):
                prefill = cache is None
                out = model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    **(last_only if prefill else {}),  # decode steps: slicing 1 of 1 made them slower
                )
                cache = out.past_key_values
                slot_row = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
                slot_col = [-1 if prefill else j for d in drafts for j in range(len(d) + 1)]
                logits = out.logits[slot_row, slot_col]  # [P, V]: every slot's next-token logits
            with clock("mask"):  # with overlap: what is left of the fill once the forward is done
                slots, bitmask = pending.result() if pending is not None else _masks(active, drafts, vocab, decode)
                if bitmask is not None:
                    bitmask = bitmask.to(device)
            with clock("sampler"):
                histories = [(active[i], drafts[i][:j]) for i, d in enumerate(drafts) for j in range(len(d) + 1)]
                sampled = _sample(sampler, histories, logits, vocab, device, bitmask, slots)
                tokens = sampled.token_ids.tolist()
            with clock("stop+detokenize"):
                keep, rejected = [], []  # rejected: (row, first block column whose draft is not kept)
                slot = 0
                for i, r in enumerate(active):
                    finished, confirmed = False, len(drafts[i])
                    for j in range(len(drafts[i]) + 1):
                        token = tokens[slot + j]
                        if r.params.logprobs is not None and sampled.logprobs is not None and token >= 0:
                            r.record_logprobs(sampled.logprobs, slot + j)
                        finished = r.step(token)
                        if finished or j == len(drafts[i]):
                            break
                        if token != drafts[i][j] or r.output_ids[-1] != token:
                            confirmed = j  # drafts j+1.. were computed on a history that did not happen
                            break
                    slot += len(drafts[i]) + 1
                    if not finished:
                        keep.append(i)
                        if confirmed < len(drafts[i]):
                            rejected.append((i, confirmed + 1))
                width = 1 + max((len(d) for d in drafts), default=0)
                for i, first in rejected:
                    mask[i, mask.shape[1] - width + first :] = 0
            if len(keep) < len(active):
                if not keep:
                    break
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask = mask[index]
                active = [active[i] for i in keep]
            drafts = [_drafts(r, encode, proposer) if jump_forward else [] for r in active]
            width = 1 + max(len(d) for d in drafts)
            input_ids = torch.tensor(  # [b, width]: the last token, its drafts, padding
                [[r.output_ids[-1], *d] + [pad] * (width - 1 - len(d)) for r, d in zip(active, drafts, strict=True)],
                device=device,
            )
            block = mask.new_tensor([[1] * (1 + len(d)) + [0] * (width - 1 - len(d)) for d in drafts])  # [b, width]
            positions = mask.sum(-1, keepdim=True) + torch.arange(width, device=device)  # [b, width]
            mask = torch.cat([mask, block], dim=1)


def _sample(
    sampler: Sampler,
    histories: list[tuple[_Request, list[int]]],
    # [P, V] float: one row per slot
    logits: torch.Tensor,
    vocab: int,
    device: torch.device,
    # [c, ceil(V / 32)] int32 or None
    bitmask: torch.Tensor | None,
    rows: list[int],
) -> Any:
    """One sampler call for every slot: its request's parameters, and its history (output + drafts)."""
    penalized = any(r.params.has_penalties for r, _ in histories)
    metadata = SamplingMetadata.build(
        [r.params for r, _ in histories],
        vocab_size=vocab,
        device=device,
        prompt_token_ids=[r.prompt_ids for r, _ in histories] if penalized else None,
        output_token_ids=[r.output_ids + extra if extra else r.output_ids for r, extra in histories],
        token_bitmask=bitmask,
        bitmask_rows=rows if rows else None,
    )
    return sampler(logits, metadata)


@dataclass(frozen=True)
class Request:
    """One prompt with its own constraint and parameters, for a mixed batch:
    ``generate(model, [Request(p1, schema=A), Request(p2, regex=r"...", temperature=0)])``."""

    prompt: Prompt
    schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    choices: Sequence[str] | None = None
    constraint: Constraint | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: Sequence[str] | str | None = None
    stop_regex: Sequence[str] | str | None = None
    n: int = 1
    close_in_budget: bool = True
    repetition_guard: bool | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


def _expand(handle: ModelHandle, spec: Request) -> list[_Request]:
    """The ``n`` in-flight requests of one :class:`Request`; every argument is checked here, up front."""
    if not isinstance(spec.max_tokens, int) or spec.max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {spec.max_tokens!r}")
    if not isinstance(spec.n, int) or spec.n < 1:
        raise ValueError(f"n must be a positive integer, got {spec.n!r}")
    params = SamplingParams(**spec.sampling)
    constraint = _constraint(spec.schema, spec.regex, spec.grammar, spec.choices, spec.constraint)
    compiled = None
    if constraint is not None:
        compiled = compile(
            constraint, handle.tokenizer, vocab_size=handle.vocab_size, eos_token_ids=list(handle.eos_token_ids)
        )
    limit = int(getattr(handle.model.config, "max_position_embeddings", 1 << 30))

    def encode(text: str) -> list[int]:
        return list(handle.tokenizer.encode(text, add_special_tokens=False))

    ids = _prompt_ids(handle, spec.prompt)
    out = []
    for k in range(spec.n):
        row_params = params
        if params.seed is not None and k:  # n samples of one seeded request differ, reproducibly
            row_params = SamplingParams(**{**spec.sampling, "seed": (params.seed + k) % (1 << 63)})
        out.append(
            _Request(
                prompt_ids=ids,
                params=row_params,
                compiled=compiled,
                max_tokens=spec.max_tokens,
                stop=StopText(spec.stop or (), spec.stop_regex or ()),
                detok=IncrementalDetokenizer(handle.tokenizer, context_ids=ids),
                eos=frozenset(handle.eos_token_ids),
                context_limit=limit,
                encode=encode if spec.close_in_budget else None,
                repetition_guard=spec.repetition_guard if spec.repetition_guard is not None else compiled is not None,
            )
        )
    return out


def _specs(prompt: Any, template: dict[str, Any]) -> tuple[list[Request], bool]:
    """The requests of a call, and whether it was a single prompt."""
    single = isinstance(prompt, (str, Request)) or (bool(prompt) and isinstance(prompt[0], dict))
    items = [prompt] if single else list(prompt)
    if not items:
        raise ValueError("no prompt given")
    specs = [p if isinstance(p, Request) else Request(p, **template) for p in items]
    return specs, single


def _handle(model: Any) -> ModelHandle:
    return model if isinstance(model, ModelHandle) else load_model(model)


def generate(
    model: Any,
    prompt: Prompt | Sequence[Prompt],
    *,
    schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    choices: Sequence[str] | None = None,
    constraint: Constraint | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stop: Sequence[str] | str | None = None,
    stop_regex: Sequence[str] | str | None = None,
    n: int = 1,
    close_in_budget: bool = True,
    repetition_guard: bool | None = None,
    jump_forward: bool = True,
    speculative: bool | Proposer = False,
    **sampling: Any,
) -> Any:
    """Generate completions, constrained by at most one of schema/regex/grammar/choices/constraint.

    Parameters
    ----------
    model : ModelHandle, or anything ``load_model`` takes (None: the default model)
    prompt : a string, chat messages, or a list of those (one batch)
    max_tokens : int, default: 256
    stop, stop_regex : stop strings / regexes (cut from the text, with what follows)
    n : int, default: 1
        Completions per prompt (seeded requests use seed, seed + 1, ...).
    close_in_budget : bool, default: True
        Constrained output ends complete and valid within ``max_tokens``: near the end, a token
        after which no completion fits is replaced by the closing path (``closed_early``,
        ``finish_reason="length"``); :class:`BudgetError` up front when nothing fits at all.
    repetition_guard : bool or None, default: None (on when constrained)
        Forbid the separator after a JSON item repeated 3 times in a row (``guard_steps``).
    jump_forward : bool, default: True
        Feed the text the grammar forces as drafts, verified in one forward pass (the same tokens
        as without it, in fewer passes).
    speculative : bool or Proposer, default: False
        Where nothing is forced, also verify drafts: ``True`` drafts from the prompt and output
        (:class:`NgramProposer`, pays off when the output copies the prompt); a
        :class:`DraftModelProposer` drafts with a small model of the same vocabulary. Same
        verification, same tokens.
    **sampling : any :class:`sampler.SamplingParams` field (temperature, top_p, seed, logprobs...)

    Returns
    -------
    A :class:`GenerationResult` for one prompt and ``n == 1``; else a list (per prompt, of ``n``
    results when ``n > 1``).

    Raises
    ------
    ValueError, ConstraintError
        Bad arguments or constraints, before any token is generated.
    """
    handle = _handle(model)
    template = dict(
        schema=schema, regex=regex, grammar=grammar, choices=choices, constraint=constraint,
        max_tokens=max_tokens, stop=stop, stop_regex=stop_regex, n=n, close_in_budget=close_in_budget,
        repetition_guard=repetition_guard, sampling=sampling,
    )  # fmt: skip
    specs, single = _specs(prompt, template)
    expanded = [_expand(handle, spec) for spec in specs]  # every error surfaces before any forward
    _proposer(handle, speculative)
    _run(handle, [r for group in expanded for r in group], jump_forward=jump_forward, speculative=speculative)
    results = [[r.result() for r in group] for group in expanded]
    flat = [group if spec.n > 1 else group[0] for group, spec in zip(results, specs, strict=True)]
    return flat[0] if single else flat


def stream(
    model: Any,
    prompt: Prompt,
    *,
    schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    choices: Sequence[str] | None = None,
    constraint: Constraint | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stop: Sequence[str] | str | None = None,
    stop_regex: Sequence[str] | str | None = None,
    close_in_budget: bool = True,
    repetition_guard: bool | None = None,
    jump_forward: bool = True,
    speculative: bool | Proposer = False,
    **sampling: Any,
) -> Iterator[StreamEvent | GenerationResult]:
    """Like :func:`generate` for one prompt, yielding :class:`StreamEvent` s as text is produced and
    the :class:`GenerationResult` last. Deltas concatenate exactly to the final text; text that
    could start a stop string is held back until it cannot."""
    handle = _handle(model)
    template = dict(
        schema=schema, regex=regex, grammar=grammar, choices=choices, constraint=constraint,
        max_tokens=max_tokens, stop=stop, stop_regex=stop_regex, close_in_budget=close_in_budget,
        repetition_guard=repetition_guard, sampling=sampling,
    )  # fmt: skip
    specs, single = _specs(prompt, template)
    if not single or specs[0].n != 1:
        raise ValueError("stream() takes one prompt and n=1: use generate() for a batch")
    requests = _expand(handle, specs[0])
    _proposer(handle, speculative)
    queue: list[Any] = []
    done = threading.Event()
    lock = threading.Condition()

    def on_event(event: StreamEvent) -> None:
        with lock:
            queue.append(event)
            lock.notify()

    requests[0].on_event = on_event
    failure: list[BaseException] = []

    def worker() -> None:
        try:
            _run(handle, requests, jump_forward=jump_forward, speculative=speculative)
        except BaseException as err:
            failure.append(err)
        finally:
            with lock:
                done.set()
                lock.notify()

    threading.Thread(target=worker, daemon=True).start()
    while True:
        with lock:
            while not queue and not done.is_set():
                lock.wait()
            pending, queue[:] = list(queue), []
        yield from pending
        if done.is_set() and not queue:
            break
    if failure:
        raise failure[0]
    yield requests[0].result()


async def agenerate(model: Any, prompt: Prompt | Sequence[Prompt], **kwargs: Any) -> Any:
    """:func:`generate` on a worker thread, for async servers."""
    return await asyncio.to_thread(generate, model, prompt, **kwargs)


async def astream(model: Any, prompt: Prompt, **kwargs: Any) -> AsyncIterator[StreamEvent | GenerationResult]:
    """:func:`stream` for async servers: events arrive as the worker thread produces them."""
    iterator = stream(model, prompt, **kwargs)
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, iterator, sentinel)
        if item is sentinel:
            return
        yield item  # type: ignore[misc]
