"""The official JSON Schema Test Suite (draft 2020-12) through compile + matcher + validate.

Every instance is serialised compactly and with ``json.dumps`` defaults. An
invalid instance must be rejected by the mask or flagged by ``validate()``:
the test fails on any that is neither. Valid instances the grammar blocks and
refused schemas are counted (``python bench/conformance.py`` prints them all);
a floor on acceptance guards against regressions.
"""

from __future__ import annotations

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
