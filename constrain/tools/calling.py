"""Function calling: tools, the grammar of a reply that may call them, prompts with tools, parsed calls.

A request with tools is described once by :func:`tool_calling` (a frozen :class:`ToolCalling`);
everything a caller (:func:`chat`, a server) needs follows from it:

1. ``prompt(model, messages)``: the prompt text, tools included: the chat template's own rendering
   when the template takes ``tools``, else a system message (:data:`FALLBACK_INSTRUCTIONS`);
2. ``constraint()``: the grammar of the reply, a :class:`ToolGrammar` (None for ``tool_choice="none"``
   or no tools), passed to ``generate(..., constraint=...)``; where several calls may come, it also
   gives each request a mask filter that forbids repeating a call (:mod:`constrain.tools.repeats`);
3. ``parser()``: a :class:`ToolCallParser` fed the text as it streams, giving OpenAI-style deltas
   (a call's name first, then its arguments' JSON text in chunks), or ``parse(text)`` at once.

Every call is written ``{"name": "<tool>", "arguments": {...}}``; a :class:`ToolFormat` says what
surrounds the calls of a reply, per model family (:func:`tool_format`). The arguments follow each
tool's JSON Schema through the same strict preparation as ``json_schema()`` constraints; in
``"auto"`` replies, free text runs until the format's trigger, after which the calls are enforced
(xgrammar's structural tags compile this into one grammar).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import secrets
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pydantic
import xgrammar as xgr
from pydantic.json_schema import GenerateJsonSchema
from xgrammar import structural_tag as st

from constrain.backends.tokenizer import TokenizerInfo
from constrain.compile.compiler import _json_schema_grammar
from constrain.constraints.constraint import EmbeddedJson, Grammar, JsonSchema, grammar, json_schema
from constrain.errors import ConstraintError, ToolError
from constrain.generate import generate
from constrain.match.validate import parse_json, schema_violations
from constrain.models.loading import ModelHandle, load_model
from constrain.results import FinishReason, GenerationResult
from constrain.tools.repeats import RepeatedCallFilter

__all__ = [
    "FALLBACK_INSTRUCTIONS",
    "MODEL_FAMILIES",
    "MODES",
    "TOOL_FORMATS",
    "ChatDelta",
    "ChatResult",
    "ParsedReply",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCalling",
    "ToolFormat",
    "ToolGrammar",
    "chat",
    "finish_reason",
    "tool",
    "tool_call_json",
    "tool_calling",
    "tool_format",
]

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tool name, as OpenAI allows it (which also keeps it free of JSON escapes), except the ``MODES``."""

MODES = ("none", "auto", "required")
"""The ``tool_choice`` values that name no tool."""

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


