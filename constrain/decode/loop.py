"""The decode loop: forward -> grammar bitmask -> sampler -> stop criteria -> detokenize.

A :class:`DecodeLoop` runs one batch: every step does one forward for the whole batch (transformers'
KV cache), one batched bitmask fill for the constrained rows, and one sampler call. Requests join
between steps (their prompts are prefilled in the step they join, in groups of similar length or
after a prefix another prompt left in the :class:`PrefixCache`, and their KV cache is merged into the
batch's) and leave as soon as they finish or are cancelled: continuous batching, for a server.
:func:`run` decodes a fixed set of requests to the end.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from constrain.compile.compiler import CompiledConstraint
from constrain.constraints.constraint import JsonSchema
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.partial import PartialJson
from constrain.decode.reasoning import Thinking
from constrain.decode.speculative import Acceptance, DraftModelProposer, NgramProposer, Proposer, plan_drafts
from constrain.decode.stopping import StopText
from constrain.match.closing import Budget, RepetitionGuard
from constrain.match.matcher import Matcher, allocate_token_bitmask, fill_next_token_bitmasks
from constrain.match.validate import parse_json
from constrain.models import cost
from constrain.models.loading import ModelHandle
from constrain.results import FinishReason, GenerationResult, StreamEvent, Usage
from sampler import Sampler, SamplingMetadata, SamplingParams

__all__ = ["DecodeLoop", "InFlight", "MaskFilter", "PrefixCache", "check_output", "resolve_proposer", "run"]

GUARD_WINDOW = 4096
"""Characters of recent output the repetition guard looks at (it needs ``copies x max_period``)."""


class MaskFilter(Protocol):
    """A constraint's own filter of one request's masks, applied after the grammar's (and the repetition
    guard's): a constraint offers one with a ``mask_filter(tokenizer_info)`` method, such as the
    grammar of a reply with tools (:class:`~constrain.tools.calling.ToolGrammar`, which forbids repeating a call).
    """

    def feed(self, text: str) -> None:
        """Take the next piece of the request's text (before stop strings hold any back)."""

    def apply(
        self,
        matcher: Matcher,
        text: str,
        # [ceil(V / 32)] int32 on the CPU: the mask ``matcher`` filled; updated in place
        row: torch.Tensor,
    ) -> bool:
        """Clear tokens from ``row`` (never all); ``matcher`` is at the text fed plus ``text`` (drafts)."""


