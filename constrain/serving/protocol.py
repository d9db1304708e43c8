"""OpenAI's chat and completions API as ``constrain`` requests: the request bodies (pydantic models,
validated on arrival), their translation into :class:`~constrain.generation.Request` s, and the
response bodies and stream chunks built from results. No HTTP here (see :mod:`constrain.serving.server`).

Decisions, where OpenAI's API leaves room:

- No field is silently ignored. An unknown field is refused (400, naming it), so that a misspelt
  parameter does not pass unnoticed. Every known field either shapes the generation (the
  :class:`~constrain.generation.Request` built) or acts on the response or the server (listed, with what
  it does, in :data:`SERVED_FIELDS`); a field given where it could do neither is refused with a 400
  whose ``param`` is its dotted path (:class:`FieldError`), as OpenAI refuses it: ``stream_options``
  without ``stream: true``, ``top_logprobs`` without ``logprobs: true``, ``tool_choice`` or
  ``parallel_tool_calls`` without tools, ``response_format.json_schema`` beside a type other than
  ``json_schema``, ``max_tokens`` and ``max_completion_tokens`` with different values, ``best_of``
  (other than ``n``) or ``length_penalty`` without ``use_beam_search``. "Given" means present and not
  null: a null is the default, as in OpenAI's API.
- ``store: true`` is refused (this server stores no completions); ``false`` is accepted. ``service_tier``
  other than ``"auto"`` or ``"default"`` is refused (there is one tier). ``user`` and ``metadata`` are
  logged with the request id (:func:`request_labels`); ``metadata`` is taken without ``store``, unlike
  OpenAI, because clients send it to every OpenAI-compatible server.
- ``response_format`` ``json_schema`` without ``schema`` (or with ``"schema": null``) is any JSON object,
  the constraint of ``json_object``: OpenAI's API marks ``schema`` optional, and any JSON *value* would
  let the model answer with a quoted sentence, prose in all but name. An explicit ``"schema": true``
  is taken as written: any JSON value. ``json_schema`` itself is required with that type (400).
  Its ``name`` (1 to 64 letters, digits, ``_`` or ``-``, as OpenAI's) and ``description`` label the
  schema: neither is shown to the model, so the prompt is the messages alone.
- ``response_format`` ``json_schema`` with ``strict: true`` compiles strictly (a keyword that can be
  neither enforced nor checked is refused, 400 naming its path); otherwise leniently (approximated,
  and the result is validated afterwards). Without a schema both are ``json_object``'s, enforced exactly.
- Extensions: ``regex``, ``grammar`` (EBNF text or a shipped grammar's name), ``choices``; at most
  one constraint per request (two: 400 naming them, ``param`` the later in this docstring's order),
  and none beside tools that may be called.
- vLLM's request extras, so that a client written for vLLM's server works unchanged:
  ``structured_outputs`` (vLLM 0.32's ``StructuredOutputsParams``, :class:`StructuredOutputs`) with
  exactly one of ``json`` (a schema or its JSON text: ``response_format`` ``json_schema``'s constraint,
  lenient), ``regex``, ``choice``, ``grammar`` (EBNF: xgrammar's dialect, which vLLM's default backend
  reads; not Lark) or ``json_object: true`` (``json_object``'s constraint); and vLLM's older top-level
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (:data:`GUIDED_FIELDS`),
  which vLLM 0.32 itself ignores (with a logged warning). Each is one constraint, counted with the
  others above. ``structured_outputs.disable_any_whitespace: true`` writes JSON without whitespace
  (``"compact"``; with ``json`` or ``json_object`` only); ``false``, vLLM's default, keeps this
  server's JSON formatting (``json.dumps``'s separators, where vLLM lets the model choose
  whitespace). ``disable_additional_properties`` is taken either way: objects that declare
  properties are closed already (:func:`~constrain.constraints.json_schema`'s generation mode), as vLLM's
  default backend (xgrammar, strict mode) closes them. ``guided_decoding_backend`` is taken as
  ``"auto"`` only (one backend here); the whitespace patterns and structural tags are refused
  (:data:`REFUSED_FIELDS`).
- A ``developer`` message is a system message where the chat template has no ``developer`` role (OpenAI's
  name for the system message of its reasoning models).
- ``seed`` is OpenAI's signed 64-bit integer; a negative seed is used modulo ``2**63`` (the sampler's seeds are
  63-bit), so ``-1`` gives the same output as ``2**63 - 1``.
- ``max_tokens`` (or ``max_completion_tokens``) defaults to 256, or what the model's context window leaves
  after the prompt where that is less; more than that is a 400 naming ``max_tokens``. ``temperature`` defaults to 1.
- ``use_beam_search`` (vLLM's name) runs a beam search of width ``best_of`` (default ``n``, at least
  ``n``) with ``length_penalty``: the ``n`` choices are the ``n`` best beams (:mod:`constrain.decode.beams`).
  Not with ``stream``, ``stop``, ``logprobs`` or sampling parameters (400, naming the parameter).
- A result that breaks its constraint (which only a lenient schema allows) carries ``violations`` in
  its choice; a grammar dead end ends the choice with ``finish_reason: "error"``.
- A result the termination budget closed (the Python API's ``finish_reason="length"`` with
  ``closed_early``) that is complete and valid, its tool calls included, finishes with ``"stop"``
  (``"tool_calls"`` after calls): clients (the openai SDK's ``parse``, instructor, LangChain) take
  ``"length"`` for a truncated object and drop it. The choice then carries ``"closed_early": true``
  and ``"forced_tokens"`` (the tokens the closing path replaced), in whole responses and in the last
  chunk of a stream, chat and completions alike. A result that is not complete and valid keeps
  ``"length"`` (with those two fields where the budget acted).
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from constrain.backends.tokenizer import tokenizer_info
from constrain.constraints.constraint import Constraint, choice, grammar, json_object, json_schema, regex
from constrain.errors import BeamSearchError, ConstraintError, ToolError
from constrain.generation import Request
from constrain.match.vocab import token_texts
from constrain.models.loading import ModelHandle
from constrain.results import GenerationResult
from constrain.tools.calling import ToolCalling, tool_calling
from constrain.tools.parser import ParsedReply, ToolCallDelta, tool_call_json
from constrain.tools.reply import AssistantReply, finish_reason

__all__ = [
    "GUIDED_FIELDS",
    "REFUSED_FIELDS",
    "SERVED_FIELDS",
    "ChatCompletionRequest",
    "CompletionRequest",
    "FieldError",
    "StructuredOutputs",
    "chat_message",
    "chat_requests",
    "completion_requests",
    "finish_fields",
    "request_labels",
]

SERVED_FIELDS: dict[str, str] = {
    "model": "checked against the served model (404 otherwise)",
    "stream": "the response as Server-Sent Events",
    "stream_options": "with stream: true only",
    "stream_options.include_usage": "a last chunk with the usage",
    "user": "logged with the request id",
    "metadata": "logged with the request id",
    "store": "false only: nothing is stored (true: 400)",
    "service_tier": '"auto" or "default" only: there is one tier (others: 400)',
    "response_format.json_schema.name": "labels the schema; not shown to the model",
    "response_format.json_schema.description": "labels the schema; not shown to the model",
    "guided_decoding_backend": '"auto" only: the one backend here is constrain (others: 400)',
    "structured_outputs.disable_additional_properties": (
        "true or false: objects that declare properties are closed already, as vLLM's default backend closes them"
    ),
}
"""The request fields (dotted paths) that act on the response or the server rather than on the
generation, or whose accepted values ask for what happens already, with what each does: every other
field shapes the :class:`~constrain.generation.Request` built, or is refused (see the module docstring)."""

_NO_PATTERN = "JSON whitespace here is a policy, not a pattern: pass structured_outputs.disable_any_whitespace for none"

REFUSED_FIELDS: dict[str, str] = {
    "structured_outputs.whitespace_pattern": _NO_PATTERN,
    "structured_outputs.structural_tag": "no structural tags here: use tools (function calling) or a grammar",
    "guided_whitespace_pattern": _NO_PATTERN,
}
"""vLLM's request fields (dotted paths) that this server cannot honour, with why: given (not null), a 400
whose ``param`` is the path says so. Declared, rather than left unknown, for that message."""

GUIDED_FIELDS: dict[str, str] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older top-level constraint fields, each with the :class:`StructuredOutputs` field it became."""