class _NoTitles(GenerateJsonSchema):
    """Pydantic's schemas without the titles it derives from field names (noise in a prompt)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool, whatever it was described as (see :func:`tool`).

    ``constraint`` is its arguments' JSON Schema as a constraint (objects closed, keys in schema
    order); ``model`` the Pydantic model that validates the arguments (the given model class, or
    the one derived from a function's signature; None for an OpenAI definition); ``function`` the
    Python function, if one was given.
    """

    name: str
    description: str
    constraint: JsonSchema
    model: type[pydantic.BaseModel] | None = field(default=None, compare=False)  # follows from the rest
    function: Callable[..., Any] | None = None

    @property
    def parameters(self) -> dict[str, Any]:
        """The arguments' JSON Schema (a fresh dict)."""
        value: dict[str, Any] = self.constraint.schema_value
        return value

    def definition(self) -> dict[str, Any]:
        """The OpenAI tool definition ``{"type": "function", "function": {...}}`` (a fresh dict)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def validate(self, arguments: str) -> tuple[Any, list[str]]:
        """(value, violations) of a call's arguments, given as JSON text; the value is None when violated.

        The value is the model instance for a Pydantic model, the keyword arguments (validated by
        Pydantic) for a function, else the parsed dict checked with jsonschema. Pure.
        """
        violations = schema_violations(self.constraint, arguments)
        if violations or self.model is None:
            return (None if violations else parse_json(arguments)), violations
        try:
            instance = self.model.model_validate_json(arguments)
        except pydantic.ValidationError as err:
            return None, [f"/{'/'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        if self.function is None:
            return instance, []
        return {key: getattr(instance, key) for key in type(instance).model_fields}, []


def tool(source: Any, *, name: str | None = None, description: str | None = None) -> Tool:
    """A :class:`Tool` from an OpenAI definition, a Pydantic model class or a Python function.

    Parameters
    ----------
    source : dict, Pydantic model class, function or Tool
        ``{"type": "function", "function": {"name", "description", "parameters"}}`` (no
        ``parameters``: no arguments, ``{}``); a model class (name: the class name,
        description: its docstring); a function with type hints on every parameter (name: the
        function's, description: its docstring; the schema comes from the signature through
        Pydantic: describe a parameter with ``Annotated[str, Field(description=...)]``).
    name, description : str or None, default: None (from the source)

    Raises
    ------
    ToolError
        A malformed definition, a name OpenAI would refuse (1 to 64 letters, digits, ``_``, ``-``),
        a function parameter without a type hint or not passable by keyword, or arguments whose
        schema is malformed or unsupported (the schema error, with its JSON pointer, is the cause).
    ValueError
        ``source`` is none of the above.
    """
    model: type[pydantic.BaseModel] | None = None
    function = None
    if isinstance(source, Tool):
        if name is None and description is None:
            return source
        label, doc, schema = _name(name, source.name), source.description, source.parameters
        model, function = source.model, source.function
    elif isinstance(source, dict):
        label, doc, schema = _definition(source)
        label = _name(name, label)
    elif isinstance(source, type) and issubclass(source, pydantic.BaseModel):
        label, doc, model = _name(name, source.__name__), inspect.cleandoc(source.__doc__ or ""), source
        schema = _pydantic_schema(label, source)
    elif inspect.isfunction(source) or inspect.ismethod(source):
        label, doc, function = _name(name, source.__name__), inspect.getdoc(source) or "", source
        model = _signature_model(label, source)
        schema = _pydantic_schema(label, model)
    else:
        kind = type(source).__name__
        raise ValueError(f"a tool is an OpenAI tool definition, a Pydantic model class or a function, got {kind}")
    if schema.get("type", "object") != "object":
        raise ToolError(label, 'the arguments are a JSON object: "parameters" must have "type": "object"')
    try:
        constraint = json_schema(schema)  # generation mode: closed, in schema order, json.dumps formatting
        _json_schema_grammar(constraint)  # strict-mode refusals and dangling $refs surface here, not at compile
    except (ConstraintError, RuntimeError) as err:
        raise ToolError(label, f"bad parameters: {err}") from err
    return Tool(label, description if description is not None else doc, constraint, model, function)


def _name(given: str | None, default: str) -> str:
    label = given if given is not None else default
    if not isinstance(label, str) or not TOOL_NAME.fullmatch(label):
        raise ToolError(str(label), "a tool name is 1 to 64 letters, digits, '_' or '-'")
    if label in MODES:
        raise ToolError(label, f"{', '.join(MODES)} are tool_choice values, not tool names")
    return label


def _definition(source: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(name, description, parameters) of an OpenAI tool definition."""
    function = source.get("function")
    label = str(function.get("name", "")) if isinstance(function, dict) else ""
    if source.get("type") != "function" or not isinstance(function, dict):
        raise ToolError(label, 'a tool definition is {"type": "function", "function": {"name": ..., ...}}')
    doc = function.get("description") or ""
    schema = function.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
    if not isinstance(doc, str) or not isinstance(schema, dict):
        raise ToolError(label, '"description" must be a string and "parameters" a JSON Schema object')
    return label, doc, schema


def _pydantic_schema(label: str, model: type[pydantic.BaseModel]) -> dict[str, Any]:
    try:
        schema = model.model_json_schema(schema_generator=_NoTitles)
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as err:
        raise ToolError(label, f"cannot derive a JSON Schema: {err}") from err
    schema.pop("title", None)
    schema.pop("description", None)  # the tool's description
    return schema


