"""How a model family writes the tool calls of a reply: :class:`ToolFormat`, the known formats, the family lookup.

Every call is spelt ``CALL_OPEN + name + NAME_END + arguments + CALL_END``
(``{"name": "<tool>", "arguments": {...}}``); a format says what surrounds the calls of one reply.
Pure data: nothing here knows the tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CALL_END", "CALL_OPEN", "MODEL_FAMILIES", "NAME_END", "TOOL_FORMATS", "ToolFormat", "tool_format"]

CALL_OPEN = '{"name": "'
NAME_END = '", "arguments": '
CALL_END = "}"
"""How every call is spelt: ``CALL_OPEN + name + NAME_END + arguments + CALL_END``."""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes the tool calls of one reply: ``begin + call + (separator + call)* + end``.

    In ``tool_choice="auto"`` replies, ``trigger`` (a prefix of ``begin + CALL_OPEN``) starts the
    calls: free text may not contain it, and once it appears the rest of the reply is calls.
    """

    name: str
    trigger: str
    begin: str
    separator: str
    end: str

    def __post_init__(self) -> None:
        if not self.trigger or not (self.begin + CALL_OPEN).startswith(self.trigger):
            raise ValueError(f"a ToolFormat's trigger must be a non-empty prefix of {self.begin + CALL_OPEN!r}")

    def render(self, calls: Sequence[tuple[str, str]]) -> str:
        """The text of ``calls``, each a (name, arguments JSON text) pair, as the model writes them."""
        return self.begin + self.separator.join(CALL_OPEN + n + NAME_END + a + CALL_END for n, a in calls) + self.end


TOOL_FORMATS = {
    f.name: f
    for f in (
        # Hermes, Qwen 2.5 and 3: one <tool_call> block per call
        ToolFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
        # SmolLM2 (its model card's tool prompt): one block holding a JSON list of the calls, spelt
        # without the card's newlines: after a call, the closing path (constrain.match.closing) must find
        # "]" before ",", as it does in JSON
        ToolFormat("smollm2", "<tool_call>", "<tool_call>[", ", ", "]</tool_call>"),
        # a bare JSON list of calls; in "auto" replies free text may not contain '[{"'
        ToolFormat("json_list", '[{"', "[", ", ", "]"),
    )
}
"""The known formats, by name."""

MODEL_FAMILIES = (("smollm2", "smollm2"), ("qwen", "hermes"), ("hermes", "hermes"))
"""(substring of a model's name, format name), tried in order; a model matching none gets "hermes"."""


def tool_format(name: str | ToolFormat | None = None) -> ToolFormat:
    """A format by its name (``TOOL_FORMATS``), else the format of the model family whose key the model
    name contains (case-insensitive, ``MODEL_FAMILIES``); "hermes" for None or an unknown model."""
    if isinstance(name, ToolFormat):
        return name
    if name in TOOL_FORMATS:
        return TOOL_FORMATS[name]
    lowered = (name or "").lower()
    return TOOL_FORMATS[next((fmt for key, fmt in MODEL_FAMILIES if key in lowered), "hermes")]
