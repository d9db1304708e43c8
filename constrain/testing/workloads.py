"""Sample schemas and workloads shared by tests and benchmarks.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PERSON_SCHEMA", "TERMINATION_WORKLOADS", "WEATHER_TOOL"]


TERMINATION_WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "unbounded array": (
        "Describe a person named John Doe as JSON with a name and tags.",
        {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
         "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False},
    ),
    "deep nesting": (
        "Give a company with departments, each with teams of people, as JSON.",
        {"type": "object", "properties": {"company": {"type": "object", "properties": {"departments": {"type": "array",
         "items": {"type": "object", "properties": {"name": {"type": "string"}, "teams": {"type": "array", "items": {
         "type": "object", "properties": {"lead": {"type": "string"}, "members": {"type": "array", "items": {
         "type": "string"}}}, "required": ["lead", "members"], "additionalProperties": False}}},
         "required": ["name", "teams"], "additionalProperties": False}}}, "required": ["departments"],
         "additionalProperties": False}}, "required": ["company"], "additionalProperties": False},
    ),
    "long strings": (
        "Write a detailed biography of Ada Lovelace as JSON with a summary and a long biography.",
        {"type": "object", "properties": {"summary": {"type": "string"}, "biography": {"type": "string"}},
         "required": ["summary", "biography"], "additionalProperties": False},
    ),
    "recursive tree": (
        "Give the file tree of a Python project as JSON: each node has a name and children.",
        {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array",
         "items": {"$ref": "#/$defs/node"}}}, "required": ["name", "children"], "additionalProperties": False}},
         "$ref": "#/$defs/node"},
    ),
}  # fmt: skip
"""Chat prompt and schema of each workload that makes small models run on (no bounds): the default
model must still end every one of them valid within ``max_tokens`` (tests and ``bench/termination.py``)."""


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
"""A small extraction schema (server tests and benchmarks)."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
"""An OpenAI tool definition (server tests and benchmarks)."""