def _signature_model(label: str, function: Callable[..., Any]) -> type[pydantic.BaseModel]:
    """A Pydantic model whose fields are ``function``'s parameters (type hints and defaults)."""
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except (NameError, TypeError) as err:
        raise ToolError(label, f"cannot resolve the type hints: {err}") from err
    fields: dict[str, Any] = {}
    for param in inspect.signature(function).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ToolError(label, f"parameter {param.name!r} cannot be passed by keyword")
        if param.name not in hints:
            raise ToolError(label, f"parameter {param.name!r} has no type hint")
        fields[param.name] = (hints[param.name], ... if param.default is param.empty else param.default)
    try:
        return pydantic.create_model(label, **fields)
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, NameError, TypeError) as err:
        raise ToolError(label, f"cannot derive a model from the signature: {err}") from err


FALLBACK_INSTRUCTIONS = """You can call the following tools; a tool's "parameters" is the JSON Schema of its arguments.
<tools>
{tools}
</tools>
{policy}
Tool calls end the reply and are written exactly like this:
{example}"""
"""The system message that presents the tools when the chat template does not take ``tools``
(appended to the conversation's own system message if it has one). ``policy`` says what
``tool_choice`` asks; ``example`` spells one call (two with ``parallel_tool_calls``) in the format."""

