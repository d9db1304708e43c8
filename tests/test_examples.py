"""Every example runs to completion as a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    result = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "an example should show what it did"
    if path.name == "sampler_demo.py":
        assert "same tokens as in the batch: True" in result.stdout
