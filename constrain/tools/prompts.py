"""The prompt of a chat with tools: the chat template's own rendering of them, else a system message.

:func:`render_prompt` is what :meth:`~constrain.tools.calling.ToolCalling.prompt` does: a chat
template that mentions ``tools`` renders them itself; otherwise :data:`FALLBACK_INSTRUCTIONS`
present them, and the conversation's earlier calls and their results are rewritten as text the
template can take.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from constrain.models.loading import ModelHandle
from constrain.tools.definitions import Tool
from constrain.tools.formats import ToolFormat

__all__ = ["FALLBACK_INSTRUCTIONS", "POLICIES", "render_prompt", "template_roles"]

FALLBACK_INSTRUCTIONS = """You can call the following tools; a tool's "parameters" is the JSON Schema of its arguments.
<tools>
{tools}
</tools>
{policy}
Tool calls end the reply and are written exactly like this:
{example}"""
"""The system message that presents the tools when the chat template does not take ``tools``
(appended to the conversation's own system message if it has one). ``policy`` says what
``tool_choice`` asks (:data:`POLICIES`); ``example`` spells one call (two with
``parallel_tool_calls``) in the format."""

POLICIES = {
    "none": "Do not call any tool now: answer in plain text.",
    "auto": "Call tools when they help to answer; otherwise answer in plain text.",
    "required": "You must call at least one tool.",
}
"""The ``policy`` line of :data:`FALLBACK_INSTRUCTIONS` per ``tool_choice`` mode (a named tool gets
"You must call the tool 'name'.")."""


def render_prompt(
    model: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[Tool],
    choice: str,
    multiple: bool,
    format: ToolFormat,
) -> str:
    """The prompt text for ``messages`` with ``tools``, ending with the assistant's generation prompt,
    as :func:`constrain.generate` takes it.

    Parameters
    ----------
    model : ModelHandle or a tokenizer (with a chat template)
    messages : OpenAI chat messages (``tool`` results and assistant ``tool_calls`` included)
    tools : every tool of the request (presented even where ``choice`` is "none")
    choice, multiple, format : the request's ``tool_choice``, whether a reply may hold several calls,
        and how calls are written (see :class:`~constrain.tools.calling.ToolCalling`)

    A chat template that mentions ``tools`` renders them itself, and gets ``messages`` unchanged.
    Otherwise :data:`FALLBACK_INSTRUCTIONS` join the system message; assistant messages with
    OpenAI ``tool_calls`` are rendered in the format, and ``tool`` messages become user messages
    ``<tool_response>\\n...\\n</tool_response>``. A BOS the template writes is dropped when
    encoding the text adds it again. Does not mutate ``messages``.

    Raises
    ------
    ValueError
        The tokenizer has no chat template, or a message is malformed.
    """
    tokenizer = model.tokenizer if isinstance(model, ModelHandle) else model
    text = _render(tokenizer, messages, tools, choice, multiple, format)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.bos_token_id]:
        return text[len(bos) :]
    return text


def template_roles(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as ``tokenizer``'s chat template takes them: a ``developer`` message (OpenAI's system message
    for its reasoning models) becomes a system message where the template has no ``developer`` role. A new list;
    ``messages`` is not mutated."""
    if "developer" in str(getattr(tokenizer, "chat_template", None) or ""):
        return list(messages)
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Tool],
    choice: str,
    multiple: bool,
    format: ToolFormat,
) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        raise ValueError("the tokenizer has no chat template: write the prompt as text (see FALLBACK_INSTRUCTIONS)")
    definitions = [t.definition() for t in tools]
    messages = template_roles(tokenizer, messages)
    if "tools" in template:
        text = tokenizer.apply_chat_template(
            list(messages), tools=definitions or None, add_generation_prompt=True, tokenize=False
        )
        return str(text)
    converted = [_fallback_message(m, format) for m in messages]
    if definitions:
        example = [("tool_name", '{"argument": "value"}'), ("other_tool", "{}")][: 2 if multiple else 1]
        instructions = FALLBACK_INSTRUCTIONS.format(
            tools=json.dumps(definitions, ensure_ascii=False),
            policy=POLICIES.get(choice, f"You must call the tool {choice!r}."),
            example=format.render(example),
        )
        if converted and converted[0].get("role") == "system":
            converted[0] = {**converted[0], "content": f"{converted[0].get('content') or ''}\n\n{instructions}"}
        else:
            converted.insert(0, {"role": "system", "content": instructions})
    return str(tokenizer.apply_chat_template(converted, add_generation_prompt=True, tokenize=False))


def _fallback_message(message: dict[str, Any], format: ToolFormat) -> dict[str, Any]:
    """``message`` as a template without tools takes it: tool results as user text, calls in ``format``."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError("messages are dicts with a 'role' and a 'content'")
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    try:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    except (KeyError, TypeError) as err:
        raise ValueError("tool_calls are OpenAI's: [{'function': {'name': ..., 'arguments': ...}}]") from err
    rendered = format.render([(n, a if isinstance(a, str) else json.dumps(a)) for n, a in calls])
    return {"role": "assistant", "content": (message.get("content") or "") + rendered}
