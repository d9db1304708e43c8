"""``constrain``: structured generation with language models.

``generate``, ``stream`` and ``chat`` take a model and a prompt, and write output that follows a JSON
Schema, a Pydantic model, a regex, a grammar, a list of choices or a set of tools. Underneath,
constraints (``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``) compile for a
tokenizer (``compile``, cached) into a ``CompiledConstraint``, whose per-request ``Matcher`` fills
token bitmasks that ``constrain.sampler`` applies. ``__all__`` is the public API.
"""

from constrain.backends.tokenizer import TokenizerInfo, tokenizer_info
from constrain.compiler.compiler import CompiledConstraint, cache_stats, compile
from constrain.compiler.routing import AutoLimits
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
from constrain.constraints.schema import Coverage, CoverageEntry
from constrain.conversation import ChatResult, chat
from constrain.decode.partial import resolve
from constrain.decode.reasoning import Reasoning
from constrain.decode.speculative import DraftModelProposer, NgramProposer, Proposer
from constrain.errors import (
    BeamSearchError,
    BudgetError,
    CompileError,
    ConstraintError,
    ContextWindowError,
    GrammarError,
    ReasoningError,
    RegexError,
    SchemaError,
    ToolError,
    UnsatisfiableSchemaError,
    UnsupportedSchemaError,
)
from constrain.generation import (
    ChatOptions,
    GenerateOptions,
    Request,
    SamplingOptions,
    StreamOptions,
    agenerate,
    astream,
    generate,
    stream,
)
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import Matcher, fill_next_token_bitmasks
from constrain.models.cost import ForwardCost
from constrain.models.export import export_model
from constrain.models.loading import ModelHandle, ModelNotFoundError, load_model, load_tokenizer
from constrain.results import Beam, GenerationResult, StreamEvent, Usage
from constrain.sampler import InvalidSamplingParamsError, SamplingParams, sample
from constrain.tools import (
    ParsedReply,
    Tool,
    ToolCall,
    ToolCalling,
    ToolFormat,
    tool,
    tool_calling,
    tool_format,
)

__all__ = [
    "AutoLimits",
    "Beam",
    "BeamSearchError",
    "BudgetError",
    "ChatOptions",
    "ChatResult",
    "Choice",
    "CompileError",
    "CompiledConstraint",
    "Constraint",
    "ConstraintError",
    "ContextWindowError",
    "Coverage",
    "CoverageEntry",
    "DraftModelProposer",
    "ForwardCost",
    "GenerateOptions",
    "GenerationResult",
    "Grammar",
    "GrammarError",
    "InvalidSamplingParamsError",
    "JsonSchema",
    "Matcher",
    "ModelHandle",
    "ModelNotFoundError",
    "NgramProposer",
    "ParsedReply",
    "Proposer",
    "Reasoning",
    "ReasoningError",
    "Regex",
    "RegexError",
    "Request",
    "SamplingOptions",
    "SamplingParams",
    "SchemaError",
    "StreamEvent",
    "StreamOptions",
    "TokenizerInfo",
    "Tool",
    "ToolCall",
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
