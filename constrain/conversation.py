"""What users call to chat with tools: ``chat``, one reply that may call them, over :func:`constrain.generate`.

Each step is :mod:`constrain.tools`' own: describe the request
(:func:`~constrain.tools.calling.tool_calling`), render its prompt, generate under its grammar, parse
the text, and join the parse with the result (:func:`~constrain.tools.reply.assistant_reply`, which
the server uses too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from typing_extensions import Unpack

from constrain.generation import ChatOptions, check_options, generate
from constrain.models.loading import model_handle
from constrain.results import FinishReason, GenerationResult
from constrain.tools.calling import ToolChoice, tool_calling
from constrain.tools.formats import ToolFormat
from constrain.tools.parser import ToolCall
from constrain.tools.reply import assistant_reply

__all__ = ["ChatResult", "chat"]

GENERATE_CONSTRAINTS = ("schema", "regex", "grammar", "choices", "constraint", "n")
""":func:`constrain.generate` options that :func:`chat` refuses: it builds the constraint and makes one reply."""


@dataclass(frozen=True, slots=True)
class ChatResult:
    """A reply to a chat with tools: ``content`` (free text, "" when none), ``tool_calls``, and every
    violation (the generation's, then the parse's). ``finish_reason`` is "tool_calls" when the reply
    ended after calls, else the generation's; ``generation`` is the underlying result."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason | Literal["tool_calls"]
    violations: list[str]
    generation: GenerationResult

    @property
    def valid(self) -> bool:
        return not self.violations and self.finish_reason != "error"


def chat(
    model: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[Any] = (),
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    tool_format: str | ToolFormat | None = None,
    **options: Unpack[ChatOptions],
) -> ChatResult:
    """One chat reply that may call ``tools``: render the prompt, generate under the tools' grammar, parse.

    Parameters
    ----------
    model : ModelHandle, or anything ``load_model`` takes (None: the default model)
    messages : OpenAI chat messages (``tool`` results and assistant ``tool_calls`` included)
    tools, tool_choice, parallel_tool_calls : see :func:`~constrain.tools.calling.tool_calling`
    tool_format : format name or ToolFormat, default: None (the model family's,
        :func:`~constrain.tools.formats.tool_format`)
    **options : :func:`constrain.generate`'s options (:class:`~constrain.generation.ChatOptions`: ``max_tokens``,
        ``temperature``, ``seed``...), except the constraint and ``n`` (:data:`GENERATE_CONSTRAINTS`)

    Raises
    ------
    ToolError, ValueError
        Bad tools or arguments, before anything is generated.
    """
    given = sorted(set(options) & set(GENERATE_CONSTRAINTS))
    if given:
        raise ValueError(f"chat() builds the constraint from the tools and makes one reply: drop {', '.join(given)}")
    check_options("chat", options, ChatOptions.__annotations__)
    handle = model_handle(model)
    spec = tool_calling(
        tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, format=tool_format or handle.name
    )
    generation = generate(handle, spec.prompt(handle, messages), constraint=spec.constraint(), **options)
    reply = assistant_reply(generation, spec.parse(generation.text))
    return ChatResult(reply.content, reply.tool_calls, reply.finish_reason, reply.violations, generation)
