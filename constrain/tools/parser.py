"""The parse of a reply with tools: :class:`ToolCallParser` splits it, as it streams, into free text and calls.

Fed the text as it is generated, the parser gives OpenAI-style deltas (:class:`ChatDelta`: a call's
name first, then its arguments' JSON text in chunks), and at the end a :class:`ParsedReply` whose
calls (:class:`ToolCall`) are validated against their tool. It reads the text as the reply's grammar
(:mod:`constrain.tools.grammar`) spells it, so the two agree on every reply the grammar allows.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from constrain.jsonscan import START, JsonSyntaxError
from constrain.tools.definitions import Tool
from constrain.tools.formats import CALL_END, CALL_OPEN, NAME_END, ToolFormat

__all__ = [
    "ENDED_INSIDE_CALLS",
    "ChatDelta",
    "ParsedReply",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "tool_call_json",
]

ENDED_INSIDE_CALLS = "the reply ended inside the tool calls"
"""The violation of a reply that stopped before its calls were whole (a stop string, ``max_tokens``)."""


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as OpenAI writes it in a message's ``tool_calls`` (``arguments``: JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. ``arguments`` is the validated value (see
    :meth:`~constrain.tools.definitions.Tool.validate`), None when ``violations`` says why not;
    ``arguments_json`` the text as generated (OpenAI's ``arguments``)."""

    id: str
    name: str
    arguments: Any
    arguments_json: str
    tool: Tool
    violations: list[str] = field(default_factory=list)

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI writes it in a message's ``tool_calls`` (a fresh dict)."""
        return tool_call_json(self.id, self.name, self.arguments_json)

    def run(self) -> Any:
        """Call the tool's Python function with the validated arguments and return its result.

        Raises
        ------
        ValueError
            The tool was not given as a function, or the arguments are invalid (see ``violations``).
        """
        if self.tool.function is None:
            raise ValueError(f"tool {self.name!r} was not given as a Python function: use call.arguments")
        if self.arguments is None:
            raise ValueError(f"the call of {self.name!r} has invalid arguments: {'; '.join(self.violations)}")
        return self.tool.function(**self.arguments)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call ``index`` (OpenAI's ``delta.tool_calls[i]``): the first carries ``id``
    and ``name`` (``arguments`` empty), the next ones a chunk of the arguments' JSON text each."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What one piece of streamed text added: free text, and pieces of calls."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A finished reply: its free text, its calls, and every violation (the calls' own included)."""

    content: str
    tool_calls: list[ToolCall]
    violations: list[str]

    @property
    def valid(self) -> bool:
        return not self.violations


class ToolCallParser:
    """Splits one reply, fed as it is generated, into free text and calls, as the constraint of the same
    request spells them (:meth:`~constrain.tools.calling.ToolCalling.parser` builds one). Text that
    breaks the spelling ends the parse with a violation.

    ``feed(text)`` returns what the text added (free text that could start the trigger is held back
    until it cannot); ``finish()`` what was held back; then ``result()`` the :class:`ParsedReply`.
    Not thread-safe: one parser per reply.

    Parameters
    ----------
    tools : sequence of Tool
        The tools the reply may call (:attr:`~constrain.tools.calling.ToolCalling.callable_tools`);
        none: the reply is free text.
    format : ToolFormat
        How the calls are written.
    choice : str, default: "auto"
        The request's ``tool_choice``: "auto" lets free text come first; "required" or a tool's name
        makes the reply calls alone, at least one.
    """

    def __init__(self, tools: Sequence[Tool], format: ToolFormat, *, choice: str = "auto") -> None:
        self._format, self._choice = format, choice
        self._tools = {t.name: t for t in tools}
        self._pending = ""  # text received, not yet consumed
        self._consumed = 0  # characters consumed, for error messages
        self._content: list[str] = []
        self._calls: list[tuple[str, str]] = []  # (id, name)
        self._arguments: list[str] = []
        self._complete = 0  # calls whose arguments are complete
        self._json = START  # the arguments being written
        self._violations: list[str] = []
        self._finished = False
        self._state = "text" if not self._tools else "content" if choice == "auto" else "literal"
        self._literal, self._then = format.begin + CALL_OPEN, "name"

    def feed(self, text: str) -> ChatDelta:
        """Take the next piece of the reply; return the free text and call pieces it completes."""
        if self._finished:
            raise ValueError("feed() after finish(): use a new parser per reply")
        self._pending += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._pending and self._step(content, deltas):
            pass
        self._content += content
        return ChatDelta("".join(content), tuple(deltas))

    def finish(self) -> ChatDelta:
        """The reply ended: return the free text held back, and check that no call was left open."""
        self._finished = True
        if self._state == "content":
            held, self._pending = self._pending, ""
            self._content.append(held)
            return ChatDelta(held)
        if self._state == "after_call" and self._pending == self._format.end:
            self._state = "done"
        elif self._state not in ("done", "error", "text") and self._calls:
            self._violations.append(ENDED_INSIDE_CALLS)
        return ChatDelta()

    def fork(self) -> ToolCallParser:
        """An independent copy in the same state (to try a continuation). Does not change this parser."""
        twin = copy.copy(self)
        twin._content, twin._calls = list(self._content), list(self._calls)
        twin._arguments, twin._violations = list(self._arguments), list(self._violations)
        return twin

    def complete_calls(self) -> list[tuple[str, str]]:
        """(name, arguments JSON text) of each call whose arguments are complete so far, in order."""
        return [(name, self._arguments[i]) for i, (_, name) in enumerate(self._calls[: self._complete])]

    def open_call(self) -> str | None:
        """The name of the call whose arguments are being written, else None."""
        return self._calls[-1][1] if self._state == "arguments" else None

    def open_arguments(self) -> str:
        """The text of the arguments being written so far ("" where no call's are)."""
        return self._arguments[-1] if self._state == "arguments" else ""

    def result(self) -> ParsedReply:
        """The parsed reply (after :meth:`finish`), arguments validated."""
        if not self._finished:
            raise ValueError("call finish() first")
        violations = list(self._violations)
        calls = []
        for index, ((call_id, name), text) in enumerate(zip(self._calls, self._arguments, strict=True)):
            tool = self._tools[name]
            value, problems = tool.validate(text) if index < self._complete else (None, ["incomplete arguments"])
            violations += [f"tool call {index} ({name}): {p}" for p in problems]
            calls.append(ToolCall(call_id, name, value, text, tool, problems))
        if self._choice not in ("none", "auto") and not calls and not violations:  # "required", named
            violations.append(f"tool_choice={self._choice!r} but the reply calls no tool")
        return ParsedReply("".join(self._content), calls, violations)

    def _take(self, n: int) -> str:
        taken, self._pending = self._pending[:n], self._pending[n:]
        self._consumed += n
        return taken

    def _fail(self, message: str) -> bool:
        self._violations.append(f"{message} at character {self._consumed}")
        self._state = "error"
        return True

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what can be decided of the pending text; return whether to go on."""
        fmt, pending = self._format, self._pending
        if self._state == "text":
            content.append(self._take(len(pending)))
            return False
        if self._state == "content":
            at = pending.find(fmt.trigger)
            if at < 0:
                held = next(k for k in range(len(fmt.trigger) - 1, -1, -1) if pending.endswith(fmt.trigger[:k]))
                content.append(self._take(len(pending) - held))
                return False
            content.append(self._take(at))
            self._state, self._literal, self._then = "literal", fmt.begin + CALL_OPEN, "name"
            return True
        if self._state == "literal":
            if pending.startswith(self._literal):
                self._take(len(self._literal))
                self._state = self._then
                return True
            if self._literal.startswith(pending):
                return False
            return self._fail(f"expected {self._literal!r}")
        if self._state == "name":
            end = pending.find('"')
            if end < 0:
                return len(pending) > 64 and self._fail("expected a tool name")  # names are 1 to 64 characters
            name = pending[:end]
            if name not in self._tools:
                return self._fail(f"unknown tool {name!r}")
            call_id = f"call_{secrets.token_hex(12)}"
            self._calls.append((call_id, name))
            self._arguments.append("")
            deltas.append(ToolCallDelta(len(self._calls) - 1, call_id, name, ""))
            self._take(end)
            self._state, self._literal, self._then = "literal", NAME_END, "arguments"
            return True
        if self._state == "arguments":
            return self._scan_arguments(deltas)
        if self._state == "after_call":
            following = fmt.separator + CALL_OPEN
            if pending.startswith(following):
                self._take(len(following))
                self._state = "name"
                return True
            if following.startswith(pending):
                return False  # the end may be a prefix of the separator: wait, or finish() decides
            if pending.startswith(fmt.end):
                self._take(len(fmt.end))
                self._state = "done"
                return True
            if fmt.end.startswith(pending):
                return False
            return self._fail("expected another call or the end of the calls")
        if self._state == "done":
            return self._fail("text after the tool calls")
        self._take(len(pending))  # "error": the violation is recorded, the rest is not parsed
        return False

    def _scan_arguments(self, deltas: list[ToolCallDelta]) -> bool:
        """Pass on the arguments' text up to where their JSON object ends (read by :mod:`constrain.jsonscan`)."""
        pending = self._pending
        if self._json is START and not pending.startswith("{"):
            return self._fail("expected the arguments' JSON object")
        data = pending.encode()
        try:
            self._json, read = self._json.feed_value(data, texts=False)
        except JsonSyntaxError as err:  # the arguments up to the culprit go out; the call stays incomplete
            self._emit_arguments(len(data[: err.position].decode()), deltas)
            return self._fail(f"the arguments are not JSON: {err.reason}")
        if not self._json.finished:
            self._emit_arguments(len(pending), deltas)
            return False
        self._emit_arguments(len(data[:read].decode()), deltas)
        self._complete += 1
        self._json = START
        self._state, self._literal, self._then = "literal", CALL_END, "after_call"
        return True

    def _emit_arguments(self, n: int, deltas: list[ToolCallDelta]) -> None:
        chunk = self._take(n)
        self._arguments[-1] += chunk
        deltas.append(ToolCallDelta(len(self._calls) - 1, None, None, chunk))
