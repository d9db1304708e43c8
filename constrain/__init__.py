"""``constrain``: structured generation with language models.

Constraints (``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``)
compile for a tokenizer (``compile``, cached) into a ``CompiledConstraint``,
whose per-request ``Matcher`` fills token bitmasks that ``sampler`` applies.
"""

from constrain.compiler import CompiledConstraint, cache_stats, compile
from constrain.constraints import (
    Choice,
    Constraint,
    Grammar,
    JsonSchema,
    Regex,
    choice,
    grammar,
    json_object,
    json_schema,
    regex,
)
from constrain.cost import ForwardCost
from constrain.detokenizer import IncrementalDetokenizer
from constrain.errors import (
    BeamSearchError,
    BudgetError,
    CompileError,
    ConstraintError,
    GrammarError,
    ReasoningError,
    RegexError,
    SchemaError,
    ToolError,
    UnsupportedSchemaError,
)
from constrain.export import export_model
from constrain.generate import Request, agenerate, astream, generate, stream
from constrain.matcher import Matcher, allocate_token_bitmask, fill_next_token_bitmasks
from constrain.models import ModelHandle, ModelNotFoundError, load_model, load_tokenizer
from constrain.partial import PartialJson, resolve
from constrain.reasoning import Reasoning
from constrain.results import Beam, GenerationResult, StreamEvent, Usage
from constrain.schema import CoverageEntry
from constrain.speculative import DraftModelProposer, NgramProposer, Proposer
from constrain.stopping import StopText, StopUpdate
from constrain.tokenizer import TokenizerInfo, tokenizer_info
from constrain.tools import (
    ChatDelta,
    ChatResult,
    ParsedReply,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCalling,
    ToolCallParser,
    ToolFormat,
    chat,
    tool,
    tool_calling,
    tool_format,
)
from sampler import SamplingParams, sample

__all__ = [
    "Beam",
    "BeamSearchError",
    "BudgetError",
    "ChatDelta",
    "ChatResult",
    "Choice",
    "CompileError",
    "CompiledConstraint",
    "Constraint",
    "ConstraintError",
    "CoverageEntry",
    "DraftModelProposer",
    "ForwardCost",
    "GenerationResult",
    "Grammar",
    "GrammarError",
    "IncrementalDetokenizer",
    "JsonSchema",
    "Matcher",
    "ModelHandle",
    "ModelNotFoundError",
    "NgramProposer",
    "ParsedReply",
    "PartialJson",
    "Proposer",
    "Reasoning",
    "ReasoningError",
    "Regex",
    "RegexError",
    "Request",
    "SamplingParams",
    "SchemaError",
    "StopText",
    "StopUpdate",
    "StreamEvent",
    "TokenizerInfo",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCalling",
    "ToolError",
    "ToolFormat",
    "UnsupportedSchemaError",
    "Usage",
    "agenerate",
    "allocate_token_bitmask",
    "astream",
    "cache_stats",
    "chat",
    "choice",
    "compile",
    "export_model",
    "fill_next_token_bitmasks",
    "generate",
    "grammar",
    "json_object",
    "json_schema",
    "load_model",
    "load_tokenizer",
    "regex",
    "resolve",
    "sample",
    "stream",
    "tokenizer_info",
    "tool",
    "tool_calling",
    "tool_format",
]
