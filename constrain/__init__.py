"""``constrain``: structured generation with language models.

Constraints (``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``)
compile for a tokenizer (``compile``, cached) into a ``CompiledConstraint``,
whose per-request ``Matcher`` fills token bitmasks that ``sampler`` applies.
"""

from constrain.backends.tokenizer import TokenizerInfo, tokenizer_info
from constrain.chat import ChatResult, chat
from constrain.compile.compiler import CompiledConstraint, cache_stats, compile
from constrain.constraints.constraint import (
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
from constrain.constraints.schema import CoverageEntry
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.partial import PartialJson, resolve
from constrain.decode.reasoning import Reasoning
from constrain.decode.speculative import DraftModelProposer, NgramProposer, Proposer
from constrain.decode.stopping import StopText, StopUpdate
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
    UnsatisfiableSchemaError,
    UnsupportedSchemaError,
)
from constrain.generate import Request, agenerate, astream, generate, stream
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import Matcher, fill_next_token_bitmasks
from constrain.models.cost import ForwardCost
from constrain.models.export import export_model
from constrain.models.loading import ModelHandle, ModelNotFoundError, load_model, load_tokenizer
from constrain.results import Beam, GenerationResult, StreamEvent, Usage
from constrain.tools import (
    ChatDelta,
    ParsedReply,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCalling,
    ToolCallParser,
    ToolFormat,
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
    "UnsatisfiableSchemaError",
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
