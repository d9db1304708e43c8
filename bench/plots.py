"""Draw the Performance page's figures from the benchmarks' JSON results.

Reads what the benchmarks write with ``--json`` into ``bench/results/`` and draws PNGs into
``docs/assets/perf/`` (matplotlib, Agg backend, 110 dpi); every title names the CPU (or GPU) the
figures were measured on and the date. A result that is missing is skipped with a note.

- ``maskbench.json`` (``bench/maskbench.py --json``): ``maskbench_tbm.png`` (TBM p50, p99, p99.9 per
  engine), ``maskbench_ttfm.png`` (TTFM p50, p99) and ``maskbench_correctness.png`` (schemas passing,
  invalid instances the mask accepted);
- ``sampler.json`` (``bench/sampler.py --json``): ``sampler.png`` (µs per step beside transformers'
  logits-processor chain) and ``sampler_bitmask.png`` (applying a token bitmask, beside xgrammar's);
- ``overhead.json`` (``bench/overhead.py --json``): ``overhead.png`` (what the mask adds to a decode step
  at each batch size);
- ``e2e.json`` (``bench/e2e.py --json``): ``e2e_<decoding>_b<batch>.png`` (tokens/s, valid outputs and
  s per valid object per workload, constrain beside transformers + xgrammar / llguidance and Outlines).

Usage: ``python bench/plots.py [--results bench/results] [--out docs/assets/perf]`` (``make plots``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

ROOT = Path(__file__).resolve().parent.parent
DPI = 110
COLORS = {
    "constrain": "#1f4e9c",
    "constrain-sampled": "#4c8ee6",
    "constrain-closed": "#7aa9e0",
    "constrain-generation": "#9cc3f0",
    "xgrammar": "#e07b00",
    "llguidance": "#2e9c4a",
    "transformers": "#7f7f7f",
    "outlines": "#8e44ad",
}
"""One colour per system, the same in every figure: constrain in blues, each peer its own."""
ENGINE_LABELS = {
    "constrain": "constrain\neager mask",
    "constrain-sampled": "constrain\nchecks on the\ndrawn token",
    "constrain-closed": "constrain\nclosed=True",
    "constrain-generation": "constrain\ngeneration mode",
}
SHADES = ("#9ecae1", "#3182bd", "#08306b")
"""Percentile shades, light to dark: p50, p99, p99.9."""

Report = dict[str, Any]


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` at :data:`DPI` and close it; returns ``path``."""
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def machine_label(report: Report) -> str:
    """``AMD EPYC (family 26 model 2), 2 cores, AVX-512, 2026-11-25``: the CPU (and GPU) and the date of a run.

    Parameters
    ----------
    report : dict
        A benchmark's JSON result, with the ``machine`` entry of :func:`bench.machine.machine_info`.

    Returns
    -------
    str
        A short label for a figure's title.
    """
    machine = report.get("machine", {})
    family = " ".join(machine.get("cpu_family", "").split()[:4])  # family F model M, without the stepping
    isa = machine.get("isa", {})
    vector = "AVX-512" if isa.get("avx512f") else "AVX2" if isa.get("avx2") else "no AVX2"
    cpu = f"{machine.get('cpu', 'unknown CPU')}{f' ({family})' if family else ''}"
    label = f"{cpu}, {machine.get('cores')} cores, {vector}"
    if machine.get("gpu"):
        label = f"{machine['gpu']}; {label}"
    return f"{label}, {str(machine.get('date', ''))[:10]}"


def engine_label(engine: str, report: Report) -> str:
    """An engine's axis label, with its version for the peers."""
    if engine in ENGINE_LABELS:
        return ENGINE_LABELS[engine]
    found = report.get("versions", {}).get(engine)
    return f"{engine}\n{found}" if found else engine


def color(engine: str) -> str:
    """The colour of a system (constrain's variants and the peers by name)."""
    return COLORS.get(engine, COLORS["constrain"] if engine.startswith("constrain") else "#444444")


def readable(value: float, unit: str) -> str:
    """A bar's value label: ``1.2 ms``, ``850 µs``, ``3.4 s``."""
    if unit == "µs":
        if value >= 1e6:
            return f"{value / 1e6:.3g} s"
        if value >= 1e3:
            return f"{value / 1e3:.3g} ms"
        return f"{value:.3g} µs"
    return f"{value:.3g} {unit}"