@dataclass(eq=False)
class InFlight:
    """One completion in flight (compared by identity)."""

    prompt_ids: list[int]
    params: SamplingParams
    compiled: CompiledConstraint | None
    max_tokens: int
    stop: StopText
    detok: IncrementalDetokenizer
    eos: frozenset[int]
    context_limit: int
    on_event: Callable[[StreamEvent], None] | None = None
    partials: bool = True  # events carry the partial JSON value (a parse of the whole text, per token)
    typed: PartialJson | None = None  # with partials and a JSON schema: the typed value (constrain.decode.partial)
    encode: Callable[[str], list[int]] | None = None  # closing in budget: tokenize forced text
    repetition_guard: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)  # of its proposer drafts (its loop sets the prior)
    matcher: Matcher | None = None
    budget: Budget | None = None
    guard: RepetitionGuard | None = None
    mask_filter: MaskFilter | None = None  # the constraint's own (tools: RepeatedCallFilter)
    thinking: Thinking | None = None  # with reasoning: the thinking before the answer (constrain.decode.reasoning)
    answer_start: int = 0  # output_ids[answer_start:] are the answer's (the rest the thinking's)
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
            self.budget = Budget(self.matcher, self.encode, self.max_tokens, initial=True)  # BudgetError: up front
        if self.repetition_guard:
            self.guard = RepetitionGuard(self.compiled.tokenizer)
        make_filter = getattr(self.compiled.constraint, "mask_filter", None)  # a tools grammar's
        if make_filter is not None:
            self.mask_filter = make_filter(self.compiled.tokenizer)

    def _emit(self, text: str, token_ids: list[int]) -> None:
        self.text += text
        if self.on_event is None:
            return
        partial, value = None, None
        completed: tuple[str, ...] = ()
        constraint = self.compiled.constraint if self.compiled is not None else None
        if self.partials and isinstance(constraint, JsonSchema):
            if self.typed is None:
                self.typed = PartialJson(constraint.python_type)
            completed = self.typed.feed(text, final=self.finish_reason is not None)  # finish() sets it first
            partial, value = _partial(self.compiled, self.text), self.typed.value
        if text or token_ids or completed:
            self.on_event(StreamEvent(text, token_ids, partial, value=value, completed=completed))

    @property
    def thinks(self) -> bool:
        """Whether the request is still thinking (the constraint does not apply yet)."""
        return self.thinking is not None and self.thinking.open

    @property
    def answer_tokens(self) -> int:
        return len(self.output_ids) - self.answer_start

    def _emit_reasoning(self, delta: str, token_ids: list[int]) -> None:
        if self.on_event is not None and (delta or token_ids):
            self.on_event(StreamEvent(delta, token_ids, part="reasoning"))

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.finish_reason, self.error = reason, error
        if reason == "stop" and self.stop_hit:
            self._emit("", [])  # the text is final (a trailing number completes)
            return
        if self.thinking is not None and self.thinking.open:  # ended while thinking: the rest is thinking
            self._emit_reasoning(self.thinking.flush(self.detok.finish()), [])
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
        if self.thinks:
            return self._think(token)
        if self.budget is not None:
            vetted = self.budget.vet(token, self.max_tokens - self.answer_tokens)
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
        if self.guard is not None:
            self.generated = (self.generated + piece)[-GUARD_WINDOW:]
        if self.mask_filter is not None:
            self.mask_filter.feed(piece)
        update = self.stop.feed(piece)
        self._emit(update.text, [token])
        if update.stopped:
            self.stop_hit = True
            self.finish("stop")
        elif self.matcher is not None and self.matcher.is_completed() and not self.matcher.can_continue():
            self.finish("stop")
        elif self.answer_tokens >= self.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= self.context_limit:
            self.finish("length")
        return self.finish_reason is not None

    def _think(self, token: int) -> bool:
        """Take a token of the thinking; at the end tag, the answer starts (with the text after it)."""
        assert self.thinking is not None
        self.output_ids.append(token)
        delta, answer = self.thinking.feed(token, self.detok.add(token))
        self._emit_reasoning(delta, [token])
        if answer is not None:
            self.answer_start = len(self.output_ids)
            if answer and self.matcher is not None and not self.matcher.accept_string(answer):
                self.finish("error", f"the grammar rejected {answer!r}, written after the end of the thinking")
                return True
            if answer:
                self.generated = answer[-GUARD_WINDOW:]
                if self.mask_filter is not None:
                    self.mask_filter.feed(answer)
                update = self.stop.feed(answer)
                self._emit(update.text, [])
                if update.stopped:
                    self.stop_hit = True
                    self.finish("stop")
                    return True
        if len(self.prompt_ids) + len(self.output_ids) >= self.context_limit:
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
        violations, value = check_output(self.compiled, self.text)
        if self.finish_reason == "error" and not violations:
            violations = [self.error or "generation failed"]
        dead_ends = self.matcher.dead_ends if self.matcher is not None else []
        if violations and dead_ends:
            violations.append(
                f"no valid continuation existed at output token {dead_ends[0]}: every token the grammar allowed "
                "there completed a value the schema forbids (constrain.match.values)"
            )
        asked = self.params.logprobs is not None
        return GenerationResult(
            text=self.text,
            value=value,
            finish_reason=self.finish_reason,
            token_ids=list(self.output_ids),
            usage=Usage(
                len(self.prompt_ids),
                len(self.output_ids),
                self.answer_start if not self.thinks else len(self.output_ids),
            ),
            violations=violations,
            logprobs=self.logprobs if asked else None,
            top_logprobs=self.top_logprobs if asked and self.params.logprobs else None,
            error=self.error,
            closed_early=forced > 0,
            forced_tokens=forced + (self.budget.steered if self.budget is not None else 0),
            guard_steps=self.guard.steps if self.guard is not None else 0,
            reasoning=self.thinking.text if self.thinking is not None else None,
        )