class FieldError(ValueError):
    """A request field given where it can have no effect, or with a value this server cannot honour.
    ``field`` is its dotted path (``"response_format.json_schema"``): the 400's ``param``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def _given(body: BaseModel, name: str) -> bool:
    """Whether the request set ``name`` to something other than null (a null is the default)."""
    return name in body.model_fields_set and getattr(body, name) is not None


def _given_path(body: BaseModel, path: str) -> bool:
    """:func:`_given` for a dotted path of field names (``"structured_outputs.structural_tag"``)."""
    *parents, name = path.split(".")
    node: Any = body
    for parent in parents:
        if not _given(node, parent):
            return False
        node = getattr(node, parent)
    return _given(node, name)


def _one_constraint(fields: list[str]) -> None:
    """Refuse (:class:`FieldError`, ``param`` the last) more than one constraint field given."""
    if len(fields) > 1:
        raise FieldError(fields[-1], f"one constraint per request: {', '.join(fields)} given; pass one")


def _vllm_constraint(path: str, kind: str, value: Any, compact: bool) -> Constraint:
    """The constraint of one of vLLM's fields (``kind``: a :class:`StructuredOutputs` field), built here so that
    a bad one is refused naming ``path``. ``compact``: JSON without whitespace (``disable_any_whitespace``)."""
    try:
        if kind == "json":  # response_format json_schema's constraint, without strict: lenient
            return json_schema(value, lenient=True, whitespace="compact" if compact else None)
        if kind == "json_object":
            return json_object(whitespace="compact" if compact else "dumps")
        if kind == "regex":
            return regex(value)
        if kind == "choice":
            return choice(value)
        return grammar(value)
    except (ConstraintError, ValueError) as err:
        raise FieldError(path, str(err)) from err


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


NULL_IS_DEFAULT = frozenset({"n", "stream", "use_beam_search", "logprobs", "parallel_tool_calls"})
"""Fields that take no null, which OpenAI's clients may send as null to mean the default: left out."""


