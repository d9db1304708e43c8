"""Function calling: tool definitions, call formats, prompts, the grammar of a reply, its parser, the reply.

:func:`constrain.chat` is the call that puts these together.
"""

from constrain.tools.calling import ToolCalling, ToolChoice, tool_calling
from constrain.tools.definitions import MODES, Tool, tool
from constrain.tools.formats import MODEL_FAMILIES, TOOL_FORMATS, ToolFormat, tool_format
from constrain.tools.grammar import ToolGrammar
from constrain.tools.parser import ChatDelta, ParsedReply, ToolCall, ToolCallDelta, ToolCallParser, tool_call_json
from constrain.tools.prompts import FALLBACK_INSTRUCTIONS
from constrain.tools.repeats import LOOKAHEAD, RepeatedCallFilter
from constrain.tools.reply import AssistantReply, assistant_reply, finish_reason

__all__ = [
    "FALLBACK_INSTRUCTIONS",
    "LOOKAHEAD",
    "MODEL_FAMILIES",
    "MODES",
    "TOOL_FORMATS",
    "AssistantReply",
    "ChatDelta",
    "ParsedReply",
    "RepeatedCallFilter",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCalling",
    "ToolChoice",
    "ToolFormat",
    "ToolGrammar",
    "assistant_reply",
    "finish_reason",
    "tool",
    "tool_call_json",
    "tool_calling",
    "tool_format",
]
