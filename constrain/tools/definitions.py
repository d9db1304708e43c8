"""Tools: :class:`Tool`, built by :func:`tool` from an OpenAI definition, a Pydantic model class or a function.

A tool's arguments are a JSON object whose schema goes through the same strict preparation as
``json_schema()`` constraints (objects closed, keys in schema order), so a schema that cannot be
enforced is refused when the tool is built, not when a reply's grammar is compiled.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic

from constrain.compiler.json_schema import json_schema_ebnf
from constrain.constraints.constraint import JsonSchema, PydanticSchemas, json_schema
from constrain.errors import ConstraintError, ToolError
from constrain.match.validate import parse_json, schema_violations

__all__ = ["MODES", "TOOL_NAME", "Tool", "tool"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tool name, as OpenAI allows it (which also keeps it free of JSON escapes), except the ``MODES``."""

MODES = ("none", "auto", "required")
"""The ``tool_choice`` values that name no tool."""


class _NoTitles(PydanticSchemas):
    """Pydantic's schemas (decimals as numbers) without the titles it derives from field names (noise in a
    prompt)."""

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
        A malformed definition (a field OpenAI's has not, too), a name OpenAI would refuse (1 to 64
        letters, digits, ``_``, ``-``), a function parameter without a type hint or not passable by
        keyword, or arguments whose schema is malformed or unsupported (the schema error, with its JSON
        pointer, is the cause).
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
        json_schema_ebnf(constraint)  # strict-mode refusals and dangling $refs surface here, not at compile
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


_FIELDS = frozenset({"name", "description", "parameters", "strict"})
"""The fields of an OpenAI function definition (``strict``: constrain's calls always are)."""


def _definition(source: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(name, description, parameters) of an OpenAI tool definition."""
    function = source.get("function")
    label = str(function.get("name", "")) if isinstance(function, dict) else ""
    if source.get("type") != "function" or not isinstance(function, dict):
        raise ToolError(label, 'a tool definition is {"type": "function", "function": {"name": ..., ...}}')
    unknown = sorted(set(source) - {"type", "function"}) + [f"function.{k}" for k in sorted(set(function) - _FIELDS)]
    if unknown:
        raise ToolError(label, f"unknown field {unknown[0]!r} in the definition (a function has {', '.join(_FIELDS)})")
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
