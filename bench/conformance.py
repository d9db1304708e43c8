"""JSON Schema Test Suite (draft 2020-12) counts for constrain with the SmolLM2 tokenizer.

Usage: ``python bench/conformance.py [--list]`` (``--list`` prints every rejected valid instance and refusal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.testing import run_conformance  # noqa: E402

SUITE = (
    Path(__file__).resolve().parents[2] / "shared" / "conformance" / "JSON-Schema-Test-Suite" / "tests" / "draft2020-12"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    print(machine_line())
    if not SUITE.is_dir():
        sys.exit(f"the suite is not at {SUITE}")
    counts = run_conformance(SUITE, constrain.load_tokenizer())
    print(
        "| schemas | refused | valid accepted | valid rejected | invalid rejected by the mask "
        "| invalid flagged by validate | invalid unflagged |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {counts.schemas} | {counts.refused} | {counts.valid_accepted} | {counts.valid_rejected} "
        f"| {counts.invalid_rejected} | {counts.invalid_flagged} | {counts.invalid_unflagged} |"
    )
    if args.list:
        print("\nRejected valid instances:\n" + "\n".join(counts.rejected))
        print("\nRefused schemas:\n" + "\n".join(counts.refusals))


if __name__ == "__main__":
    main()
