"""What generation returns: typed results and stream events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Beam", "FinishReason", "GenerationResult", "Part", "StreamEvent", "Usage"]

Part = Literal["reasoning", "answer"]
"""The part of the output a stream delta belongs to: the thinking (with ``reasoning=``) or the answer."""

FinishReason = Literal["stop", "length", "error", "cancelled"]
"""``stop``: EOS, a stop string or regex, or a complete grammar; ``length``: ``max_tokens`` or the
context window; ``error``: the grammar allowed no token (a dead end), see ``GenerationResult.error``;
``cancelled``: the caller gave up on the request (a server's client disconnected)."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # every generated token, the reasoning's included
    reasoning_tokens: int = 0  # of which the reasoning's (its tags included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Beam:
    """One finished beam of a beam search (``num_beams``): complete and valid."""

    text: str
    value: Any
    token_ids: list[int]
    logprob: float  # the sum of its tokens' log-probabilities, each renormalised over the grammar's mask
    score: float  # ``logprob / max(length, 1) ** length_penalty``, length: its text's tokens (constrain.decode.beams)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One finished completion.

    ``value`` is the validated object for ``schema=`` (a Pydantic instance for a
    model class, the Python value for a JSON Schema or a type), the text for
    ``regex``/``choices``/``grammar``, and None when the output violates the
    constraint: ``violations`` then says why (post-validation never passes a
    violation silently).
    """

    text: str
    value: Any
    finish_reason: FinishReason
    token_ids: list[int]
    usage: Usage
    violations: list[str] = field(default_factory=list)
    # the sampled tokens' logprobs, when asked (NaN: a token the budget put in place of the drawn one, out of the top N)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None  # per token: id -> logprob, when asked
    error: str | None = None  # why finish_reason is "error"
    closed_early: bool = False  # the budget's closing path ended it (finish_reason "length"; still valid)
    forced_tokens: int = 0  # tokens the budget took instead of the sampled ones (closing, or steering: see Budget)
    guard_steps: int = 0  # steps at which the repetition guard forbade another repeat
    reasoning: str | None = None  # with reasoning=: the thinking text, tags excluded (``text`` is the answer)
    beams: list[Beam] | None = None  # with num_beams > 1: every finished beam, best first (this result is the best)

    @property
    def valid(self) -> bool:
        """True when the output satisfies the whole constraint (always for free text)."""
        return not self.violations and self.finish_reason != "error"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """Text produced by one step of a stream. The answer's deltas concatenate exactly to the final
    ``text``, the reasoning's to ``reasoning``."""

    delta: str
    token_ids: list[int]
    partial: Any = None  # with schema=: the JSON value parsed so far (incomplete strings and all)
    part: Part = "answer"  # which part ``delta`` belongs to
    # with schema=: the value so far, complete values only (a Pydantic model's: an instance, its complete
    # fields validated and the rest None; see constrain.decode.partial); the whole validated value once complete
    value: Any = None
    completed: tuple[str, ...] = ()  # with schema=: JSON pointers of the values this step completed, innermost first
    # with logprobs=: per token of ``token_ids``, its logprob and the top alternatives ({token id: logprob})
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