def _partial(compiled: CompiledConstraint | None, text: str) -> Any:
    if compiled is None or not isinstance(compiled.constraint, JsonSchema) or not text.strip():
        return None
    from pydantic_core import from_json

    try:
        return from_json(text, allow_partial=True)
    except ValueError:
        return None


def check_output(compiled: CompiledConstraint | None, text: str) -> tuple[list[str], Any]:
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
    active: list[InFlight],
    drafts: list[list[int]],
    vocab: int,
    decode: Callable[[list[int]], str],
) -> tuple[list[int], torch.Tensor | None]:  # (constrained slots, [c, ceil(V / 32)] int32 on the CPU)
    """The bitmasks of every constrained slot: slot ``(i, j)`` is row ``i`` after its first ``j`` drafts
    (slots numbered row by row), repetition guard and mask filter applied; a thinking row's mask is its
    :class:`~constrain.decode.reasoning.Thinking`'s. Changes no matcher (drafts go to forks)."""
    matchers: list[tuple[int, Matcher]] = []  # (mask row, the matcher at that slot)
    thinking: list[tuple[int, Thinking]] = []  # (mask row, the row's thinking)
    slots: list[int] = []
    guarded: list[tuple[int, RepetitionGuard, str]] = []  # (mask row, the row's guard, its recent text)
    filtered: list[tuple[int, MaskFilter, str]] = []  # (mask row, the row's filter, its drafts' text)
    slot = 0
    for i, r in enumerate(active):
        if r.thinking is not None and r.thinking.open:  # (no drafts while thinking)
            thinking.append((len(slots), r.thinking))
            slots.append(slot)
            slot += 1
            continue
        state = r.matcher
        for j in range(len(drafts[i]) + 1):
            if state is not None:
                if j:
                    state = state.fork()
                    state.accept_token(drafts[i][j - 1])
                if r.guard is not None:
                    guarded.append((len(slots), r.guard, r.generated + decode(drafts[i][:j]) if j else r.generated))
                if r.mask_filter is not None:
                    filtered.append((len(slots), r.mask_filter, decode(drafts[i][:j]) if j else ""))
                matchers.append((len(slots), state))
                slots.append(slot)
            slot += 1
    if not slots:
        return slots, None
    bitmask = allocate_token_bitmask(len(slots), vocab)
    if matchers and not thinking:
        fill_next_token_bitmasks([m for _, m in matchers], bitmask)
    elif matchers:
        filled = allocate_token_bitmask(len(matchers), vocab)  # [m, ceil(V / 32)]
        fill_next_token_bitmasks([m for _, m in matchers], filled)
        bitmask[[k for k, _ in matchers]] = filled
    for k, thought in thinking:
        thought.fill(bitmask[k])
    by_row = dict(matchers)
    for k, guard, text in guarded:
        guard.apply(text, bitmask[k])
    for k, mask_filter, text in filtered:
        mask_filter.apply(by_row[k], text, bitmask[k])
    return slots, bitmask


def _drafts(r: InFlight, encode: Callable[[str], list[int]], proposer: Proposer | None) -> tuple[list[int], bool]:
    """Drafts for ``r``'s next forward pass, and whether they are forced: the grammar's forced text
    (jump-forward), else the ``proposer``'s guess (speculative decoding); pruned to what the grammar
    accepts."""
    room = min(MAX_DRAFT, r.max_tokens - r.answer_tokens - 1)
    if r.finish_reason is not None or room <= 0 or r.thinks:
        return [], False
    forced = r.matcher.forced_text() if r.matcher is not None else ""
    if forced:
        ids = encode(forced)[:room]
    elif proposer is not None:
        ids = proposer.propose(r.prompt_ids, r.output_ids, room, r.matcher.fork() if r.matcher is not None else None)
    else:
        return [], False
    if r.matcher is not None:
        ids = ids[: r.matcher.fork().accept_tokens(ids)]
    return ids, bool(forced)


