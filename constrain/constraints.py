"""What a request says its output must look like: immutable, hashable constraint values.

Constructors validate their input at once (a malformed schema, regex or grammar
raises a :class:`~constrain.errors.ConstraintError` naming the culprit) and do no
tokenizer-dependent work; :func:`constrain.compile` does that, cached.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import jsonschema_rs
import regex as regex_module
import xgrammar as xgr

import grammars
from constrain.errors import GrammarError, RegexError, SchemaError

__all__ = [
    "Choice",
    "Constraint",
    "Grammar",
    "JsonSchema",
    "Regex",
    "Whitespace",
    "choice",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
]

Whitespace = Literal["single", "pretty", "compact"]
"""JSON whitespace policy, the number of whitespace characters allowed between two JSON tokens:
``"single"`` at most one (``json.dumps`` output: ``{"a": [1, 2]}``); ``"pretty"`` up to
``MAX_WHITESPACE`` (indented text); ``"compact"`` none (``{"a":[1,2]}``). Each bounds how
long a small model can loop on spaces."""

MAX_WHITESPACE = {"single": 1, "pretty": 16, "compact": 0}
"""Longest whitespace run per policy. ``"pretty"``'s 16 covers indented text 7 levels deep,
at a cost: measured on 25 MaskBench schemas with SmolLM2's tokenizer, a bound of 16 makes
the median mask 5x slower than a bound of 1 (8.1 vs 1.6 µs)."""


@dataclass(frozen=True, slots=True)
class JsonSchema:
    """A JSON Schema constraint (draft 2020-12).

    ``schema`` is the schema as compact JSON text (key order kept: it is the
    generation order under ``property_order="schema"``).
    """

    schema: str
    lenient: bool = False
    whitespace: Whitespace = "single"
    property_order: Literal["any", "schema"] = "any"
    closed: bool = False
    python_type: Any = field(default=None, compare=False, hash=False)  # the Pydantic model or type, if given

    @property
    def schema_value(self) -> Any:
        """The schema as a Python value (a fresh copy)."""
        return json.loads(self.schema)


@dataclass(frozen=True, slots=True)
class Regex:
    """The whole output must match ``pattern`` (Python ``regex`` syntax, a subset xgrammar supports)."""

    pattern: str


@dataclass(frozen=True, slots=True)
class Grammar:
    """An EBNF grammar (xgrammar's dialect, start rule ``root``); ``name`` when loaded from ``grammars/``."""

    ebnf: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The output is exactly one of ``options``."""

    options: tuple[str, ...]


Constraint = JsonSchema | Regex | Grammar | Choice
"""Any constraint value."""


def json_schema(
    schema: Any,
    *,
    lenient: bool = False,
    whitespace: Whitespace = "single",
    property_order: Literal["any", "schema"] | None = None,
    closed: bool | None = None,
) -> JsonSchema:
    """A JSON Schema constraint from a schema dict, JSON text, a Pydantic model class or a Python type.

    Python types (``int``, ``list[str]``, ``Literal[...]``, ``Enum``, ``TypedDict``,
    dataclasses, unions, ...) go through Pydantic's ``TypeAdapter``.

    Parameters
    ----------
    schema : dict, bool, str, Pydantic model class or Python type
    lenient : bool, default: False
        Strict refuses keywords that can be neither enforced nor checked
        (:class:`~constrain.errors.UnsupportedSchemaError`); lenient approximates
        them and reports it in ``compiled.coverage``.
    whitespace : {"single", "pretty", "compact"}, default: "single"
        See :data:`Whitespace`.
    property_order : {"any", "schema"} or None, default: None ("schema" for Python types, else "any")
        ``"any"`` accepts object properties in any order (every valid JSON
        text; the engine then also admits a key twice, which ``validate``
        reports); ``"schema"`` only in the schema's order, which forces keys
        during generation and never repeats one.
    closed : bool or None, default: None (True for Python types, False for schemas)
        ``False`` follows the specification: an object without
        ``additionalProperties`` accepts other keys (any value), an array
        without ``items`` any further items. ``True`` closes them, as OpenAI's
        strict mode does: the grammar compiles 10-20x faster and a model cannot
        wander into keys nobody asked for. A Python type's schema describes
        exactly the fields it reads (unless a Pydantic model allows extras).

    Raises
    ------
    SchemaError
        Malformed JSON text, or a schema that breaks the draft 2020-12 metaschema
        (the message names the JSON pointer).
    """
    python_type = None
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"not JSON text: {err.msg} (line {err.lineno}, column {err.colno})") from err
    elif isinstance(schema, (dict, bool)):
        value = schema
    else:
        value, python_type = _schema_of_type(schema), schema
    if not isinstance(value, (dict, bool)):
        raise SchemaError(f"a schema is an object or a boolean, got {type(value).__name__}")
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise SchemaError(f"the schema is not JSON: {err}") from err
    _check_schema(text)
    if whitespace not in MAX_WHITESPACE:
        raise ValueError(f'whitespace must be "single", "pretty" or "compact", got {whitespace!r}')
    if property_order is None:
        property_order = "schema" if python_type is not None else "any"
    if property_order not in ("any", "schema"):
        raise ValueError(f'property_order must be "any" or "schema", got {property_order!r}')
    if closed is None:
        closed = python_type is not None and getattr(python_type, "model_config", {}).get("extra") != "allow"
    return JsonSchema(text, lenient, whitespace, property_order, closed, python_type)


def _is_python_regex(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


@functools.cache
def _metaschema() -> Any:
    """The draft 2020-12 metaschema as a jsonschema-rs validator, with ``regex`` checked by Python's ``re``
    as python-jsonschema does (it then agrees with ``check_schema`` on all 6,101 schemas of MaskBench and
    the JSON Schema Test Suite; measured)."""
    return jsonschema_rs.Draft202012Validator(
        jsonschema.Draft202012Validator.META_SCHEMA, validate_formats=True, formats={"regex": _is_python_regex}
    )


@functools.lru_cache(maxsize=1024)
def _check_schema(text: str) -> None:
    """Validate against the draft 2020-12 metaschema (cached).

    jsonschema-rs decides (p99 0.25 ms on MaskBench, where python-jsonschema takes 96 ms); a schema it
    refuses goes through python-jsonschema, which has the last word and the error message.
    """
    value = json.loads(text)
    if _metaschema().is_valid(value):
        return
    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as err:
        pointer = "/" + "/".join(str(p) for p in err.path) if err.path else ""
        raise SchemaError(err.message, pointer) from err


def _schema_of_type(tp: Any) -> Any:
    import pydantic

    try:
        if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
            return tp.model_json_schema()
        return pydantic.TypeAdapter(tp).json_schema()
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as err:
        raise SchemaError(f"cannot derive a JSON Schema from {tp!r}: {err}") from err


def json_object(*, whitespace: Whitespace = "single") -> JsonSchema:
    """Any JSON object."""
    return json_schema({"type": "object"}, whitespace=whitespace)


_XGR_POSITION = re.compile(r"at position (\d+): (.*)", re.S)
_XGR_LINE_COL = re.compile(r"at line (\d+), column (\d+): (.*)", re.S)


def _engine_message(err: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    return re.sub(r"^\[[^\]]*\] [^ ]+: ", "", str(err)).strip()


def regex(pattern: str) -> Regex:
    """The whole output must match ``pattern``.

    Raises
    ------
    RegexError
        A syntax error (with its position), or a feature the grammar engine
        lacks (lookaround, backreferences, ``\\p{...}``), with its position.
    """
    if not isinstance(pattern, str):
        raise ValueError(f"regex pattern must be a str, got {type(pattern).__name__}")
    try:
        regex_module.compile(pattern)
    except regex_module.error as err:
        raise RegexError(pattern, getattr(err, "msg", str(err)), getattr(err, "pos", None)) from err
    try:
        xgr.Grammar.from_regex(pattern)
    except RuntimeError as err:
        message = _engine_message(err)
        found = _XGR_POSITION.search(message)
        if found:
            raise RegexError(pattern, found.group(2).strip(), int(found.group(1))) from err
        raise RegexError(pattern, message) from err
    return Regex(pattern)


def grammar(ebnf_or_name: str) -> Grammar:
    """An EBNF grammar, or the name of one shipped in ``grammars/`` (``grammars.available()``).

    Raises
    ------
    GrammarError
        A syntax error or an undefined rule, with line and column.
    """
    if not isinstance(ebnf_or_name, str):
        raise ValueError(f"grammar must be EBNF text or a grammar name, got {type(ebnf_or_name).__name__}")
    name = None
    if re.fullmatch(r"[A-Za-z_][\w-]*", ebnf_or_name):
        try:
            name, ebnf = ebnf_or_name, grammars.load(ebnf_or_name)
        except KeyError as err:
            raise GrammarError(str(err.args[0])) from err
    else:
        ebnf = ebnf_or_name
    try:
        xgr.Grammar.from_ebnf(ebnf)
    except RuntimeError as err:
        message = _engine_message(err)
        found = _XGR_LINE_COL.search(message)
        if found:
            raise GrammarError(found.group(3).strip(), int(found.group(1)), int(found.group(2))) from err
        raise GrammarError(message) from err
    return Grammar(ebnf, name)


def choice(options: Any) -> Choice:
    """The output is exactly one of ``options`` (a non-empty sequence of distinct strings).

    Raises
    ------
    ValueError
        No options, a non-string option, or a duplicate.
    """
    if isinstance(options, str):
        raise ValueError("choice() takes a sequence of strings, not one string")
    opts = tuple(options)
    if not opts:
        raise ValueError("choice() needs at least one option")
    for i, opt in enumerate(opts):
        if not isinstance(opt, str):
            raise ValueError(f"choice option {i} is {type(opt).__name__}, not str: {opt!r}")
    if len(set(opts)) != len(opts):
        dup = next(o for o in opts if opts.count(o) > 1)
        raise ValueError(f"choice option {dup!r} appears twice")
    return Choice(opts)
