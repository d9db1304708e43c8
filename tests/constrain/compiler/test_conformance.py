"""The official JSON Schema Test Suite (draft 2020-12) through compile + matcher + validate.

Every instance is serialised compactly and with ``json.dumps`` defaults. An
invalid instance must be rejected by the mask or flagged by ``validate()``:
the test fails on any that is neither. Valid instances the grammar blocks and
refused schemas are counted (``python bench/conformance.py`` prints them all);
a floor on acceptance guards against regressions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from constrain.testing import run_conformance

SUITE = (
    Path(__file__).resolve().parents[4] / "shared" / "conformance" / "JSON-Schema-Test-Suite" / "tests" / "draft2020-12"
)


@pytest.fixture(scope="module")
def counts(smol_tokenizer):
    if not SUITE.is_dir():
        pytest.skip(f"the JSON Schema Test Suite is not at {SUITE} (../shared beside the checkout)")
    return run_conformance(SUITE, smol_tokenizer)


def test_no_invalid_instance_passes_unflagged(counts):
    assert counts.invalid_unflagged == 0, "\n".join(counts.unflagged)


def test_valid_instances_are_accepted(counts):
    total = counts.valid_accepted + counts.valid_rejected
    assert total > 1000
    assert counts.valid_accepted / total >= 0.95, "\n".join(counts.rejected)
    assert counts.refused / counts.schemas <= 0.2, "\n".join(counts.refusals)


def test_only_schemas_without_a_valid_instance_are_refused_as_unsatisfiable(counts):
    """A schema the suite gives a valid instance must never be called unsatisfiable (issue 28's proofs)."""
    satisfiable = {
        f"{path.name}: {group['description']}: "
        for path in sorted(SUITE.glob("*.json"))
        for group in json.loads(path.read_text())
        if any(test["valid"] for test in group["tests"])
    }
    unsatisfiable = [r for r in counts.refusals if "the schema admits no value" in r]
    assert len(unsatisfiable) >= 10  # the suite's schemas that are empty on purpose (false, not {}, ...)
    assert not [r for r in unsatisfiable if any(r.startswith(where) for where in satisfiable)]