def resolve_proposer(handle: ModelHandle, speculative: bool | Proposer) -> Proposer | None:
    """The draft proposer ``speculative`` names; ``ValueError`` for a draft model of another vocabulary."""
    if isinstance(speculative, bool):
        return NgramProposer() if speculative else None
    if isinstance(speculative, DraftModelProposer):
        speculative.check_vocabulary(handle)
    return speculative


class DecodeLoop:
    """A running batch of :class:`InFlight` requests, advanced one forward pass per :meth:`step`.

    Not thread-safe: one thread owns the loop (a server's engine thread hands it requests between
    steps). Requests added with :meth:`add` join at the next step; finished and cancelled ones leave
    the batch and the cache at once. With a cache that cannot be merged (sliding-window layers, as in
    Gemma 3), new requests wait until the running batch has drained.

    ``jump_forward``: after each token, the text the grammar forces next (``{"name": "``, a closing
    quote) is tokenized and fed in the same forward pass as drafts; the sampler then runs at every
    draft position exactly as plain decoding would (same masks, history and seeded draws), and a
    draft counts only when the sampled token equals it. The output is therefore that of plain
    decoding, token for token (up to the last bits of the logits, which differ between a one-token
    and a many-token forward pass and could flip an exact tie), while one forward pass covers the
    forced stretch. Rejected drafts stay in the KV cache, masked out of attention.

    ``speculative``: where nothing is forced, draft with a :class:`~constrain.decode.speculative.Proposer`
    (``True``, the default: :class:`~constrain.decode.speculative.NgramProposer`, prompt lookup), pruned by
    the grammar, verified the same way. Drafts are deterministic, so "accept while the sampled token
    equals the draft" accepts with the probability rejection sampling would (p of the draft) and emits
    exactly plain decoding's distribution (its very tokens, for seeded requests). Each step feeds only
    the drafts that pay (:func:`~constrain.decode.speculative.plan_drafts`), from each request's acceptance so
    far and ``forward_cost`` (default: measured on first use, :func:`~constrain.models.cost.forward_cost`).

    ``overlap``: fill the grammar masks on a worker thread while the forward pass runs (xgrammar and
    llguidance release the GIL), so that the mask costs nothing on the critical path. Default: when
    the model is not on the CPU; on the CPU the thread competes with the forward for the same cores
    (measured with SmolLM2 on 2 cores, batch 8: the mask wait fell from 0.65 to 0.02 ms a step and the
    forward rose by 1.6 ms).

    ``timings`` collects seconds per stage (forward, mask, sampler, stop+detokenize).
    """

    def __init__(
        self,
        handle: ModelHandle,
        timings: dict[str, float] | None = None,
        *,
        overlap: bool | None = None,
        jump_forward: bool = True,
        speculative: bool | Proposer = True,
        forward_cost: cost.ForwardCost | None = None,
    ) -> None:
        self.handle = handle
        self.clock = _Clock(timings)
        self.proposer = resolve_proposer(handle, speculative)
        self.forward_cost = forward_cost
        self.jump_forward = jump_forward
        self.device = next(handle.model.parameters()).device
        self.overlap = self.device.type != "cpu" if overlap is None else overlap
        tokenizer = handle.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else handle.eos_token_ids[0]
        self.sampler = Sampler()
        forward_args = inspect.signature(handle.model.forward).parameters
        # a prompt's logits are needed at its last position only ([B, T, V] would dominate the prefill)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._cache_keyword = cost.cache_keyword(handle.model)
        self.prefixes = PrefixCache()
        self.active: list[InFlight] = []  # the rows of the cache, in order
        self.joining: list[InFlight] = []
        self._drafts: list[list[int]] = []  # per active row: the drafts fed after its last token
        self._proposed: list[int] = []  # per active row: how many of its drafts came from the proposer
        self._cache: Any = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [b, T]: 0 = padding or rejected draft
        self._input_ids = self._mask  # [b, width]: each row's last token and drafts, for the next forward
        self._positions = self._mask  # [b, width]

    def encode(self, text: str) -> list[int]:
        return list(self.handle.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.handle.tokenizer.decode(ids))

    @property
    def busy(self) -> bool:
        return bool(self.active or self.joining)

    def add(self, requests: Sequence[InFlight]) -> None:
        """Queue ``requests`` to join the batch at the next step (their acceptance starts at the
        proposer's prior)."""
        if self.proposer is not None:
            for r in requests:
                r.acceptance = Acceptance(prior=self.proposer.acceptance_prior)
        self.joining.extend(requests)

    def cancel(self, request: InFlight) -> None:
        """End ``request`` now (``finish_reason="cancelled"``); it leaves the batch at the next step."""
        if request.finish_reason is None:
            request.finish("cancelled")
        if request in self.joining:
            self.joining.remove(request)

    def step(self) -> None:
        """One forward pass for the running rows and the prefill of the joining ones, then the masks,
        one sampler call, stop criteria and detokenization for every row."""
        running = [i for i, r in enumerate(self.active) if r.finish_reason is None]
        if len(running) < len(self.active):  # cancelled rows leave, with their prepared inputs
            index = torch.tensor(running, device=self.device, dtype=torch.long)
            self._input_ids, self._positions = self._input_ids[index], self._positions[index]
            self._select(running)
        joining: list[InFlight] = []
        plan: list[tuple[list[InFlight], int]] = []
        if self.joining and (not self.active or _mergeable(self._cache)):
            plan = self._prefill_plan([r for r in self.joining if r.finish_reason is None])
            joining, self.joining = [r for group, _ in plan for r in group], []
        rows, drafts = self.active + joining, self._drafts + [[] for _ in joining]
        if not rows:
            return
        vocab, device = self.handle.vocab_size, self.device
        with torch.inference_mode():
            # the masks depend only on the tokens so far: fill them beside the forward pass
            pending = _mask_pool.submit(_masks, rows, drafts, vocab, self.decode) if self.overlap else None
            with self.clock("forward"):
                logits = self._forward(plan)  # [P, V]: every slot's next-token logits
            with self.clock("mask"):  # with overlap: what is left of the fill once the forward is done
                slots, bitmask = pending.result() if pending is not None else _masks(rows, drafts, vocab, self.decode)
                if bitmask is not None:
                    bitmask = bitmask.to(device)
            with self.clock("sampler"):
                histories = [(rows[i], drafts[i][:j]) for i, d in enumerate(drafts) for j in range(len(d) + 1)]
                sampled = _sample(self.sampler, histories, logits, vocab, device, bitmask, slots)
                tokens = sampled.token_ids.tolist()
            with self.clock("stop+detokenize"):
                keep = self._advance(tokens, sampled.logprobs)
            self._select(keep)
            if self.active:
                self._next_inputs()

    def _prefill_plan(self, joining: list[InFlight]) -> list[tuple[list[InFlight], int]]:
        """How to prefill ``joining``: (group, cached prefix length). A request whose prompt starts with
        :data:`MIN_PREFIX` or more tokens of a prompt prefilled before is prefilled alone, after that
        prefix (its KV copied from the :class:`PrefixCache`); the others by prompt length, in groups of
        similar lengths (see :func:`_prefill_groups`)."""
        hits = [(r, self.prefixes.match(r.prompt_ids)) for r in joining]
        rest = sorted((r for r, n in hits if n == 0), key=lambda r: len(r.prompt_ids))
        return [([r], n) for r, n in hits if n] + [(group, 0) for group in _prefill_groups(rest)]

    def _forward(self, plan: list[tuple[list[InFlight], int]]) -> torch.Tensor:  # [P, V]
        """Run the running rows' step and the joining rows' prefill; merge the joiners into the batch."""
        model, parts = self.handle.model, []
        if self.active:
            slots = None  # every position is a slot (no row is padded) unless drafts differ in length
            if sum(len(d) + 1 for d in self._drafts) < self._input_ids.numel():
                slot_row = [i for i, d in enumerate(self._drafts) for _ in range(len(d) + 1)]
                slot_col = [j for d in self._drafts for j in range(len(d) + 1)]
                slots = (torch.tensor(slot_row, device=self.device), torch.tensor(slot_col, device=self.device))
            with _project_only(model, slots) as projected:
                out = model(input_ids=self._input_ids, attention_mask=self._mask, position_ids=self._positions,
                            use_cache=True, **{self._cache_keyword: self._cache})  # fmt: skip
            self._cache = getattr(out, self._cache_keyword)
            if projected:
                parts.append(out.logits[0])  # [P_running, V]
            else:
                parts.append(out.logits.flatten(0, 1) if slots is None else out.logits[slots])  # [P_running, V]
        for group, cached in plan:
            width = max(len(r.prompt_ids) for r in group)
            ids = [[self.pad] * (width - len(r.prompt_ids)) + r.prompt_ids[cached:] for r in group]
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group],
                                device=self.device)  # fmt: skip  # [g, width]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]  # [g, width - cached]: padding shifts none
            past = self.prefixes.cache(group[0].prompt_ids, cached) if cached else None
            out = model(input_ids=torch.tensor(ids, device=self.device), attention_mask=mask, position_ids=positions,
                        use_cache=True, **{self._cache_keyword: past}, **self._last_only)  # fmt: skip
            parts.append(out.logits[:, -1])  # [g, V]
            cache = getattr(out, self._cache_keyword)
            if _mergeable(cache):
                self.prefixes.add([r.prompt_ids for r in group], cache)
            if self.active:
                self._mask = _merge(self._cache, self._mask, cache, mask)
            else:
                self._cache, self._mask = cache, mask
            self.active, self._drafts = self.active + group, self._drafts + [[] for _ in group]
            self._proposed += [0] * len(group)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _advance(self, tokens: list[int], logprobs: Any) -> list[int]:
        """Feed each row its sampled tokens (the first, then each one that confirms its draft); mask out
        of attention the drafts that did not happen. Returns the rows still running."""
        keep, rejected = [], []  # rejected: (row, first block column whose draft is not kept)
        slot = 0
        for i, r in enumerate(self.active):
            finished, confirmed, drafts = False, len(self._drafts[i]), self._drafts[i]
            for j in range(len(drafts) + 1):
                token = tokens[slot + j]
                if r.params.logprobs is not None and logprobs is not None and token >= 0:
                    r.record_logprobs(logprobs, slot + j)
                finished = r.step(token)
                if finished or j == len(drafts):
                    break
                if token != drafts[j] or r.output_ids[-1] != token:
                    confirmed = j  # drafts j+1.. were computed on a history that did not happen
                    break
            slot += len(drafts) + 1
            if not finished:
                keep.append(i)
                r.acceptance.observe(self._proposed[i], min(confirmed, self._proposed[i]))
                if confirmed < len(drafts):
                    rejected.append((i, confirmed + 1))
        width = 1 + max((len(d) for d in self._drafts), default=0)
        for i, first in rejected:
            self._mask[i, self._mask.shape[1] - width + first :] = 0
        return keep

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch and its cache."""
        if len(keep) == len(self.active):
            return
        if keep:
            index = torch.tensor(keep, device=self.device)
            self._cache.batch_select_indices(index)
            self._mask = self._mask[index]
        else:
            self._cache, self._mask = None, self._mask[:0, :0]
        self.active = [self.active[i] for i in keep]
        self._drafts = [self._drafts[i] for i in keep]
        self._proposed = [self._proposed[i] for i in keep]

    def _next_inputs(self) -> None:
        """Each row's last token and its drafts for the next forward pass: forced tokens, and the
        proposer's drafts that pay (:func:`~constrain.decode.speculative.plan_drafts`)."""
        drafts = [_drafts(r, self.encode, self.proposer) if self.jump_forward else ([], False) for r in self.active]
        forced = [len(d) if is_forced else 0 for d, is_forced in drafts]
        offered = [0 if is_forced else len(d) for d, is_forced in drafts]
        relative = functools.partial(self._relative_cost, len(self.active))
        self._proposed = plan_drafts(forced, offered, [r.acceptance.rate for r in self.active], relative)
        self._drafts = [d[: f + n] for (d, _), f, n in zip(drafts, forced, self._proposed, strict=True)]
        width = 1 + max(len(d) for d in self._drafts)
        self._input_ids = torch.tensor(  # [b, width]: the last token, its drafts, padding
            [[r.output_ids[-1], *d] + [self.pad] * (width - 1 - len(d)) for r, d in zip(self.active, self._drafts,
                                                                                          strict=True)],
            device=self.device,
        )  # fmt: skip
        block = self._mask.new_tensor([[1] * (1 + len(d)) + [0] * (width - 1 - len(d)) for d in self._drafts])
        self._positions = self._mask.sum(-1, keepdim=True) + torch.arange(width, device=self.device)  # [b, width]
        self._mask = torch.cat([self._mask, block], dim=1)  # [b, T + width]

    def _relative_cost(self, batch: int, width: int) -> float:
        """A pass of ``batch`` rows ``width`` tokens wide against one token per row (measures the
        model's :class:`~constrain.models.cost.ForwardCost` on first use, unless one was given)."""
        if self.forward_cost is None:
            self.forward_cost = cost.forward_cost(self.handle.model)
        return self.forward_cost.relative(batch, width)


