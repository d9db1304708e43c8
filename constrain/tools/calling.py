"""The tools of one request and how a reply may call them: :func:`tool_calling` builds a :class:`ToolCalling`.

A request with tools is described once, by a frozen :class:`ToolCalling`; everything a caller
(:func:`constrain.chat`, a server) needs follows from it, each step in its own module:

1. ``prompt(model, messages)``: the prompt text, tools included: the chat template's own rendering
   when the template takes ``tools``, else a system message (:mod:`constrain.tools.prompts`);
2. ``constraint()``: the grammar of the reply, a :class:`~constrain.tools.grammar.ToolGrammar` (None
   for ``tool_choice="none"`` or no tools), passed to ``generate(..., constraint=...)``; where several
   calls may come, it also gives each request a mask filter that forbids repeating a call
   (:mod:`constrain.tools.repeats`);
3. ``parser()``: a :class:`~constrain.tools.parser.ToolCallParser` fed the text as it streams, giving
   OpenAI-style deltas (a call's name first, then its arguments' JSON text in chunks), or
   ``parse(text)`` at once; :func:`~constrain.tools.reply.assistant_reply` then joins the parse with
   the generation's result.

Every call is written ``{"name": "<tool>", "arguments": {...}}``; a
:class:`~constrain.tools.formats.ToolFormat` says what surrounds the calls of a reply, per model
family (:func:`~constrain.tools.formats.tool_format`). The tools themselves are
:class:`~constrain.tools.definitions.Tool` s (:mod:`constrain.tools.definitions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from constrain.errors import ToolError
from constrain.tools.definitions import MODES, Tool, tool
from constrain.tools.formats import ToolFormat, tool_format
from constrain.tools.grammar import ToolGrammar, reply_grammar
from constrain.tools.parser import ParsedReply, ToolCallParser
from constrain.tools.prompts import render_prompt

__all__ = ["ToolCalling", "ToolChoice", "tool_calling"]

ToolChoice = str | dict[str, Any]
"""``tool_choice`` as OpenAI takes it: a mode, ``{"type": "function", "function": {"name": ...}}``, or a tool name."""


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """The tools of one request and how they may be called; build it with :func:`tool_calling`.

    ``choice`` is "none", "auto", "required" or the name of the tool that must be called.
    """

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool
    format: ToolFormat

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools the reply may call: none for "none", the named one for a named choice."""
        if self.choice == "none":
            return ()
        if self.choice in MODES:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    @property
    def multiple(self) -> bool:
        """Whether a reply may hold more than one call: ``parallel`` with "auto" or "required". A named
        tool is called exactly once, whatever ``parallel`` says (as OpenAI and vLLM answer)."""
        return self.parallel and self.choice in MODES

    def constraint(self) -> ToolGrammar | None:
        """The grammar of the reply (cached, :func:`~constrain.tools.grammar.reply_grammar`), or None when
        no tool may be called.

        "auto": free text without the format's trigger, then optionally the calls, which end the
        reply; "required": the calls alone; a named tool: exactly one call of it. ``parallel``: one
        or more calls, else exactly one. Arguments follow each tool's schema as ``json_schema()``
        constraints do; the text around them is fixed by the format. Where several calls may come,
        the grammar carries a per-request filter that forbids repeating a call
        (:class:`~constrain.tools.repeats.RepeatedCallFilter`).
        """
        tools = self.callable_tools
        if not tools:
            return None
        return reply_grammar(tools, self.format, auto=self.choice == "auto", multiple=self.multiple)

    def prompt(self, model: Any, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text for ``messages`` with the tools, ending with the assistant's generation prompt,
        as :func:`constrain.generate` takes it (``model``: a ModelHandle or a tokenizer); see
        :func:`~constrain.tools.prompts.render_prompt`. Does not mutate ``messages``."""
        return render_prompt(
            model, messages, tools=self.tools, choice=self.choice, multiple=self.multiple, format=self.format
        )

    def parser(self) -> ToolCallParser:
        """A fresh incremental parser for one reply."""
        return ToolCallParser(self.callable_tools, self.format, choice=self.choice)

    def parse(self, text: str) -> ParsedReply:
        """The free text and the validated calls of a finished reply. Pure."""
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        return parser.result()


def tool_calling(
    tools: Sequence[Any],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    format: str | ToolFormat | None = None,
) -> ToolCalling:
    """Describe how a reply may call ``tools``.

    Parameters
    ----------
    tools : sequence of anything :func:`tool` takes
    tool_choice : "none", "auto", "required", a tool's name or ``{"type": "function", "function":
        {"name": ...}}``, default: "auto"
        "none": no constraint (the tools are still in the prompt); "auto": free text, and calls
        if the model starts them; "required": one or more calls and nothing else; a name: calls
        of that tool only.
    parallel_tool_calls : bool, default: True
        Several calls in one reply; False: exactly one (at most one with "auto").
    format : format name, ToolFormat, or a model name, default: None ("hermes")
        See :func:`tool_format`.

    Raises
    ------
    ToolError
        A bad tool definition, two tools with one name, or a ``tool_choice`` naming no tool.
    ValueError
        ``tool_choice`` or ``parallel_tool_calls`` of the wrong kind, or "required" without tools.
    """
    if isinstance(tools, (dict, str)) or not isinstance(tools, Sequence):
        raise ValueError("tools is a list of tools (definitions, Pydantic models, functions)")
    normalised = tuple(tool(t) for t in tools)
    names = [t.name for t in normalised]
    for name in names:
        if names.count(name) > 1:
            raise ToolError(name, "two tools have this name")
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}")
    choice: Any = tool_choice
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        choice = function.get("name") if tool_choice.get("type") == "function" and isinstance(function, dict) else None
    if not isinstance(choice, str):
        raise ValueError(
            f'tool_choice is "none", "auto", "required", a tool name or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {tool_choice!r}'
        )
    if choice == "required" and not normalised:
        raise ValueError('tool_choice="required" needs at least one tool')
    named = isinstance(tool_choice, dict) or choice not in MODES
    if named and choice not in names:
        raise ToolError(
            choice,
            f"tool_choice names a tool that is not among the tools ({', '.join(names) or 'none'})",
            "tool_choice",
        )
    return ToolCalling(normalised, choice, parallel_tool_calls, tool_format(format))
