"""Helpers for tests and benchmarks: MaskBench-style walks, conformance and differential runs, a local server.

One module a job: :mod:`~constrain.testing.matching` (feeding text through a matcher),
:mod:`~constrain.testing.workloads` (sample schemas), :mod:`~constrain.testing.conformance` (the JSON
Schema Test Suite), :mod:`~constrain.testing.server` (a local server), and for differential runs
:mod:`~constrain.testing.subschemas`, :mod:`~constrain.testing.jsontext`,
:mod:`~constrain.testing.instances` and :mod:`~constrain.testing.differential`.
The APIs in this package serve testing and measurement and are prone to change.
"""

from constrain.testing.conformance import ConformanceCounts, run_conformance
from constrain.testing.differential import (
    DIFFERENTIAL_ENGINES,
    DIFFERENTIAL_MODES,
    DifferentialCounts,
    run_differential,
)
from constrain.testing.instances import (
    UNDECLARED_KEY,
    ComparedText,
    hypothesis_instances,
    mode_texts,
    mutations,
    text_mutations,
)
from constrain.testing.jsontext import json_context, structural_characters
from constrain.testing.matching import Verdicts, accepts, allowed_ids, token_ids, walk
from constrain.testing.server import LocalServer
from constrain.testing.subschemas import alternatives, member_schemas, schema_ordered, subtree, walk_values
from constrain.testing.workloads import PERSON_SCHEMA, TERMINATION_WORKLOADS, WEATHER_TOOL

__all__ = [
    "DIFFERENTIAL_ENGINES",
    "DIFFERENTIAL_MODES",
    "PERSON_SCHEMA",
    "TERMINATION_WORKLOADS",
    "UNDECLARED_KEY",
    "WEATHER_TOOL",
    "ComparedText",
    "ConformanceCounts",
    "DifferentialCounts",
    "LocalServer",
    "Verdicts",
    "accepts",
    "allowed_ids",
    "alternatives",
    "hypothesis_instances",
    "json_context",
    "member_schemas",
    "mode_texts",
    "mutations",
    "run_conformance",
    "run_differential",
    "schema_ordered",
    "structural_characters",
    "subtree",
    "text_mutations",
    "token_ids",
    "walk",
    "walk_values",
]