@contextlib.contextmanager
def _project_only(
    model: Any,
    # ([P] long, [P] long): the (row, column) of each slot whose logits are needed, or None for all
    slots: tuple[torch.Tensor, torch.Tensor] | None,
) -> Iterator[bool]:
    """Within the block, the model's output layer sees only the hidden states of ``slots`` (its logits
    come out as ``[1, P, V]``), so that padding in a block of drafts costs no vocabulary projection.
    Yields whether it applies (a model without an output-embedding module computes every position).
    Only this thread's forward passes are changed (a server's beam search runs the model beside the loop)."""
    head = model.get_output_embeddings() if slots is not None else None
    if head is None:
        yield False
        return
    owner = threading.get_ident()

    def gather(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if threading.get_ident() != owner:
            return None
        hidden = args[0]  # [B, T, H]
        return (hidden[slots].unsqueeze(0), *args[1:])  # [1, P, H]

    hook = head.register_forward_pre_hook(gather)
    try:
        yield True
    finally:
        hook.remove()


MIN_PREFIX = 16
"""Shortest shared prompt prefix (tokens) worth prefilling from the :class:`PrefixCache`."""


class PrefixCache:
    """The KV cache of recently prefilled prompts, so that a prompt sharing a prefix with one of them
    (the chat template's system prompt, a tool list, a few-shot preamble) is prefilled from there.

    Keeps whole prompts (least recently used dropped past ``max_tokens`` tokens in all), matched by
    longest common prefix; only for caches of full-attention layers (see :func:`_mergeable`).
    Keys already carry their rotary positions, which a prompt sharing the prefix shares too.
    """

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._tokens = 0

    def match(self, prompt: Sequence[int]) -> int:
        """Length of the longest prefix of ``prompt`` cached (0 below :data:`MIN_PREFIX`), at most all
        tokens but the last (whose logits the prefill must compute)."""
        head, best = tuple(prompt[: len(prompt) - 1]), 0
        for key in self._entries:
            low, high = MIN_PREFIX, min(len(key), len(head))  # the common length, by bisection on slices
            if high < low or key[:low] != head[:low]:
                continue
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if key[:mid] == head[:mid] else (low, mid - 1)
            best = max(best, low)
        return best if best >= MIN_PREFIX else 0

    def cache(self, prompt: Sequence[int], length: int) -> Any:
        """A fresh ``DynamicCache`` holding the KV of ``prompt[:length]`` (which :meth:`match` found)."""
        from transformers import DynamicCache

        head = tuple(prompt[:length])
        key = next(k for k in self._entries if k[:length] == head)
        self._entries.move_to_end(key)
        out = DynamicCache()
        for layer, (keys, values) in enumerate(self._entries[key]):
            out.update(keys[:, :, :length], values[:, :, :length], layer)  # views: the forward appends by copy
        return out

    def add(self, prompts: list[list[int]], cache: Any) -> None:
        """Keep the KV of each of ``prompts``, the rows of ``cache`` (left-padded to the longest)."""
        width = max(len(p) for p in prompts)
        for row, prompt in enumerate(prompts):
            key = tuple(prompt)
            if key in self._entries or len(prompt) > self.max_tokens:
                continue
            start = width - len(prompt)
            self._entries[key] = [
                (layer.keys[row : row + 1, :, start:].clone(), layer.values[row : row + 1, :, start:].clone())
                for layer in cache.layers
            ]  # [1, heads, len(prompt), head_dim] each
            self._tokens += len(prompt)
        while self._tokens > self.max_tokens:
            key, _ = self._entries.popitem(last=False)
            self._tokens -= len(key)


PREFILL_PADDING = 0.25
"""A prefill group's longest prompt exceeds its shortest by at most this share (plus 8 tokens)."""


def _prefill_groups(joining: list[InFlight]) -> list[list[InFlight]]:
    """``joining`` (sorted by prompt length) cut into runs of similar lengths, each prefilled in one
    forward pass: padding a 40-token prompt to a 200-token neighbour would cost 5x its compute, and on
    a compute-bound device one pass per group costs about what one padded pass would."""
    groups: list[list[InFlight]] = []
    for r in joining:
        if groups and len(r.prompt_ids) <= len(groups[-1][0].prompt_ids) * (1 + PREFILL_PADDING) + 8:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _mergeable(cache: Any) -> bool:
    """Whether rows can join ``cache``: every layer a plain (full attention) dynamic layer."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def _merge(
    cache: Any,
    # [b, T] long: the running rows' attention mask, as long as ``cache``
    mask: torch.Tensor,
    joining: Any,
    # [n, T'] long: the joining rows' attention mask, as long as ``joining``
    joining_mask: torch.Tensor,
) -> torch.Tensor:  # [b + n, max(T, T')]
    """Append ``joining``'s rows to ``cache`` (mutated), left-padding the shorter side; returns the
    merged attention mask. Keys already carry their rotary positions, so padding shifts nothing."""
    width = max(mask.shape[1], joining_mask.shape[1])

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if not missing:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    for layer, new in zip(cache.layers, joining.layers, strict=True):
        layer.keys = torch.cat([pad(layer.keys, 2), pad(new.keys, 2)])  # [b + n, heads, width, head_dim]
        layer.values = torch.cat([pad(layer.values, 2), pad(new.values, 2)])
    return torch.cat([pad(mask, 1), pad(joining_mask, 1)])


def run(
    handle: ModelHandle,
    requests: list[InFlight],
    timings: dict[str, float] | None = None,
    *,
    overlap: bool | None = None,
    jump_forward: bool = True,
    speculative: bool | Proposer = True,
    forward_cost: cost.ForwardCost | None = None,
    cancelled: threading.Event | None = None,
) -> None:
    """Decode every request to its end, as one batch (see :class:`DecodeLoop` for the options); once
    ``cancelled`` is set (from any thread), the requests still running end as ``"cancelled"``."""
    loop = DecodeLoop(handle, timings, overlap=overlap, jump_forward=jump_forward, speculative=speculative,
                      forward_cost=forward_cost)  # fmt: skip
    loop.add(requests)
    while loop.busy:
        if cancelled is not None and cancelled.is_set():
            for r in requests:
                loop.cancel(r)
        loop.step()


def _sample(
    sampler: Sampler,
    histories: list[tuple[InFlight, list[int]]],
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
        output_token_ids=[r.output_ids + extra for r, extra in histories] if penalized else None,
        output_lengths=None if penalized else [len(r.output_ids) + len(extra) for r, extra in histories],
        token_bitmask=bitmask,
        bitmask_rows=rows if rows else None,
    )
    return sampler(logits, metadata)