def _without_nulls(data: Any) -> Any:
    """A request body without the fields of :data:`NULL_IS_DEFAULT` that are null (as if not sent)."""
    if not isinstance(data, dict):
        return data
    return {key: value for key, value in data.items() if value is not None or key not in NULL_IS_DEFAULT}


class JsonSchemaFormat(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # a label
    description: str | None = None  # a label: not shown to the model
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


_KINDS = {"json": "json_", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
"""The constraint fields of :class:`StructuredOutputs`: wire name -> attribute."""


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``, vLLM 0.32): exactly one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, with options (see the module docstring)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # EBNF (xgrammar's dialect) or a shipped grammar's name
    json_object: bool | None = None  # true only
    disable_any_whitespace: bool = False  # true: JSON without whitespace; json and json_object only
    disable_additional_properties: bool = False  # either way: objects are closed already (SERVED_FIELDS)
    whitespace_pattern: Any = None  # refused: REFUSED_FIELDS
    structural_tag: Any = None  # refused: REFUSED_FIELDS

    def kinds(self) -> list[str]:
        """The wire names of the constraint fields given."""
        return [kind for kind, name in _KINDS.items() if _given(self, name)]

    def check(self) -> None:
        """Refuse none or a ``json_object`` other than true, and ``disable_any_whitespace`` where no JSON is
        written (:class:`FieldError`); two constraints are refused with the request's others."""
        if not self.kinds():
            raise FieldError("structured_outputs", f"give one of {', '.join(_KINDS)}")
        if self.json_object is False:
            raise FieldError("structured_outputs.json_object", "true only (any JSON object); omit it otherwise")
        if self.disable_any_whitespace and not {"json", "json_object"} & set(self.kinds()):
            raise FieldError("structured_outputs.disable_any_whitespace", "only with json or json_object")


REASONING_EFFORT = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096}
"""OpenAI's ``reasoning_effort`` as a thinking budget in tokens (0: no thinking)."""