def log_axis(ax: Axes, unit: str) -> None:
    """A log-scale y axis labelled in readable units."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: readable(v, unit)))
    ax.grid(axis="y", which="major", alpha=0.3)


def grouped_bars(
    ax: Axes, groups: list[str], series: dict[str, list[float]], shades: tuple[str, ...], unit: str
) -> None:
    """Bars of several series (percentiles) side by side per group (engine), values written on top."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name, color=shades[i], edgecolor="white")
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(
                readable(value, unit),
                (bar.get_x() + bar.get_width() / 2, value),
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def maskbench_title(report: Report, what: str) -> str:
    settings = report["settings"]
    sample = f"a seeded sample of {settings['schemas']:,}" if settings.get("sample") else f"all {settings['schemas']:,}"
    return f"MaskBench {what}: {sample} dev schemas, SmolLM2 tokenizer\n{machine_label(report)}"


def plot_maskbench(report: Report, out: Path) -> list[Path]:
    """TBM and TTFM percentiles and the correctness counts, one engine per group of bars."""
    summary: dict[str, Any] = report["summary"]
    engines = [e for e in summary if summary[e]["tbm_us"]]
    labels = [engine_label(e, report) for e in engines]
    written = []

    for metric, keys, what in (
        ("tbm_us", ("p50", "p99", "p99.9"), "TBM (time between masks)"),
        ("ttfm_us", ("p50", "p99"), "TTFM (compile + first mask)"),
    ):
        fig, ax = plt.subplots(figsize=(9, 5.2))
        series = {k: [summary[e][metric][k] for e in engines] for k in keys}
        shades = SHADES if len(keys) == 3 else (SHADES[0], SHADES[2])
        grouped_bars(ax, labels, series, shades, "µs")
        log_axis(ax, "µs")
        top = max(max(v) for v in series.values())
        ax.set_ylim(top=top * 12)  # room for the rotated labels
        ax.set_ylabel("µs per token" if metric == "tbm_us" else "per schema")
        ax.legend(title="percentile", loc="upper left", fontsize=8, ncols=len(keys))
        ax.set_title(maskbench_title(report, what), fontsize=10)
        fig.tight_layout()
        written.append(_save(fig, out / f"maskbench_{metric.removesuffix('_us')}.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    n = [summary[e]["schemas"] for e in engines]
    passing = [100 * summary[e]["statuses"]["passing"] / count for e, count in zip(engines, n, strict=True)]
    accepted = [summary[e]["invalid_accepted"] for e in engines]
    ys = list(range(len(engines)))[::-1]
    flat = [label.replace("\n", " ") for label in labels]
    left.barh(ys, passing, color=[color(e) for e in engines])
    for y, value, engine in zip(ys, passing, engines, strict=True):
        count = summary[engine]["statuses"]["passing"]
        left.text(value + 1, y, f"{value:.1f}% ({count})", va="center", fontsize=8)
    left.set_xlim(0, 128)
    left.set_yticks(ys, flat, fontsize=8)
    left.set_xlabel("schemas passing (%)\nno valid instance refused, no invalid one accepted", fontsize=9)
    right.barh(ys, accepted, color=[color(e) for e in engines])
    widest = max(1, *accepted)
    for y, value in zip(ys, accepted, strict=True):
        right.text(value + widest * 0.02, y, str(value), va="center", fontsize=8)
    right.set_xlim(0, widest * 1.25)
    right.set_xlabel("invalid test instances the mask accepted\n(over all schemas; fewer is better)", fontsize=9)
    right.xaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(maskbench_title(report, "correctness (the mask alone)"), fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, out / "maskbench_correctness.png"))
    return written


SAMPLER_SYSTEMS = {
    "sampler": ("constrain.sampler (mixed parameters per row)", COLORS["constrain"], "-"),
    "hf rows": ("transformers processors, row by row (each row's parameters)", COLORS["transformers"], "-"),
    "hf batch": ("transformers processors, batched (one parameter set)", COLORS["transformers"], "--"),
    "row loop": ("per-request Python loop", "#b5651d", ":"),
    "copy": ("copy_ of the logits (one memory pass)", "#bbbbbb", "-."),
}


def plot_sampler(report: Report, out: Path) -> list[Path]:
    """µs per step against the batch size, one panel per vocabulary; bitmask application as bars."""
    rows = report["pipeline"]
    vocabs = sorted({r["vocab"] for r in rows})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(11, 5.4), sharey=True)
    for ax, vocab in zip(axes, vocabs, strict=True):
        these = sorted((r for r in rows if r["vocab"] == vocab), key=lambda r: r["batch"])
        batches = [r["batch"] for r in these]
        for key, (label, shade, style) in SAMPLER_SYSTEMS.items():
            ax.plot(batches, [r["us"][key] for r in these], style, marker="o", color=shade, label=label)
        last = these[-1]["us"]
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        log_axis(ax, "µs")
        ax.set_xlabel("batch (rows)")
        ratio = last["hf rows"] / last["sampler"]
        ax.set_title(
            f"vocabulary {vocab:,}; at batch {batches[-1]}: {ratio:.0f}x faster than transformers row by row",
            fontsize=9,
        )
    axes[0].set_ylabel("per sampling step (median)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncols=3, fontsize=8, frameon=False)
    quick = ", --quick" if report["settings"].get("quick") else ""
    fig.suptitle(
        f"Sampling step: penalties, temperature, top-k, top-p, min-p and the draw (bench/sampler.py{quick})\n"
        f"{machine_label(report)}, torch {report['machine'].get('torch')}, {report['settings']['device']}, "
        f"{report['machine'].get('threads')} thread(s)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the legend below the panels
    written = [_save(fig, out / "sampler.png")]

    masks = report.get("bitmask", [])
    if masks:
        fig, ax = plt.subplots(figsize=(8, 4.4))
        groups = [f"batch {m['batch']}, vocab {m['vocab']:,}" for m in masks]
        series = {
            "constrain.sampler.apply_token_bitmask_inplace": [m["us"]["sampler"] for m in masks],
            "xgrammar.apply_token_bitmask_inplace": [m["us"]["xgrammar"] for m in masks],
            "masked_fill_ (a ready bool mask)": [m["us"]["masked_fill_"] for m in masks],
        }
        shades = (COLORS["constrain"], COLORS["xgrammar"], "#bbbbbb")
        grouped_bars(ax, groups, series, shades, "µs")
        log_axis(ax, "µs")
        ax.set_ylim(top=max(max(v) for v in series.values()) * 8)
        ax.set_ylabel("per call (median)")
        ax.legend(fontsize=8, loc="upper left")
        threads = report["machine"].get("threads")
        ax.set_title(
            f"Applying a token bitmask to the logits (bench/sampler.py)\n{machine_label(report)}, {threads} thread(s)",
            fontsize=10,
        )
        fig.tight_layout()
        written.append(_save(fig, out / "sampler_bitmask.png"))
    return written


OVERHEAD_STAGES = {
    "mask": "#1f4e9c",
    "checks": "#4c8ee6",
    "stop+detokenize": "#9cc3f0",
}
OVERHEAD_RUNS = {
    "unchecked schema": "unchecked\nschema",
    "checked schemas": "checked,\ndrawn token",
    "checked schemas, eager": "checked,\neager",
}


def plot_overhead(report: Report, out: Path) -> list[Path]:
    """Per batch size, the constraint's stages (mask, checks, stop+detokenize) in ms per step, stacked."""
    rows = report["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches) + 1, 4.8))
    axes = list(axes) if len(batches) > 1 else [axes]
    for ax, batch in zip(axes, batches, strict=True):
        by_run = {r["run"]: r for r in rows if r["batch"] == batch}
        base = by_run["unconstrained"]
        runs = [run for run in OVERHEAD_RUNS if run in by_run]
        bottoms = [0.0] * len(runs)
        for stage, shade in OVERHEAD_STAGES.items():
            values = [by_run[run]["stages_ms"][stage] for run in runs]
            ax.bar(range(len(runs)), values, 0.6, bottom=bottoms, color=shade, label=stage)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for x, (run, total) in enumerate(zip(runs, bottoms, strict=True)):
            share = by_run[run]["added_share"]
            ax.annotate(
                f"{total:.2f} ms\n{share:+.1%}",
                (x, total),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_ylim(0, max(bottoms) * 1.3)
        ax.set_xticks(range(len(runs)), [OVERHEAD_RUNS[r] for r in runs], fontsize=8)
        ax.set_title(f"batch {batch}: unconstrained step {base['step_ms']:.1f} ms", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("ms per decode step")
    axes[0].legend(fontsize=8, loc="upper left")
    settings = report["settings"]
    repeats = f"medians of {settings['repeats']}" if settings["repeats"] > 1 else "one run each"
    fig.suptitle(
        f"What the constraint adds to a decode step ({report.get('model', 'default model')}, greedy, "
        f"≤{settings['tokens']} tokens a row, {repeats})\n"
        f"labels: the stages' ms and what they add over the unconstrained step's own; {machine_label(report)}",
        fontsize=10,
    )
    fig.tight_layout()
    return [_save(fig, out / "overhead.png")]


def system_color(name: str) -> str:
    """The colour of an end-to-end system by its name (constrain, transformers, or the peer it runs)."""
    for key in ("constrain", "xgrammar", "llguidance", "outlines"):
        if key in name.lower():
            return COLORS[key]
    return COLORS["transformers"]


def plot_e2e(report: Report, out: Path) -> list[Path]:
    """Per decoding and batch: tokens/s per workload and system, valid outputs on each bar; s per valid object."""
    written = []
    for panel in report["panels"]:
        cells = [c for c in panel["cells"] if not c["note"]]
        workloads = list(dict.fromkeys(c["workload"] for c in cells))
        systems = list(dict.fromkeys(c["system"] for c in cells))
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.2), sharex=True)
        width = 0.84 / len(systems)
        worst = max((c["per_valid"] for c in cells if c["per_valid"] != float("inf")), default=1.0)
        for k, name in enumerate(systems):
            offset = (k - (len(systems) - 1) / 2) * width
            mine = {c["workload"]: c for c in cells if c["system"] == name}
            xs = [workloads.index(w) + offset for w in mine]
            hatch = "//" if "compact" in name else None
            shade = system_color(name)
            top.bar(xs, [c["rate"] for c in mine.values()], width, color=shade, hatch=hatch, label=name,
                    edgecolor="white")  # fmt: skip
            for x, c in zip(xs, mine.values(), strict=True):
                label = "" if c["free"] else f"{c['valid']}/{c['rows']}"
                top.annotate(label, (x, c["rate"]), ha="center", va="bottom", fontsize=7, rotation=90,
                             xytext=(0, 2), textcoords="offset points")  # fmt: skip
                finite = c["per_valid"] != float("inf")
                bottom.bar(x, c["per_valid"] if finite else worst * 4, width, color=shade, hatch=hatch,
                           edgecolor="white", alpha=1.0 if finite else 0.15)  # fmt: skip
                if not finite:
                    bottom.annotate("no valid\noutput", (x, worst * 4), ha="center", va="bottom", fontsize=6,
                                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
        top.set_ylabel("tokens/s (higher is better)\nlabels: valid outputs")
        top.grid(axis="y", alpha=0.3)
        top.set_ylim(top=top.get_ylim()[1] * 1.15)
        log_axis(bottom, "s")
        bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
        bottom.set_ylim(top=worst * 30)
        bottom.set_ylabel("s per valid object\n(lower is better)")
        bottom.set_xticks(range(len(workloads)), workloads)
        fig.legend(*top.get_legend_handles_labels(), loc="lower center", ncols=4, fontsize=8, frameon=False)
        settings = report["settings"]
        runs = "one run" if settings["repeats"] == 1 else f"medians of {settings['repeats']}"
        fig.suptitle(
            f"End to end on {report['model']} ({report['dtype'].removeprefix('torch.')}): {panel['decoding']}, "
            f"batch {panel['batch']}, {settings['items']} items, {runs} (bench/e2e.py)\n{machine_label(report)}",
            fontsize=10,
        )
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        written.append(_save(fig, out / f"e2e_{panel['decoding']}_b{panel['batch']}.png"))
    return written


PLOTS = {"maskbench": plot_maskbench, "sampler": plot_sampler, "overhead": plot_overhead, "e2e": plot_e2e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="the benchmarks' JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "perf", help="where the PNGs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, plot in PLOTS.items():
        source = args.results / f"{name}.json"
        if not source.is_file():
            missing.append(name)
            print(f"skipped {name}: no {source} (run bench/{name}.py --json {source})", file=sys.stderr)
            continue
        for path in plot(json.loads(source.read_text()), args.out):
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if len(missing) == len(PLOTS):
        sys.exit("no results to plot")


if __name__ == "__main__":
    main()
