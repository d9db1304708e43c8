"""One completion in flight: the per-request state machine a :class:`~constrain.decode.loop.DecodeLoop` advances.

An :class:`InFlight` is built by admission (:func:`constrain.generation.admit`), which calls its
:meth:`InFlight.start` (the matcher and the closing budget: :class:`~constrain.errors.BudgetError`
there, before any forward pass). Each sampled token then goes through :meth:`InFlight.step`
(closing budget, grammar, detokenizer, stop strings, events) until the request finishes, and
:meth:`InFlight.result` checks the finished text (:func:`check_output`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from constrain.compiler.compiler import CompiledConstraint
from constrain.constraints.constraint import JsonSchema
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.partial import PartialJson
from constrain.decode.reasoning import Thinking
from constrain.decode.speculative import Acceptance
from constrain.decode.stopping import StopText
from constrain.match.budget import Budget
from constrain.match.matcher import Matcher
from constrain.match.repetition import RepetitionGuard
from constrain.match.validate import parse_json
from constrain.results import FinishReason, GenerationResult, StreamEvent, Usage
from constrain.sampler import SamplingParams

__all__ = ["GUARD_WINDOW", "InFlight", "MaskFilter", "check_output"]

GUARD_WINDOW = 4096
"""Characters of recent output the repetition guard looks at (it needs ``copies x max_period``)."""


class MaskFilter(Protocol):
    """A constraint's own filter of one request's masks, applied after the grammar's (and the repetition
    guard's): a constraint offers one with a ``mask_filter(tokenizer_info)`` method, such as the
    grammar of a reply with tools (:class:`~constrain.tools.grammar.ToolGrammar`, which forbids repeating a call).
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
    """One completion in flight (compared by identity).

    Constructing one only stores its fields; :meth:`start` (admission) makes its grammar state. A
    :class:`~constrain.decode.loop.DecodeLoop` then mutates it step by step (``output_ids``, ``text``,
    ``finish_reason``...) and calls ``on_event``, on the thread that steps the loop.
    """

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
    group: int | None = None  # its loop's label of the requests a caller waits for together (speculative.shortening)
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
    fault: BaseException | None = None  # what ended it where its step failed (a bug, or a callback of its own)
    request_id: str = ""  # a caller's name for it, in logs (a server's response id)
    stop_hit: bool = False  # a stop string or regex ended it (its text is already cut)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has run (or there is nothing to start: no constraint)."""
        return self.compiled is None or self.matcher is not None

    def start(self) -> InFlight:
        """Admission: make the matcher, the closing budget (with ``encode``), the repetition guard (with
        ``repetition_guard``) and the constraint's own :class:`MaskFilter`. Returns ``self`` (mutated);
        a no-op once started.

        Raises
        ------
        BudgetError
            With ``encode``: no completion of the constraint fits in ``max_tokens`` (the closing
            search runs here, so a request that cannot finish fails before any forward pass).
        """
        if self.started:
            return self
        assert self.compiled is not None
        matcher = self.compiled.matcher()
        if self.encode is not None:
            self.budget = Budget(matcher, self.encode, self.max_tokens, initial=True)  # BudgetError: up front
        if self.repetition_guard:
            self.guard = RepetitionGuard(self.compiled.tokenizer)
        make_filter = getattr(self.compiled.constraint, "mask_filter", None)  # a tools grammar's
        if make_filter is not None:
            self.mask_filter = make_filter(self.compiled.tokenizer)
        self.matcher = matcher  # last: a request whose budget raised stays not started
        return self

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
            logprobs, top = self._scores(len(token_ids))
            self.on_event(StreamEvent(text, token_ids, partial, value=value, completed=completed,
                                      logprobs=logprobs, top_logprobs=top))  # fmt: skip

    def _scores(self, count: int) -> tuple[list[float] | None, list[dict[int, float]] | None]:
        """The logprobs and top alternatives of the last ``count`` tokens (None, None without logprobs=)."""
        if self.params.logprobs is None:
            return None, None
        n = len(self.output_ids)
        return self.logprobs[n - count : n], self.top_logprobs[n - count : n]

    @property
    def thinks(self) -> bool:
        """Whether the request is still thinking (the constraint does not apply yet)."""
        return self.thinking is not None and self.thinking.open

    @property
    def answer_tokens(self) -> int:
        """Output tokens of the answer (those after the thinking); ``max_tokens`` bounds these."""
        return len(self.output_ids) - self.answer_start

    def _emit_reasoning(self, delta: str, token_ids: list[int]) -> None:
        if self.on_event is not None and (delta or token_ids):
            logprobs, top = self._scores(len(token_ids))
            self.on_event(StreamEvent(delta, token_ids, part="reasoning", logprobs=logprobs, top_logprobs=top))

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End the request with ``reason``: flush the detokenizer and the text stop strings held back."""
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

    def fail(self, err: BaseException, stage: str) -> None:
        """End the request after ``err`` was raised in ``stage`` of its step: ``finish_reason="error"``,
        ``err`` kept in :attr:`fault`. Flushes what it can (as :meth:`finish`); never raises."""
        self.fault = err
        message = f"internal error while {stage} ({type(err).__name__}); the request ended, its batch went on"
        try:
            self.finish("error", message)
        except Exception:  # the detokenizer or a callback is what failed: end without flushing
            self.finish_reason, self.error = "error", message

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
                # the sampler's logprob was for the token it drew: the vetted one's where its top list holds it
                self.logprobs[-1] = self.top_logprobs[-1].get(vetted, math.nan) if self.top_logprobs else math.nan
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
            # the thinking took part of the context window: the answer's budget ends where the window does
            self.max_tokens = max(
                1, min(self.max_tokens, self.context_limit - len(self.prompt_ids) - self.answer_start)
            )
            if answer and self.matcher is not None and not self.matcher.accept_string(answer):
                self.finish("error", f"the grammar rejected {answer!r}, written after the end of the thinking")
                return True
            if answer and self.budget is not None and not self.budget.rebase(self.max_tokens):
                self.finish("error", f"no valid output fits in max_tokens={self.max_tokens} after {answer!r}")
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
        """Keep the sampled token's logprob and the top ones this request asked for, among the tokens the
        mask allowed: where fewer were allowed, fewer are kept (a masked token's logprob is -inf, no
        alternative, and no number JSON can carry)."""
        self.logprobs.append(float(logprobs.sampled[row]))
        top = zip(logprobs.top_token_ids[row].tolist(), logprobs.top_logprobs[row].tolist(), strict=True)
        self.top_logprobs.append({t: lp for t, lp in list(top)[: self.params.logprobs] if lp != -math.inf})

    def result(self) -> GenerationResult:
        """The finished request's result, its text checked against the constraint (:func:`check_output`)."""
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
    """The partial JSON value of ``text`` so far, for a JSON schema constraint (else None)."""
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