class _Common(_Body):
    """Fields both endpoints take."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, strict=True)
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63, strict=True)  # OpenAI's: a signed 64-bit integer
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=64, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    regex: str | None = None
    grammar: str | None = None
    choices: list[str] | None = Field(default=None, min_length=1)
    reasoning: bool | dict[str, Any] | None = None  # think first (decode.reasoning): true or {"max_tokens": N}
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # OpenAI's: REASONING_EFFORT
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's constraint fields
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names: GUIDED_FIELDS
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # "auto" only
    guided_whitespace_pattern: Any = None  # refused: REFUSED_FIELDS
    # vLLM's name: beam search under the constraint (constrain.decode.beams); best_of: the beam width (default: n)
    use_beam_search: bool = Field(default=False, strict=True)
    best_of: int | None = Field(default=None, ge=1, le=64, strict=True)
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)  # beams rank by logprob / length ** this

    _nulls = model_validator(mode="before")(_without_nulls)

    def check(self) -> None:
        """Refuse (:class:`FieldError`, :class:`BeamSearchError`) a field given where it can have no effect,
        or that this server cannot honour (see the module docstring)."""
        if _given(self, "stream_options") and not self.stream:
            raise FieldError("stream_options", "only with stream: true")
        if "length_penalty" in self.model_fields_set and not self.use_beam_search:
            raise BeamSearchError("length_penalty", "only with use_beam_search: true, where it ranks the beams")
        if self.store:
            raise FieldError("store", "this server stores no completions: omit it or pass false")
        if self.service_tier not in (None, "auto", "default"):
            raise FieldError(
                "service_tier", f'this server has one tier ("auto" or "default"), not {self.service_tier!r}'
            )
        for path, reason in REFUSED_FIELDS.items():
            if _given_path(self, path):
                raise FieldError(path, reason)
        if self.guided_decoding_backend not in (None, "auto"):
            raise FieldError(
                "guided_decoding_backend",
                f'the one backend here is constrain: omit it or pass "auto", not {self.guided_decoding_backend!r}',
            )
        if self.structured_outputs is not None:
            self.structured_outputs.check()
        if "" in ([self.stop] if isinstance(self.stop, str) else self.stop or []):
            raise FieldError("stop", "a stop string is one character or more: omit the empty one")
        _one_constraint(self.constraint_fields())

    def constraint_fields(self) -> list[str]:
        """The dotted paths of the constraint fields given: the extensions, then vLLM's fields."""
        fields = [name for name in ("regex", "grammar", "choices") if _given(self, name)]
        if self.structured_outputs is not None:
            fields += [f"structured_outputs.{kind}" for kind in self.structured_outputs.kinds()]
        return fields + [name for name in GUIDED_FIELDS if _given(self, name)]

    def vllm_constraint(self) -> Constraint | None:
        """The constraint of vLLM's fields (``structured_outputs``, ``guided_*``; :meth:`check` leaves at most
        one), None without one."""
        outputs = self.structured_outputs
        if outputs is not None:
            (kind,) = outputs.kinds()
            value = getattr(outputs, _KINDS[kind])
            return _vllm_constraint(f"structured_outputs.{kind}", kind, value, outputs.disable_any_whitespace)
        for name, kind in GUIDED_FIELDS.items():
            if _given(self, name):
                return _vllm_constraint(name, kind, getattr(self, name), False)
        return None

    def beam_width(self) -> int:
        """``num_beams``: ``best_of`` (default ``n``) with ``use_beam_search``, else 1 (where ``best_of`` may
        only be ``n``); a stream with beam search is refused (whole beams are known only at the end)."""
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise BeamSearchError("best_of", "only with use_beam_search, as the beam width")
            return 1
        if self.stream:
            raise BeamSearchError("stream", "beam search cannot stream: its beams are known only at the end")
        if self.best_of is not None and self.best_of < self.n:
            raise BeamSearchError("best_of", f"the beam width must be at least n={self.n}, got {self.best_of}")
        return self.best_of or self.n

    def sampling(self, logprobs: int | None) -> dict[str, Any]:
        """The :class:`constrain.sampler.SamplingParams` fields given (validated when the request is built)."""
        fields = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "seed")  # fmt: skip
        out = {name: getattr(self, name) for name in fields if getattr(self, name) is not None}
        if self.seed is not None and self.seed < 0:
            out["seed"] = self.seed % 2**63  # the sampler's seeds are 63-bit: a negative one stands for its residue
        if self.logit_bias:
            try:
                out["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError as err:
                raise FieldError("logit_bias", "keys are token ids (integers as strings)") from err
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    def thinking(self) -> Any:
        """The ``reasoning=`` of the request: ``reasoning`` as given, else from ``reasoning_effort``."""
        if self.reasoning is not None and self.reasoning_effort is not None:
            raise FieldError("reasoning_effort", "pass reasoning or reasoning_effort, not both")
        if self.reasoning_effort is not None:
            budget = REASONING_EFFORT[self.reasoning_effort]
            return {"max_tokens": budget} if budget else None
        return self.reasoning

    def request(self, prompt: Any, max_tokens: int | None, logprobs: int | None, **constraint: Any) -> Request:
        vllm = self.vllm_constraint()
        if vllm is not None:  # the only constraint (check)
            constraint = {"constraint": vllm}
        return Request(
            prompt,
            max_tokens=max_tokens,
            stop=self.stop,
            n=self.n,
            num_beams=self.beam_width(),
            length_penalty=self.length_penalty,
            sampling=self.sampling(logprobs),
            regex=self.regex,
            grammar=self.grammar,
            choices=self.choices,
            reasoning=self.thinking(),
            **constraint,
        )


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = Field(default=True, strict=True)

    def constraint_fields(self) -> list[str]:
        """:meth:`_Common.constraint_fields`, then ``response_format`` where it constrains (a type but text)."""
        fmt = self.response_format
        return super().constraint_fields() + (["response_format"] if fmt is not None and fmt.type != "text" else [])

    def check(self) -> None:
        """:meth:`_Common.check`, and the chat fields that depend on others."""
        super().check()
        if _given(self, "top_logprobs") and not self.logprobs:
            raise FieldError("top_logprobs", "only with logprobs: true")
        if _given(self, "max_completion_tokens") and _given(self, "max_tokens"):
            if self.max_tokens != self.max_completion_tokens:
                raise FieldError("max_tokens", "differs from max_completion_tokens: pass max_completion_tokens alone")
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if _given(self, name):
                    raise FieldError(name, "only with tools")
        fmt = self.response_format
        if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
            raise FieldError("response_format.json_schema", f"only with type json_schema, not {fmt.type}")
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise FieldError("response_format.json_schema", 'type json_schema needs it: {"name": ..., "schema": ...}')


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, texts, token ids, lists of token ids
    logprobs: int | None = Field(default=None, ge=0, le=5, strict=True)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles a chat message may have (OpenAI's)."""


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with content parts joined into text; :class:`FieldError` naming the message's field for
    an unknown role, a missing or non-text content (an assistant's calls stand for its content), or a tool
    result without the id of its call."""
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise FieldError(f"messages.{i}.role", "a message needs a role (a string)")
        if role not in ROLES:
            raise FieldError(f"messages.{i}.role", f"unknown role {role!r}: one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise FieldError(f"messages.{i}.content", "a message needs content (a string or text parts)")
        if content is not None and not isinstance(content, (str, list)):
            raise FieldError(f"messages.{i}.content", "content is a string or a list of text parts")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise FieldError(f"messages.{i}.tool_call_id", "a tool message needs the id of the call it answers")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise FieldError(f"messages.{i}.content.{j}", "only text parts are supported")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        out.append({**message, "content": content})
    return out


def chat_requests(body: ChatCompletionRequest, handle: ModelHandle) -> tuple[Request, ToolCalling | None]:
    """The generation request of a chat completion, and its tools (None without tools). Raises
    :class:`FieldError` (or :class:`BeamSearchError`) for a field it cannot honour."""
    body.check()
    messages = _text_messages(body.messages)
    tools = None
    constraint: dict[str, Any] = {}
    if body.tools:
        try:
            tools = tool_calling(
                body.tools,
                tool_choice=body.tool_choice or "auto",
                parallel_tool_calls=body.parallel_tool_calls,
                format=handle.name,
            )
        except ToolError:
            raise  # (it names its field)
        except ValueError as err:  # tool_choice's shape (parallel_tool_calls is a bool here already)
            raise FieldError("tool_choice", str(err)) from err
        prompt: Any = tools.prompt(handle, messages)
        if tools.constraint() is not None:
            given = body.constraint_fields()  # at most one (check)
            if given:
                raise FieldError(given[0], f"callable tools take no {given[0]}: set tool_choice 'none'")
            constraint["constraint"] = tools.constraint()
    else:
        prompt = messages
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        constraint["constraint"] = json_object()
    elif fmt is not None and fmt.json_schema is not None:  # type json_schema (check() pairs the two)
        if fmt.json_schema.schema_ is None:  # any JSON object, never any JSON value (the module docstring)
            constraint["constraint"] = json_object()
        else:
            constraint["schema"] = json_schema(fmt.json_schema.schema_, lenient=not fmt.json_schema.strict)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return body.request(prompt, body.max_completion_tokens or body.max_tokens, logprobs, **constraint), tools


def completion_requests(body: CompletionRequest) -> list[Request]:
    """One generation request per prompt. Raises :class:`FieldError` (or :class:`BeamSearchError`) for a
    field it cannot honour."""
    body.check()
    given = body.prompt
    single = isinstance(given, str) or (bool(given) and all(isinstance(t, int) for t in given))
    prompts: list[Any] = [given] if single else list(given)
    if not prompts or any(not p for p in prompts):
        raise FieldError("prompt", "no prompt given" if not prompts else "an empty list of token ids")
    return [body.request(p, body.max_tokens, body.logprobs) for p in prompts]


def request_labels(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The ``user`` and ``metadata`` given (empty when neither), for the server to log with the request id."""
    return {name: getattr(body, name) for name in ("user", "metadata") if _given(body, name)}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _number(value: float) -> float:
    """A logprob as OpenAI's number: 0.0 for NaN (a token the termination budget put in place of the drawn
    one, whose own logprob is unknown: the budget left no other), and -9999.0 for -inf (no probability)."""
    return 0.0 if math.isnan(value) else max(value, -9999.0)


def _token_bytes(handle: ModelHandle) -> Sequence[bytes]:
    """Per token id, its bytes (a token that is part of a character holds part of its UTF-8 bytes, where
    its decoded text is U+FFFD); empty for special tokens."""
    info = tokenizer_info(handle.tokenizer, vocab_size=handle.vocab_size, eos_token_ids=list(handle.eos_token_ids))
    return token_texts(info).texts


def chat_logprobs(handle: ModelHandle, ids: list[int], logprobs: list[float], tops: list[dict[int, float]]) -> Any:
    """OpenAI's ``choice.logprobs`` of a chat completion, for tokens ``ids``: ``bytes`` are the token's
    own (they join into the UTF-8 of the text where one token holds part of a character)."""
    pieces = _token_bytes(handle)

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = handle.tokenizer.decode([token])
        raw = pieces[token] if token < len(pieces) and pieces[token] else text.encode()
        return {"token": text, "logprob": _number(logprob), "bytes": list(raw)}

    content = []
    for k, token in enumerate(ids):
        top = tops[k] if k < len(tops) else {}
        content.append({**entry(token, logprobs[k]), "top_logprobs": [entry(t, lp) for t, lp in top.items()]})
    return {"content": content}


def completion_logprobs(
    handle: ModelHandle, ids: list[int], logprobs: list[float], tops: list[dict[int, float]]
) -> Any:
    """OpenAI's ``choice.logprobs`` of a (legacy) completion."""
    tokens = [handle.tokenizer.decode([t]) for t in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [_number(lp) for lp in logprobs[: len(ids)]],
        "top_logprobs": [  # one per token, as ``tokens`` (empty where none was asked for)
            {handle.tokenizer.decode([t]): _number(lp) for t, lp in (tops[k] if k < len(tops) else {}).items()}
            for k in range(len(ids))
        ],
        "text_offset": offsets,
    }


def delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """One ``delta.tool_calls`` entry of a stream chunk."""
    if delta.name is not None:
        return {"index": delta.index, **tool_call_json(delta.id or "", delta.name, delta.arguments)}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def chat_message(reply: AssistantReply, reasoning: str | None = None) -> dict[str, Any]:
    """OpenAI's assistant ``message`` of a chat completion's choice (a fresh dict): ``content`` is null
    beside tool calls when the reply has no free text; ``reasoning_content`` when ``reasoning`` is given."""
    content = reply.content or None if reply.tool_calls else reply.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if reply.tool_calls:
        message["tool_calls"] = [call.openai() for call in reply.tool_calls]
    return message


def finish_fields(result: GenerationResult, reply: ParsedReply | None) -> dict[str, Any]:
    """A choice's ``finish_reason`` (:func:`constrain.tools.reply.finish_reason`), except that a result the
    budget closed that is complete and valid (``reply`` too) finishes with ``"stop"`` or, after calls,
    ``"tool_calls"``; with ``closed_early`` and ``forced_tokens`` whenever the budget closed it (see the
    module docstring)."""
    reason = finish_reason(result, reply)
    if not result.closed_early:
        return {"finish_reason": reason}
    if result.valid and (reply is None or reply.valid):
        reason = "tool_calls" if reply is not None and reply.tool_calls else "stop"
    return {"finish_reason": reason, "closed_early": True, "forced_tokens": result.forced_tokens}


def usage_json(prompt: int, results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's ``usage``: ``prompt`` tokens (each prompt counted once, whatever ``n``) and the completions'."""
    completion = sum(r.usage.completion_tokens for r in results)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    reasoning = sum(r.usage.reasoning_tokens for r in results)
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def envelope(kind: str, request_id: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
