"""Every example runs to completion as a test, and shows what it claims (a pattern per example)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import constrain

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))

SHOWS: dict[str, list[str]] = {
    "batch_mixed.py": [r"(?s)(valid=True.*){4}"],
    "beam_search.py": [r"answer: (yes|no|maybe)\n", r"value: \{'city': '[^']+', 'country': '[^']+'\}"],
    "classify_and_match.py": [
        r"sentiment: (positive|negative|neutral)\n",
        r"date: \d{4}-\d{2}-\d{2}\n",
        r"streamed: \d+\n",
    ],
    "constrain_masks.py": [
        r"accepted token by token; the grammar can end: True",
        r"200 is greater than the maximum of 150",
    ],
    "extract_person.py": [r"Person\(name='[^']+', age=\d+, city='[^']+'\) stop"],
    "reasoning.py": [r"thinking: \S.*\n", r"answer: +\{\"apples\": \d+\} -> Answer\(apples=\d+\)"],
    "sampler_demo.py": [r"same tokens as in the batch: True"],
    "stream_partial.py": [r"/name = '[^']+'\n", r"\(the whole value\) = Person\(", r"done \(stop\): Person\("],
    "tools.py": [r"get_weather\(\{'city': '[^']+'"],
}
"""What each example's output must show (regexes); every example must have an entry."""


@pytest.mark.real_model
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_and_shows_what_it_claims(path: Path) -> None:
    try:
        constrain.load_tokenizer("smollm2-135m-instruct")  # (the examples run the default model)
    except constrain.ModelNotFoundError as err:
        pytest.skip(f"the default model's package is not installed: {err}")
    assert path.name in SHOWS, f"add what {path.name} shows to SHOWS"
    result = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for pattern in SHOWS[path.name]:
        assert re.search(pattern, result.stdout), f"{path.name} should show {pattern!r}; it printed:\n{result.stdout}"
