"""Do xgrammar and llguidance enforce the same language for the same constraint? (issue 13)

For each MaskBench dev schema (a seeded sample), in both ``json_schema`` modes, compile with
``engine="xgrammar"`` and ``engine="llguidance"``; walk every text through both engines' masks
(``constrain.testing.matching.walk``, then ``is_completed``) and count where one accepts and the other
rejects. Texts: MaskBench's instances, a few drawn by hypothesis-jsonschema, and labelled
mutations of a valid one (see ``constrain.testing.differential.run_differential``). Disagreements are
classified by likely cause, with examples in the ``--out`` report.

Usage: ``python bench/differential.py [--sample N | --all] [--seed S] [--out report.json]``
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import multiprocessing as mp
import random
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.machine import machine_line  # noqa: E402
from constrain.testing.differential import DIFFERENTIAL_MODES, DifferentialCounts, run_differential  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
DEFAULT_SAMPLE = 300
"""Schemas in the default sample: about 8 minutes on this machine's 2 CPU cores, shared (400 took
10.5 min); ``--all`` runs the 5,640."""


def revision() -> str:
    """``git describe --always --dirty`` of the checkout (the engines' code changes under a long run)."""
    try:
        cwd = Path(__file__).resolve().parent
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              check=True, cwd=cwd).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"


def markdown(counts: dict[str, DifferentialCounts], *, header: str) -> str:
    """The counts table (per mode) and the per-cause table, as markdown."""
    lines = [header, ""]
    lines.append(
        "| mode | schemas | compiled by both | refused by xgrammar | refused by llguidance | texts compared "
        "| agreements | disagreements | xgrammar-only accepts | llguidance-only accepts | skipped texts |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in counts.values():
        lines.append(
            f"| {c.mode} | {c.schemas} | {c.compiled} | {c.refused['xgrammar']} | {c.refused['llguidance']} "
            f"| {c.texts} | {c.agreements} ({c.agreements / max(c.texts, 1):.2%}) | {c.disagreements} "
            f"| {c.xgrammar_only} | {c.llguidance_only} | {c.skipped} |"
        )
    lines += ["", "| mode | cause | xgrammar-only accepts | llguidance-only accepts | flagged by validate() |"]
    lines.append("|---|---|---|---|---|")
    for c in counts.values():
        for cause, tally in sorted(c.causes.items(), key=lambda item: -(item[1]["xgrammar"] + item[1]["llguidance"])):
            lines.append(f"| {c.mode} | {cause} | {tally['xgrammar']} | {tally['llguidance']} | {tally['validated']} |")
    for c in counts.values():
        if c.errors:
            lines += ["", f"{c.mode}: an engine raised on {len(c.errors)} texts, e.g. {c.errors[0]}"]
    return "\n".join(lines)


@functools.cache
def _tokenizer() -> Any:
    """SmolLM2's tokenizer, loaded once per process."""
    import constrain

    return constrain.load_tokenizer()


def _run(entry: dict[str, Any], options: dict[str, Any]) -> dict[str, DifferentialCounts]:
    return run_differential(entry["name"], entry["schema"], entry["tests"], _tokenizer(), **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--sample", type=int, default=DEFAULT_SAMPLE, help=f"a seeded sample of N schemas (default {DEFAULT_SAMPLE})"
    )
    group.add_argument("--all", action="store_true", help="every dev schema (5,640: hours on 2 cores)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sample and hypothesis (default 0)")
    parser.add_argument("--out", type=Path, default=None, help="write the counts and examples here (JSON)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--hypothesis", type=int, default=3, help="instances drawn per schema (default 3)")
    parser.add_argument("--compile-timeout", type=float, default=5.0, help="seconds per compile (default 5)")
    parser.add_argument("--max-chars", type=int, default=4000, help="longer texts are skipped (default 4000)")
    args = parser.parse_args()  # fmt: skip
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout): nothing to compare")

    from tqdm import tqdm

    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    if not args.all:
        entries = random.Random(args.seed).sample(entries, min(args.sample, len(entries)))
    options = {"hypothesis_count": args.hypothesis, "seed": args.seed, "compile_timeout_s": args.compile_timeout,
               "max_chars": args.max_chars}  # fmt: skip
    counts = {mode: DifferentialCounts(mode) for mode in DIFFERENTIAL_MODES}
    start, started_at = time.perf_counter(), revision()
    progress = tqdm(total=len(entries), desc="schemas", file=sys.stderr)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            results = pool.map(_run, entries, [options] * len(entries))
            for found in results:
                for mode, c in found.items():
                    counts[mode].add(c)
                progress.update()
    else:
        for entry in entries:
            for mode, c in _run(entry, options).items():
                counts[mode].add(c)
            progress.update()
    progress.close()
    elapsed = time.perf_counter() - start
    header = (
        f"Differential run on MaskBench dev: {len(entries)} schemas (seed {args.seed}), SmolLM2 tokenizer, "
        f"{machine_line()}, {args.jobs} process(es), {elapsed:.0f} s, revision {started_at}"
    )
    print(markdown(counts, header=header))
    if args.out:
        report = {
            "cpu": machine_line(), "revision": started_at, "schemas": len(entries), "seed": args.seed,
            "seconds": round(elapsed, 1), "options": options,
            "modes": {mode: c.as_dict() for mode, c in counts.items()},
        }  # fmt: skip
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
        print(f"\nreport: {args.out}")


if __name__ == "__main__":
    main()
