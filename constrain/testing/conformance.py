"""The JSON Schema Test Suite run through compile, the masks and ``validate``: what is accepted,
blocked, flagged, refused.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from constrain.compiler.compiler import compile as compile_constraint
from constrain.constraints.constraint import json_schema
from constrain.errors import ConstraintError
from constrain.testing.matching import accepts

__all__ = ["ConformanceCounts", "run_conformance"]


@dataclass
class ConformanceCounts:
    """Outcome of running the JSON Schema Test Suite through compile + matcher (+ validate)."""

    schemas: int = 0
    refused: int = 0  # schemas refused at compile time (their instances are not counted below)
    valid_accepted: int = 0  # a valid instance passed every mask and the grammar could end
    valid_rejected: int = 0  # a valid instance the grammar blocked (incompleteness, not unsafety)
    invalid_rejected: int = 0  # an invalid instance the mask blocked
    invalid_flagged: int = 0  # an invalid instance the mask let through but validate() flagged
    invalid_unflagged: int = 0  # an invalid instance neither blocked nor flagged: must stay 0
    unflagged: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def run_conformance(suite_dir: Path, tokenizer: Any, *, files: list[str] | None = None) -> ConformanceCounts:
    """Run every test of ``suite_dir/*.json`` (the suite's layout) with both compact and default ``json.dumps``."""
    counts = ConformanceCounts()
    for path in sorted(suite_dir.glob("*.json")):
        if files is not None and path.name not in files:
            continue
        for group in json.loads(path.read_text()):
            counts.schemas += 1
            where = f"{path.name}: {group['description']}"
            try:
                compiled = compile_constraint(json_schema(group["schema"], mode="specification"), tokenizer)
            except ConstraintError as err:
                counts.refused += 1
                counts.refusals.append(f"{where}: {err}")
                continue
            for test in group["tests"]:
                for text in (json.dumps(test["data"], separators=(",", ":")), json.dumps(test["data"])):
                    ok = accepts(compiled, tokenizer, text)
                    if test["valid"]:
                        counts.valid_accepted += ok
                        counts.valid_rejected += not ok
                        if not ok:
                            counts.rejected.append(f"{where} / {test['description']}: {text}")
                    elif not ok:
                        counts.invalid_rejected += 1
                    elif compiled.validate(text):
                        counts.invalid_flagged += 1
                    else:
                        counts.invalid_unflagged += 1
                        counts.unflagged.append(f"{where} / {test['description']}: {text}")
    return counts
