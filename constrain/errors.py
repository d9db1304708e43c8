"""The exception hierarchy of ``constrain``: every user error derives from :class:`ConstraintError`.

Errors are raised when a constraint is built or compiled, never mid-generation;
each names its culprit (a JSON pointer, a regex position, a grammar line and column).
"""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "CompileError",
    "ConstraintError",
    "ContextWindowError",
    "GrammarError",
    "RegexError",
    "SchemaError",
    "ToolError",
    "UnsatisfiableSchemaError",
    "UnsupportedSchemaError",
]


class ConstraintError(Exception):
    """Base class of the errors ``constrain`` raises for a bad constraint."""


class SchemaError(ConstraintError, ValueError):
    """The JSON Schema is malformed. ``pointer`` is the JSON pointer of the culprit."""

    def __init__(self, message: str, pointer: str = "") -> None:
        self.pointer = pointer
        super().__init__(f"invalid JSON Schema at '{pointer or '/'}': {message}")


class UnsatisfiableSchemaError(SchemaError):
    """The JSON Schema admits no value at all: preparation proves it
    (:mod:`constrain.constraints.schema_unsatisfiable`).

    ``pointer`` is the JSON pointer of the keyword that leaves no value (``/oneOf``,
    ``/properties/a/minimum``...), ``reason`` says why. Raised in strict and lenient mode alike: no
    output is valid, so there is nothing to approximate. A :class:`SchemaError`, so a server answers 400.
    """

    def __init__(self, reason: str, pointer: str = "") -> None:
        self.reason = reason
        self.pointer = pointer
        ConstraintError.__init__(self, f"the schema admits no value: at '{pointer or '/'}': {reason}")


class UnsupportedSchemaError(ConstraintError):
    """A keyword can be neither enforced by the grammar nor checked afterwards (strict mode).

    ``keyword`` and ``pointer`` name it; ``json_schema(..., lenient=True)`` turns
    the refusal into a reported approximation.
    """

    def __init__(self, keyword: str, pointer: str, reason: str) -> None:
        self.keyword = keyword
        self.pointer = pointer
        super().__init__(
            f"unsupported JSON Schema keyword '{keyword}' at '{pointer or '/'}': {reason} "
            "(json_schema(..., lenient=True) accepts it as a reported approximation)"
        )


class RegexError(ConstraintError, ValueError):
    """The regular expression is malformed or uses a feature the engine lacks; ``position`` is 0-based."""

    def __init__(self, pattern: str, message: str, position: int | None = None) -> None:
        self.pattern = pattern
        self.position = position
        where = f" at position {position}" if position is not None else ""
        super().__init__(f"invalid regex {pattern!r}{where}: {message}")


class GrammarError(ConstraintError, ValueError):
    """The EBNF grammar is malformed; ``line`` and ``column`` are 1-based when known."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        self.line = line
        self.column = column
        where = f" at line {line}, column {column}" if line is not None else ""
        super().__init__(f"invalid grammar{where}: {message}")


class CompileError(ConstraintError):
    """The grammar engine could not compile the constraint (or ran past the time budget)."""


class BudgetError(ConstraintError, ValueError):
    """No output the constraint accepts fits in ``max_tokens``: raised before generating."""


class ToolError(ConstraintError, ValueError):
    """A tool definition is malformed (its name, its source, its ``parameters`` schema), two tools share
    a name, or ``tool_choice`` names no given tool. ``tool`` names the culprit ("" when it has no name);
    a schema error is chained as ``__cause__`` (a :class:`SchemaError` keeps its ``pointer``)."""

    def __init__(self, tool: str, message: str, field: str = "tools") -> None:
        self.tool = tool
        self.field = field  # the request's field at fault, on the server: ``tools`` or ``tool_choice``
        super().__init__(f"tool {tool!r}: {message}" if tool else f"tool definition: {message}")


class ReasoningError(ConstraintError, ValueError):
    """A ``reasoning=`` option that cannot be used: a bad key or value, or a thinking budget the tags
    alone fill (names the key)."""


class BeamSearchError(ConstraintError, ValueError):
    """An argument beam search cannot take; ``field`` names it (a server's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ContextWindowError(ValueError):
    """A request the model's context window cannot hold: the prompt fills it (``field`` ``"prompt"``), or
    ``max_tokens`` does not fit beside the prompt (``field`` ``"max_tokens"``: a server's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)
