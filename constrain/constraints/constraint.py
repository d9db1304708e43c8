"""What a request says its output must look like: immutable, hashable constraint values.

Constructors validate their input at once (a malformed schema, regex or grammar
raises a :class:`~constrain.errors.ConstraintError` naming the culprit) and do no
tokenizer-dependent work; :func:`constrain.compile` does that, cached.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import jsonschema_rs
import regex as regex_module
from pydantic.json_schema import GenerateJsonSchema

from constrain import grammars
from constrain.backends import xgrammar
from constrain.caches import bounded
from constrain.constraints.schema import prepared_schema
from constrain.errors import GrammarError, RegexError, SchemaError

__all__ = [
    "MODES",
    "Choice",
    "Constraint",
    "EmbeddedJson",
    "Grammar",
    "JsonSchema",
    "Mode",
    "PydanticSchemas",
    "Regex",
    "Whitespace",
    "choice",
    "engine_regex",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
]

Whitespace = Literal["dumps", "compact", "single", "pretty"]
"""JSON whitespace policy. Fixed formatting, nothing sampled: ``"dumps"`` exactly ``json.dumps``'s
default separators, ``", "`` and ``": "`` and no other whitespace (``{"a": [1, 2]}``); ``"compact"``
none (``{"a":[1,2]}``). Sampled, bounded: ``"single"`` at most one whitespace character between two
JSON tokens; ``"pretty"`` up to ``MAX_WHITESPACE`` (indented text). Each bounds how long a small
model can loop on spaces."""

MAX_WHITESPACE = {"dumps": 0, "compact": 0, "single": 1, "pretty": 16}

SEPARATORS = {"dumps": (", ", ": "), "compact": (",", ":")}
"""The item and key separators of the fixed-formatting policies."""
"""Longest whitespace run per policy. ``"pretty"``'s 16 covers indented text 7 levels deep,
at a cost: measured on 25 MaskBench schemas with SmolLM2's tokenizer, a bound of 16 makes
the median mask 5x slower than a bound of 1 (8.1 vs 1.6 µs)."""


Mode = Literal["generation", "specification"]
"""How :func:`json_schema` reads what a schema leaves open (see :data:`MODES`)."""

PropertyOrder = Literal["any", "schema"]

MODES: dict[str, tuple[bool, PropertyOrder, Whitespace]] = {
    "generation": (True, "schema", "dumps"),
    "specification": (False, "any", "single"),
}
"""``(closed, property_order, whitespace)`` per mode.

