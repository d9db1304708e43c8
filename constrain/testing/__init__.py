"""Helpers for tests and benchmarks: MaskBench-style walks, conformance and differential runs, a local server."""

from constrain.testing.differential import (
    PERSON_SCHEMA,
    TERMINATION_WORKLOADS,
    WEATHER_TOOL,
    ConformanceCounts,
    LocalServer,
    accepts,
    allowed_ids,
    run_conformance,
    token_ids,
    walk,
)

__all__ = [
    "PERSON_SCHEMA",
    "TERMINATION_WORKLOADS",
    "WEATHER_TOOL",
    "ConformanceCounts",
    "LocalServer",
    "accepts",
    "allowed_ids",
    "run_conformance",
    "token_ids",
    "walk",
]
