"""A finished reply as a chat answer: a generation's result joined with the parse of its text.

:func:`assistant_reply` is written once for every caller: :func:`constrain.chat` returns its fields
(with the generation) as a ``ChatResult``, and the server writes them into a chat completion's
choice (:mod:`constrain.serving.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from constrain.results import FinishReason, GenerationResult
from constrain.tools.parser import ENDED_INSIDE_CALLS, ParsedReply, ToolCall

__all__ = ["AssistantReply", "assistant_reply", "finish_reason"]


@dataclass(frozen=True, slots=True)
class AssistantReply:
    """What a reply says: ``content`` (its free text, "" when none; the whole text when it was not
    parsed), ``tool_calls``, OpenAI's ``finish_reason`` (:func:`finish_reason`), and ``violations``
    (the generation's, then the parse's that it does not hold already)."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason | Literal["tool_calls"]
    violations: list[str]


def finish_reason(result: GenerationResult, reply: ParsedReply | None) -> FinishReason | Literal["tool_calls"]:
    """OpenAI's finish reason of a reply: ``"tool_calls"`` when it ended by itself with calls, each whole
    (a stop string met inside a call ends it ``"stop"``, with the violations saying what is missing)."""
    if (
        reply is not None
        and reply.tool_calls
        and result.finish_reason == "stop"
        and ENDED_INSIDE_CALLS not in reply.violations
    ):
        return "tool_calls"
    return result.finish_reason


def assistant_reply(result: GenerationResult, parsed: ParsedReply | None) -> AssistantReply:
    """The reply of ``result``, whose text ``parsed`` is (None: no tool could be called, the text is the
    content). Pure: the lists are fresh, except ``tool_calls``, which is ``parsed``'s."""
    if parsed is None:
        return AssistantReply(result.text, [], result.finish_reason, list(result.violations))
    violations = list(result.violations)
    violations += [v for v in parsed.violations if v not in result.violations]
    return AssistantReply(parsed.content, parsed.tool_calls, finish_reason(result, parsed), violations)
