"""What a request says its output must look like: constraint values, and JSON Schema preparation."""

from constrain.constraints.constraint import (
    MODES,
    Choice,
    Constraint,
    EmbeddedJson,
    Grammar,
    JsonSchema,
    Mode,
    PydanticSchemas,
    Regex,
    Whitespace,
    choice,
    grammar,
    json_object,
    json_schema,
    regex,
)
from constrain.constraints.schema import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SINGLE_SCHEMAS,
    CoverageEntry,
    Status,
    prepare,
)
from constrain.constraints.schema_refs import resolve_local

__all__ = [
    "MODES",
    "SCHEMA_LISTS",
    "SCHEMA_MAPS",
    "SINGLE_SCHEMAS",
    "Choice",
    "Constraint",
    "CoverageEntry",
    "EmbeddedJson",
    "Grammar",
    "JsonSchema",
    "Mode",
    "PydanticSchemas",
    "Regex",
    "Status",
    "Whitespace",
    "choice",
    "grammar",
    "json_object",
    "json_schema",
    "prepare",
    "regex",
    "resolve_local",
]