_POLICIES = {
    "none": "Do not call any tool now: answer in plain text.",
    "auto": "Call tools when they help to answer; otherwise answer in plain text.",
    "required": "You must call at least one tool.",
}


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
        """The grammar of the reply (cached), or None when no tool may be called.

        "auto": free text without the format's trigger, then optionally the calls, which end the
        reply; "required": the calls alone; a named tool: exactly one call of it. ``parallel``: one
        or more calls, else exactly one. Arguments follow each tool's schema as ``json_schema()``
        constraints do; the text around them is fixed by the format. Where several calls may come,
        the grammar carries a per-request filter that forbids repeating a call
        (:class:`~constrain.tools.repeats.RepeatedCallFilter`).
        """
        return _grammar(self) if self.callable_tools else None

    def prompt(self, model: Any, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text for ``messages`` with the tools, ending with the assistant's generation prompt,
        as :func:`constrain.generate` takes it (``model``: a ModelHandle or a tokenizer).

        A chat template that mentions ``tools`` renders them itself, and gets ``messages`` unchanged.
        Otherwise :data:`FALLBACK_INSTRUCTIONS` join the system message; assistant messages with
        OpenAI ``tool_calls`` are rendered in the format, and ``tool`` messages become user messages
        ``<tool_response>\\n...\\n</tool_response>``. A BOS the template writes is dropped when
        encoding the text adds it again. Does not mutate ``messages``.
        """
        tokenizer = model.tokenizer if isinstance(model, ModelHandle) else model
        text = self._render(tokenizer, messages)
        bos = tokenizer.bos_token
        if bos and text.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.bos_token_id]:
            return text[len(bos) :]
        return text

    def _render(self, tokenizer: Any, messages: Sequence[dict[str, Any]]) -> str:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str):
            raise ValueError("the tokenizer has no chat template: write the prompt as text (see FALLBACK_INSTRUCTIONS)")
        definitions = [t.definition() for t in self.tools]
        if "tools" in template:
            text = tokenizer.apply_chat_template(
                list(messages), tools=definitions or None, add_generation_prompt=True, tokenize=False
            )
            return str(text)
        converted = [self._fallback_message(m) for m in messages]
        if definitions:
            example = [("tool_name", '{"argument": "value"}'), ("other_tool", "{}")][: 2 if self.multiple else 1]
            instructions = FALLBACK_INSTRUCTIONS.format(
                tools=json.dumps(definitions, ensure_ascii=False),
                policy=_POLICIES.get(self.choice, f"You must call the tool {self.choice!r}."),
                example=self.format.render(example),
            )
            if converted and converted[0].get("role") == "system":
                converted[0] = {**converted[0], "content": f"{converted[0].get('content') or ''}\n\n{instructions}"}
            else:
                converted.insert(0, {"role": "system", "content": instructions})
        return str(tokenizer.apply_chat_template(converted, add_generation_prompt=True, tokenize=False))

    def _fallback_message(self, message: dict[str, Any]) -> dict[str, Any]:
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
        rendered = self.format.render([(n, a if isinstance(a, str) else json.dumps(a)) for n, a in calls])
        return {"role": "assistant", "content": (message.get("content") or "") + rendered}

    def parser(self) -> ToolCallParser:
        """A fresh incremental parser for one reply."""
        return ToolCallParser(self)

    def parse(self, text: str) -> ParsedReply:
        """The free text and the validated calls of a finished reply. Pure."""
        parser = ToolCallParser(self)
        parser.feed(text)
        parser.finish()
        return parser.result()


@dataclass(frozen=True, slots=True)
class ToolGrammar(Grammar):
    """The grammar of a reply with tools (:meth:`ToolCalling.constraint`): a :class:`Grammar` everywhere
    (compiled, validated, served the same), which also gives each request its repeated-call filter.

    ``calling`` is the request that built it. It is not compared: requests whose grammars are equal
    share one compiled constraint, and the filter reads only what the grammar fixes (the format, the
    tool names, "auto" or not).
    """

    calling: ToolCalling | None = field(default=None, compare=False, repr=False)

    def mask_filter(self, tokenizer: TokenizerInfo) -> RepeatedCallFilter | None:
        """A fresh :class:`~constrain.tools.repeats.RepeatedCallFilter` for one request (the decode loop asks
        every constraint that has this method), or None where at most one call may come."""
        if self.calling is None or not self.calling.multiple:
            return None
        return RepeatedCallFilter(self.calling.parser(), tokenizer)


@functools.lru_cache(maxsize=256)
def _grammar(spec: ToolCalling) -> ToolGrammar:
    """The grammar of :meth:`ToolCalling.constraint`: an xgrammar structural tag, printed as EBNF."""
    one_call = st.OrFormat(
        elements=[
            st.SequenceFormat(
                elements=[
                    st.ConstStringFormat(value=t.name + NAME_END),
                    st.GrammarFormat(grammar=_json_schema_grammar(t.constraint)[0]),  # our strict grammar
                    st.ConstStringFormat(value=CALL_END),
                ]
            )
            for t in spec.callable_tools
        ]
    )
    fmt = spec.format
    more = st.SequenceFormat(elements=[st.ConstStringFormat(value=fmt.separator + CALL_OPEN), one_call])
    content = st.SequenceFormat(elements=[one_call, st.StarFormat(content=more)]) if spec.multiple else one_call
    calls = st.TagFormat(begin=fmt.begin + CALL_OPEN, content=content, end=fmt.end)
    root: st.Format = calls
    if spec.choice == "auto":
        root = st.TriggeredTagsFormat(triggers=[fmt.trigger], tags=[calls], stop_after_first=True)
    checked = grammar(str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=root))))
    # the schemas as the checks read them (key order and a Python type aside: tools from a dict, a model
    # and a function that give one grammar share one compiled constraint)
    arguments = tuple(
        (
            t.name,
            replace(t.constraint, schema=json.dumps(json.loads(t.constraint.schema), sort_keys=True), python_type=None),
        )
        for t in spec.callable_tools
    )
    embedded = EmbeddedJson(fmt.trigger, CALL_OPEN, NAME_END, arguments)  # the arguments, checked as they complete
    return ToolGrammar(checked.ebnf, checked.name, embedded, calling=spec)


ToolChoice = str | dict[str, Any]
"""``tool_choice`` as OpenAI takes it: a mode, ``{"type": "function", "function": {"name": ...}}``, or a tool name."""


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
        raise ToolError(choice, f"tool_choice names a tool that is not among the tools ({', '.join(names) or 'none'})")
    return ToolCalling(normalised, choice, parallel_tool_calls, tool_format(format))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. ``arguments`` is the validated value (see :meth:`Tool.validate`), None when
    ``violations`` says why not; ``arguments_json`` the text as generated (OpenAI's ``arguments``)."""

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
    :class:`ToolCalling` spells them. Text that breaks the spelling ends the parse with a violation.

    ``feed(text)`` returns what the text added (free text that could start the trigger is held back
    until it cannot); ``finish()`` what was held back; then ``result()`` the :class:`ParsedReply`.
    Not thread-safe: one parser per reply.
    """

    def __init__(self, spec: ToolCalling) -> None:
        self._spec = spec
        self._tools = {t.name: t for t in spec.callable_tools}
        self._pending = ""  # text received, not yet consumed
        self._consumed = 0  # characters consumed, for error messages
        self._content: list[str] = []
        self._calls: list[tuple[str, str]] = []  # (id, name)
        self._arguments: list[str] = []
        self._complete = 0  # calls whose arguments are complete
        self._depth = 0  # of the arguments' JSON brackets
        self._in_string = self._escaped = False
        self._violations: list[str] = []
        self._finished = False
        self._state = "text" if not self._tools else "content" if spec.choice == "auto" else "literal"
        self._literal, self._then = spec.format.begin + CALL_OPEN, "name"

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
        if self._state == "after_call" and self._pending == self._spec.format.end:
            self._state = "done"
        elif self._state not in ("done", "error", "text") and self._calls:
            self._violations.append("the reply ended inside the tool calls")
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
        if self._spec.choice not in ("none", "auto") and not calls and not violations:  # "required", named
            violations.append(f"tool_choice={self._spec.choice!r} but the reply calls no tool")
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
        fmt, pending = self._spec.format, self._pending
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
        """Pass on the arguments' text up to the bracket that closes them (strings and escapes aware)."""
        pending = self._pending
        for i, ch in enumerate(pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif self._depth == 0 and ch != "{":
                return self._fail("expected the arguments' JSON object")
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._emit_arguments(i + 1, deltas)
                    self._complete += 1
                    self._state, self._literal, self._then = "literal", CALL_END, "after_call"
                    return True
        self._emit_arguments(len(pending), deltas)
        return False

    def _emit_arguments(self, n: int, deltas: list[ToolCallDelta]) -> None:
        chunk = self._take(n)
        self._arguments[-1] += chunk
        deltas.append(ToolCallDelta(len(self._calls) - 1, None, None, chunk))


@dataclass(frozen=True, slots=True)
class ChatResult:
    """A reply to a chat with tools: ``content`` (free text, "" when none), ``tool_calls``, and every
    violation (the generation's and the parse's). ``finish_reason`` is "tool_calls" when the reply
    ended after calls, else the generation's; ``generation`` is the underlying result."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason | Literal["tool_calls"]
    violations: list[str]
    generation: GenerationResult

    @property
    def valid(self) -> bool:
        return not self.violations and self.finish_reason != "error"


_GENERATE_CONSTRAINTS = ("schema", "regex", "grammar", "choices", "constraint", "n")


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as OpenAI writes it in a message's ``tool_calls`` (``arguments``: JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason(result: GenerationResult, reply: ParsedReply | None) -> FinishReason | Literal["tool_calls"]:
    """OpenAI's finish reason of a reply: ``"tool_calls"`` when it ended by itself with calls."""
    if reply is not None and reply.tool_calls and result.finish_reason == "stop":
        return "tool_calls"
    return result.finish_reason


def chat(
    model: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[Any] = (),
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    tool_format: str | ToolFormat | None = None,
    **generate_kwargs: Any,
) -> ChatResult:
    """One chat reply that may call ``tools``: render the prompt, generate under the tools' grammar, parse.

    Parameters
    ----------
    model : ModelHandle, or anything ``load_model`` takes (None: the default model)
    messages : OpenAI chat messages (``tool`` results and assistant ``tool_calls`` included)
    tools, tool_choice, parallel_tool_calls : see :func:`tool_calling`
    tool_format : format name or ToolFormat, default: None (the model family's, :func:`tool_format`)
    **generate_kwargs : :func:`constrain.generate`'s options (``max_tokens``, ``temperature``, ``seed``...),
        except the constraint and ``n``

    Raises
    ------
    ToolError, ValueError
        Bad tools or arguments, before anything is generated.
    """
    given = sorted(set(generate_kwargs) & set(_GENERATE_CONSTRAINTS))
    if given:
        raise ValueError(f"chat() builds the constraint from the tools and makes one reply: drop {', '.join(given)}")
    handle = model if isinstance(model, ModelHandle) else load_model(model)
    spec = tool_calling(
        tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, format=tool_format or handle.name
    )
    generation = generate(handle, spec.prompt(handle, messages), constraint=spec.constraint(), **generate_kwargs)
    reply = spec.parse(generation.text)
    violations = list(dict.fromkeys(generation.violations + reply.violations))
    return ChatResult(reply.content, reply.tool_calls, finish_reason(generation, reply), violations, generation)