``"generation"`` (the default) is exactly the schema the user wrote and nothing the model may choose
besides: objects closed unless the schema says what else may appear, keys in the schema's order,
``json.dumps`` formatting (``", "`` and ``": "``), so keys, colons and commas are forced text.
``"specification"`` follows JSON Schema to the letter (any key order, undeclared keys allowed, a
space or newline between tokens): every valid JSON text of the schema, for validation-style use
and MaskBench. Neither admits a duplicate key (see :mod:`constrain.match.keys`)."""


@dataclass(frozen=True, slots=True)
class JsonSchema:
    """A JSON Schema constraint (draft 2020-12); build it with :func:`json_schema`.

    ``schema`` is the schema as compact JSON text (key order kept: it is the
    generation order under ``property_order="schema"``).
    """

    schema: str
    lenient: bool = False
    whitespace: Whitespace = "compact"
    property_order: PropertyOrder = "schema"
    closed: bool = True
    python_type: Any = field(default=None, compare=False, hash=False)  # the Pydantic model or type, if given

    @property
    def schema_value(self) -> Any:
        """The schema as a Python value (a fresh copy)."""
        return json.loads(self.schema)


@dataclass(frozen=True, slots=True)
class Regex:
    """The whole output must match ``pattern`` (Python ``regex`` syntax, a subset xgrammar supports)."""

    pattern: str

    @property
    def engine_pattern(self) -> str:
        """``pattern`` as the grammar engines are given it, meaning what Python means by it
        (:func:`engine_regex`)."""
        return engine_regex(self.pattern)


@dataclass(frozen=True, slots=True)
class EmbeddedJson:
    """JSON values inside a grammar's text, each checked against a schema as it is written: after
    ``trigger`` has appeared, each ``opener + name + name_end`` starts a value of ``schemas[name]``.
    Tool calls (:mod:`constrain.tools.grammar`) spell their arguments so; the grammar holds each schema as a
    (possibly looser) rule, and the matcher enforces what the rule cannot (:mod:`constrain.match.values`)."""

    trigger: str
    opener: str
    name_end: str
    schemas: tuple[tuple[str, JsonSchema], ...]  # (name, the schema its values take)


@dataclass(frozen=True, slots=True)
class Grammar:
    """An EBNF grammar (xgrammar's dialect, start rule ``root``); ``name`` when loaded from ``grammars/``;
    ``embedded``: JSON values its text holds, checked beyond the grammar (see :class:`EmbeddedJson`)."""

    ebnf: str
    name: str | None = None
    embedded: EmbeddedJson | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The output is exactly one of ``options``."""

    options: tuple[str, ...]


Constraint = JsonSchema | Regex | Grammar | Choice
"""Any constraint value."""


def json_schema(
    schema: Any,
    *,
    mode: Mode = "generation",
    lenient: bool = False,
    whitespace: Whitespace | None = None,
    property_order: PropertyOrder | None = None,
    closed: bool | None = None,
) -> JsonSchema:
    """A JSON Schema constraint from a schema dict, JSON text, a Pydantic model class or a Python type.

    Python types (``int``, ``list[str]``, ``Literal[...]``, ``Enum``, ``TypedDict``,
    dataclasses, unions, ...) go through Pydantic's ``TypeAdapter``.

    Parameters
    ----------
    schema : dict, bool, str, Pydantic model class or Python type
    mode : {"generation", "specification"}, default: "generation"
        The defaults of the three options below (:data:`MODES`): generation decodes exactly what
        the schema declares, in its order, formatted compactly; specification admits every valid
        JSON text of the schema (MaskBench, validation-style use).
    lenient : bool, default: False
        Strict refuses keywords that can be neither enforced nor checked
        (:class:`~constrain.errors.UnsupportedSchemaError`); lenient approximates
        them and reports it in ``compiled.coverage``.
    whitespace : {"dumps", "compact", "single", "pretty"} or None, default: None (the mode's)
        See :data:`Whitespace`. ``"dumps"`` and ``"compact"`` fix the formatting, so nothing between
        two values is sampled; the others let the model choose whitespace at every JSON boundary.
    property_order : {"schema", "any"} or None, default: None (the mode's)
        ``"schema"``: declared keys only in the schema's order, which forces them during generation;
        ``"any"``: in any order (every valid JSON text).
    closed : bool or None, default: None (the mode's; a Pydantic model with ``extra="allow"`` is open)
        ``True`` closes every object that declares ``properties`` (or ``required``) and says
        nothing of other keys: no ``additionalProperties``, ``patternProperties``,
        ``unevaluatedProperties``, ``dependentSchemas`` (but one that only requires declared keys) or
        ``if``; and every array with
        ``prefixItems`` and no ``items``. As OpenAI's strict mode, xgrammar's ``strict_mode``,
        Outlines and llama.cpp do. An object or array the schema describes not at all
        (``{"type": "object"}``) stays any object or array. ``False`` follows the specification:
        undeclared keys are allowed with any value.

    Raises
    ------
    SchemaError
        Malformed JSON text, or a schema that breaks its draft's metaschema (the one its ``$schema``
        names; 2020-12's where it names none), or a dangling ``$ref``, the message naming the JSON
        pointer. Among them: :class:`~constrain.errors.UnsupportedSchemaError` (strict, and a keyword
        that can be neither enforced nor checked, as a remote ``$ref``) and
        :class:`~constrain.errors.UnsatisfiableSchemaError` (proven to admit no value).
    ValueError
        An unknown mode, whitespace policy or property order.
    """
    if mode not in MODES:
        raise ValueError(f'mode must be "generation" or "specification", got {mode!r}')
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
    default_closed, default_order, default_whitespace = MODES[mode]
    whitespace = default_whitespace if whitespace is None else whitespace
    property_order = default_order if property_order is None else property_order
    if whitespace not in MAX_WHITESPACE:
        raise ValueError(f'whitespace must be "dumps", "compact", "single" or "pretty", got {whitespace!r}')
    if property_order not in ("any", "schema"):
        raise ValueError(f'property_order must be "schema" or "any", got {property_order!r}')
    if closed is None:
        closed = default_closed and getattr(python_type, "model_config", {}).get("extra") != "allow"
    prepared_schema(text, lenient, closed)  # refused here, not at compile (which reads it again, memoized)
    return JsonSchema(text, lenient, whitespace, property_order, closed, python_type)


def _is_regex(pattern: object) -> bool:
    """Whether a ``pattern`` is a regex, as the ``regex`` module reads it: ECMA-262's ``\\p{L}`` too, which
    Python's ``re`` refuses (the value checks match such patterns with ``regex``)."""
    if not isinstance(pattern, str):
        return True
    try:
        regex_module.compile(pattern)
    except regex_module.error:
        return False
    return True


_META_FORMATS = jsonschema.FormatChecker()
_META_FORMATS.checks("regex")(_is_regex)


NATIVE_VALIDATORS: dict[str, Any] = {
    "Draft4Validator": jsonschema_rs.Draft4Validator,
    "Draft6Validator": jsonschema_rs.Draft6Validator,
    "Draft7Validator": jsonschema_rs.Draft7Validator,
    "Draft201909Validator": jsonschema_rs.Draft201909Validator,
    "Draft202012Validator": jsonschema_rs.Draft202012Validator,
}
"""jsonschema-rs's validator of each draft it has (not draft 3), by the name of ``jsonschema``'s."""


@bounded("constraints.metaschema", maxsize=8)
def _metaschema(draft: type[Any]) -> Any:
    """``draft``'s metaschema (a ``jsonschema`` validator class) as a jsonschema-rs validator, with ``regex``
    checked by :func:`_is_regex`, as the python-jsonschema check after it does (it then agrees with that
    check on all 6,101 schemas of MaskBench and the JSON Schema Test Suite; measured with Python's ``re``
    against 2020-12's)."""
    return NATIVE_VALIDATORS[draft.__name__](draft.META_SCHEMA, validate_formats=True, formats={"regex": _is_regex})


@bounded("constraints.checked_schemas", maxsize=1024)
def _check_schema(text: str) -> None:
    """Validate against the metaschema of the draft the schema's ``$schema`` names, 2020-12 where it names
    none, draft 3, or one ``jsonschema`` does not know (the output is validated under the draft named,
    :mod:`constrain.match.validate`), but for the rules 2020-12 dropped (:func:`_rule_2020_12_dropped`);
    cached.

    jsonschema-rs decides (p99 0.25 ms on MaskBench, where python-jsonschema takes 96 ms); a schema it
    refuses goes through python-jsonschema, which has the last word and the error message.
    """
    value = json.loads(text)
    draft = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
    if draft is jsonschema.Draft3Validator:  # too unlike the others for the walk to read (its `required: true`)
        draft = jsonschema.Draft202012Validator
    if _metaschema(draft).is_valid(value):
        return
    errors = draft(draft.META_SCHEMA, format_checker=_META_FORMATS).iter_errors(value)
    err = jsonschema.exceptions.best_match(e for e in errors if not _rule_2020_12_dropped(e))
    if err is not None:
        pointer = "/" + "/".join(str(p) for p in err.path) if err.path else ""
        raise SchemaError(err.message, pointer) from err


def _rule_2020_12_dropped(err: jsonschema.ValidationError) -> bool:
    """Whether a metaschema error is one of draft 4's (and 6's, 7's) rules that an ``enum`` or ``required``
    list be non-empty and without duplicates, which 2020-12 dropped, or an ``anyOf`` failing only by them
    in one of its branches (``items``: a schema or a list of them). Those rules change no instance's
    validity, and real schemas break them (three of MaskBench's draft 4 schemas repeat an ``enum`` value),
    so they are not held against a schema."""
    if err.validator in ("uniqueItems", "minItems"):
        return bool(err.path) and err.path[-1] in ("enum", "required")
    if err.validator != "anyOf" or not err.context:
        return False
    branches: dict[Any, list[jsonschema.ValidationError]] = {}
    for inner in err.context:
        branches.setdefault(inner.relative_schema_path[0], []).append(inner)
    return any(all(map(_rule_2020_12_dropped, errors)) for errors in branches.values())


class PydanticSchemas(GenerateJsonSchema):
    """pydantic's JSON schemas, with a ``Decimal``'s string form spelled as a number
    (``build_decimal_pattern``, ``max_digits`` and ``decimal_places`` included): pydantic's own schema
    lets a decimal be any string, which its validation then refuses, so a model could write
    ``"price": "cheap"``.

    A ``Decimal`` with bounds (``ge``, ``gt``, ``le``, ``lt``, ``multiple_of``) is a JSON number alone, held
    to them: no pattern can hold a string to them (pydantic's string branch would let ``"-5"`` stand for
    ``Field(ge=0)``). With ``max_digits`` and ``decimal_places`` both, the number is also held below
    ``10 ** (max_digits - decimal_places)`` in magnitude; its decimal places are checked after generation."""

    def get_decimal_pattern(self, schema: Any) -> str | None:
        return self.build_decimal_pattern(schema)

    def decimal_schema(self, schema: Any) -> Any:
        found = super().decimal_schema(schema)
        if self.mode != "validation" or all(schema.get(k) is None for k in ("ge", "gt", "le", "lt", "multiple_of")):
            return found
        number = dict(found["anyOf"][0])  # pydantic's number branch, with the bounds
        digits, places = schema.get("max_digits"), schema.get("decimal_places")
        if digits is not None and places is not None:
            limit = float(10 ** (digits - places))
            number["exclusiveMaximum"] = min(number.get("exclusiveMaximum", limit), limit)
            number["exclusiveMinimum"] = max(number.get("exclusiveMinimum", -limit), -limit)
        return number


def _schema_of_type(tp: Any) -> Any:
    import pydantic

    try:
        if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
            return tp.model_json_schema(schema_generator=PydanticSchemas)
        return pydantic.TypeAdapter(tp).json_schema(schema_generator=PydanticSchemas)
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as err:
        raise SchemaError(f"cannot derive a JSON Schema from {tp!r}: {err}") from err


def json_object(*, whitespace: Whitespace = "dumps") -> JsonSchema:
    """Any JSON object (no duplicate keys)."""
    return json_schema({"type": "object"}, whitespace=whitespace)


_ESCAPED_ANCHORS = {"A": "^", "Z": "$", "z": "$"}
"""Python's anchors at the text's start and end, which xgrammar reads as the letters: the engines get ``^`` and
``$`` (the whole output is matched, so each stands only where :func:`_misplaced_anchor` allows)."""
_GROUP_NAME = re.compile(r"\(\?P?<(?![=!])[^>]*>")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_OPEN_LOWER_BOUND = re.compile(r"\{,(\d+)\}")


def _lexemes(pattern: str) -> Iterator[tuple[int, str, bool]]:
    """``pattern``'s pieces in order, each with its offset and whether it stands inside a character class: an
    escape (two characters), a class's opening (``[`` or ``[^``, with a ``]`` right after it, which Python
    reads as a literal ``]``, as ``\\]``), or one character."""
    at, end, in_class = 0, len(pattern), False
    while at < end:
        ch = pattern[at]
        if ch == "\\" and at + 1 < end:
            yield at, pattern[at : at + 2], in_class
            at += 2
        elif ch == "[" and not in_class:
            opening = "[^" if pattern.startswith("[^", at) else "["
            yield at, opening, False
            at += len(opening)
            in_class = True
            if pattern.startswith("]", at):
                yield at, "\\]", True
                at += 1
        else:
            yield at, ch, in_class
            in_class = in_class and ch != "]"
            at += 1


@bounded("constraints.engine_regex", maxsize=256)
def engine_regex(pattern: str) -> str:
    """``pattern`` (a valid Python regex) in the dialect both engines read alike and as Python does:
    ``.`` outside classes becomes ``[^\\n]`` (xgrammar's ``.`` takes a newline, Python's does not),
    ``\\A``, ``\\Z`` and ``\\z`` become ``^`` and ``$`` (xgrammar reads them as the letters), a named
    group ``(?P<name>...)`` a plain one, ``{,n}`` ``{0,n}``, and a class's leading ``]`` ``\\]``. Pure,
    memoized."""
    out: list[str] = []
    skip_to = 0
    for at, piece, in_class in _lexemes(pattern):
        if at < skip_to:
            continue
        if in_class:
            out.append(piece)
        elif piece[0] == "\\" and piece[1:] in _ESCAPED_ANCHORS:
            out.append(_ESCAPED_ANCHORS[piece[1:]])
        elif piece == ".":
            out.append("[^\\n]")
        elif piece == "(" and (named := _GROUP_NAME.match(pattern, at)):
            out.append("(")
            skip_to = named.end()
        elif piece == "{" and (bound := _OPEN_LOWER_BOUND.match(pattern, at)):
            out.append(f"{{0,{bound.group(1)}}}")
            skip_to = bound.end()
        else:
            out.append(piece)
    return "".join(out)


def _lookaround_at(pattern: str) -> int | None:
    """The offset of the first look-around group (``(?=``, ``(?!``, ``(?<=``, ``(?<!``) of ``pattern``, or None."""
    return next(
        (
            at
            for at, piece, in_class in _lexemes(pattern)
            if piece == "(" and not in_class and _LOOKAROUND.match(pattern, at)
        ),
        None,
    )


def _misplaced_anchor(pattern: str) -> str | None:
    """Why ``pattern`` cannot be served: an anchor (``^``, ``$``, ``\\A``, ``\\Z``) where Python matches
    nothing (``a^b``), which the engines drop or refuse; None where every anchor stands at the start or the
    end of the whole match, or where Python's ``re`` cannot parse the pattern (the ``regex`` module's own
    syntax: the engines judge it; and on Python 3.10, whose ``re`` has no ``_parser``, no pattern is read)."""
    try:
        from re import _constants as sre  # type: ignore[attr-defined,unused-ignore]
        from re import _parser

        tree = _parser.parse(pattern)
    except Exception:
        return None
    starts = {sre.AT_BEGINNING, sre.AT_BEGINNING_STRING}
    ends = {sre.AT_END, sre.AT_END_STRING}

    def walk(items: list[tuple[Any, Any]], first: bool, last: bool) -> str | None:
        for index, (op, value) in enumerate(items):
            head = first and all(o is sre.AT and v in starts for o, v in items[:index])
            tail = last and all(o is sre.AT and v in ends for o, v in items[index + 1 :])
            if op is sre.AT and ((value in starts and not head) or (value in ends and not tail)):
                return "an anchor (^, $, \\A or \\Z) inside the pattern, where it matches nothing"
            if op is sre.BRANCH:
                found = next((w for branch in value[1] if (w := walk(list(branch), head, tail))), None)
            elif op is sre.SUBPATTERN:
                found = walk(list(value[-1]), head, tail)
            elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
                found = walk(list(value[-1]), False, False)
            else:
                found = None
            if found:
                return found
        return None

    return walk(list(tree), True, True)


_XGR_POSITION = re.compile(r"at position (\d+): (.*)", re.S)
_XGR_LINE_COL = re.compile(r"at line (\d+), column (\d+): (.*)", re.S)


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
    if (why := _misplaced_anchor(pattern)) is not None:
        raise RegexError(pattern, why)
    if (at := _lookaround_at(pattern)) is not None:
        raise RegexError(pattern, "look-around is not supported by the grammar engines", at)
    try:
        xgrammar.check_regex(engine_regex(pattern))
    except RuntimeError as err:
        raise _engine_refusal(pattern, err) from err
    return Regex(pattern)


def _engine_refusal(pattern: str, err: RuntimeError) -> RegexError:
    """The :class:`RegexError` of xgrammar's refusal ``err`` of ``pattern`` as the engines are given it
    (:func:`engine_regex`), with a position in ``pattern`` where xgrammar gives one there: the engine's
    pattern's positions are not the user's where it was rewritten."""
    own = engine_regex(pattern) == pattern
    if not own:
        try:
            xgrammar.check_regex(pattern)
        except RuntimeError as refused:  # refused as written too: read there
            err, own = refused, True
    message = xgrammar.engine_message(err)
    found = _XGR_POSITION.search(message)
    if found:
        return RegexError(pattern, found.group(2).strip(), int(found.group(1)) if own else None)
    return RegexError(pattern, message)


def grammar(ebnf_or_name: str) -> Grammar:
    """An EBNF grammar, or the name of one shipped in ``grammars/`` (``grammars.available()``).

    Raises
    ------
    GrammarError
        A syntax error or an undefined rule, with line and column; or a rule ``root`` reaches that matches
        no finite text (``x ::= "a" x``), by name.
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
        xgrammar.check_ebnf(ebnf)
    except RuntimeError as err:
        message = xgrammar.engine_message(err)
        found = _XGR_LINE_COL.search(message)
        if found:
            raise GrammarError(found.group(3).strip(), int(found.group(1)), int(found.group(2))) from err
        raise GrammarError(message) from err
    if endless := xgrammar.never_ending_rules(ebnf):
        raise GrammarError(
            f"rule {endless[0]!r} matches no finite text: each of its alternatives needs "
            f"{'itself' if len(endless) == 1 else 'one of ' + ', '.join(map(repr, endless))} again"
        )
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
    if not isinstance(options, Iterable):
        raise ValueError(f"choice() takes a sequence of strings, got {type(options).__name__}: {options!r}")
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
