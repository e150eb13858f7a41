"""Results side by side, with intervals and paired tests: ``tatblimp compare RESULTS... [--json OUT]``.

Each RESULTS is a ``tatblimp score --output`` JSON, a sweep's ``tatblimp.jsonl`` or the callback's
``tatblimp_history.jsonl`` (JSON lines with a ``step``). A sweep is compared at its last step, at
``--step N``, or at the step named as ``RUN.jsonl@STEP`` (two steps of one sweep can be compared);
for sweeps the step at which each phenomenon was acquired is shown too.

Every run is tested against the baseline (the first, or ``--baseline LABEL``) pair by pair, from the
per-pair outcomes in the results: for acc_norm and acc, overall and per phenomenon, the pairs only the
baseline passes and only the run passes, the exact McNemar p-value and, over the phenomena,
Benjamini-Hochberg adjusted p-values (see ``stats.py``). Results of different benchmark files or
without per-pair outcomes are refused (``--no-paired`` shows them side by side only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .curves import DEFAULT_THRESHOLD, add_acquisition_arguments, plot_runs
from .runs import CompareError, Run, load_run, load_runs, shared_suites, suite_run
from .stats import ALPHA, METRICS, PairedTest, format_interval, paired_tests

__all__ = [
    "CompareError",
    "Comparison",
    "Run",
    "compare_runs",
    "format_markdown",
    "format_text",
    "load_run",
    "load_runs",
    "plot_comparison",
    "to_json",
]


@dataclass
class Comparison:
    """Runs, their baseline and the paired tests of every other run against it (empty without ``paired``)."""

    runs: list[Run]
    baseline: Run
    tests: dict[str, list[PairedTest]]  # run label -> tests
    threshold: float = DEFAULT_THRESHOLD
    use_lower_bound: bool = False

    def significant(self, run: Run, metric: str, group: str) -> bool:
        return any(t.metric == metric and t.group == group and t.significant for t in self.tests.get(run.label, []))


def compare_runs(
    runs: list[Run],
    baseline: str | None = None,
    paired: bool = True,
    threshold: float = DEFAULT_THRESHOLD,
    use_lower_bound: bool = False,
) -> Comparison:
    """Test every run against the baseline (label ``baseline``, else the first run) pair by pair.

    With ``paired`` the runs must be scored on one benchmark file (md5) and carry per-pair outcomes.
    """
    if baseline is None:
        base = runs[0]
    else:
        matches = [run for run in runs if run.label == baseline]
        if not matches:
            raise CompareError(f"--baseline {baseline}: no such run (labels: {', '.join(run.label for run in runs)})")
        base = matches[0]
    tests: dict[str, list[PairedTest]] = {}
    if paired:
        md5s = {run.label: run.record.get("benchmark", {}).get("md5") for run in runs}
        if len(set(md5s.values())) > 1 or None in md5s.values():
            listed = ", ".join(f"{label}: {md5}" for label, md5 in md5s.items())
            raise CompareError(
                f"the results were scored on different benchmark files (md5 {listed}); their pairs cannot be compared "
                "pair by pair (--no-paired shows them side by side)"
            )
        for run in runs:
            if run is not base:
                try:
                    tests[run.label] = paired_tests(base.outcomes, run.outcomes)
                except ValueError as err:
                    raise CompareError(f"{run.label} against {base.label}: {err}") from None
    return Comparison(runs, base, tests, threshold, use_lower_bound)


def to_json(comparison: Comparison) -> dict[str, Any]:
    """``--json``: every run's accuracies with intervals, and every paired test."""

    def accuracies(group: dict[str, Any]) -> dict[str, Any]:
        return {key: group.get(key) for key in ("acc", "acc_ci", "acc_norm", "acc_norm_ci")}

    runs = [
        {
            "label": run.label,
            **accuracies(run.record),
            "phenomena": {name: {**accuracies(g), "n": g.get("n")} for name, g in run.record["phenomena"].items()},
        }
        for run in comparison.runs
    ]
    paired = [
        {"baseline": comparison.baseline.label, "run": label, **asdict(test)}
        for label, tests in comparison.tests.items()
        for test in tests
    ]
    return {"runs": runs, "paired": paired}


# -- tables ---------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _fmt_p(p: float) -> str:
    return f"{p:.1e}" if p < 0.01 else f"{p:.3f}"


def comparison_rows(comparison: Comparison) -> tuple[list[list[str]], list[list[str]]]:
    """(metric rows, acquisition rows); each row is the name then one cell per run.

    Accuracy cells show the 95% interval and a ``*`` where the run differs from the baseline at 0.05
    (BH-adjusted for phenomena). Acquisition rows are empty when no run is a sweep; a run that is not
    a sweep shows ``n/a``.
    """
    runs = comparison.runs
    phenomena: dict[str, None] = {}
    for run in runs:
        phenomena.update(dict.fromkeys(run.record["phenomena"]))

    def cell(run: Run, group: dict[str, Any], metric: str, name: str) -> str:
        text = _fmt(group.get(metric))
        if group.get(f"{metric}_ci") is not None:
            text += " " + format_interval(group[f"{metric}_ci"])
        return text + (" *" if comparison.significant(run, metric, name) else "")

    metrics = [
        ["step"] + [_fmt(run.record.get("step")) for run in runs],
        ["acc"] + [cell(run, run.record, "acc", "overall") for run in runs],
        ["acc_norm"] + [cell(run, run.record, "acc_norm", "overall") for run in runs],
        ["bits/byte (good)"] + [_fmt(run.record.get("bits_per_byte_good"), 3) for run in runs],
        ["tokens/byte"] + [_fmt(run.record.get("tokens_per_byte")) for run in runs],
    ]
    for name in phenomena:
        metrics.append([name] + [cell(run, run.record["phenomena"].get(name, {}), "acc_norm", name) for run in runs])
    acquisition: list[list[str]] = []
    if any(run.is_sweep for run in runs):
        steps = [run.acquisition(comparison.threshold, comparison.use_lower_bound) for run in runs]
        for name in phenomena:
            acquisition.append(
                [name]
                + [("never" if s.get(name) is None else str(s[name])) if run.is_sweep else "n/a" for run, s in zip(runs, steps)]
            )
    return metrics, acquisition


PAIRED_HEADER = ["group", "n", "baseline only", "run only", "difference", "p", "p (BH)", "significant"]


def paired_rows(tests: list[PairedTest], metric: str) -> list[list[str]]:
    """One metric's paired tests as table rows (``PAIRED_HEADER``)."""
    return [
        [
            t.group,
            str(t.n),
            str(t.baseline_only),
            str(t.run_only),
            f"{t.difference:+.4f}" if t.n else "nan",
            _fmt_p(t.p_value),
            _fmt_p(t.p_adjusted),
            "*" if t.significant else "",
        ]
        for t in tests
        if t.metric == metric
    ]


def _paired_sections(comparison: Comparison) -> list[tuple[str, list[list[str]]]]:
    return [
        (f"paired, {metric}: {label} against {comparison.baseline.label} (baseline)", paired_rows(tests, metric))
        for label, tests in comparison.tests.items()
        for metric in METRICS
    ]


def _notes(comparison: Comparison) -> list[str]:
    notes = []
    md5s = {run.record.get("benchmark", {}).get("md5") for run in comparison.runs}
    if len(md5s) > 1:
        notes.append("note: the runs were scored on different benchmark files; their numbers are not comparable")
    if comparison.tests:
        notes.append(
            f"[low, high]: 95% Wilson interval. *: differs from {comparison.baseline.label} at {ALPHA} in an exact McNemar "
            "test on the pairs only one of the two passes, Benjamini-Hochberg adjusted over the phenomena "
            "(overall: one test, not adjusted)"
        )
    return notes


def _text_table(rows: list[list[str]], rules: tuple[int, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        lines.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        )
        if index in rules:
            lines.append("-" * len(lines[-1]))
    return lines


def _acquired_title(comparison: Comparison) -> str:
    what = "lower bound" if comparison.use_lower_bound else ""
    return f"acquired ({what + ' ' if what else ''}>= {comparison.threshold})"


def _as_comparison(runs: list[Run] | Comparison, threshold: float) -> Comparison:
    return runs if isinstance(runs, Comparison) else compare_runs(runs, threshold=threshold)


def format_text(runs: list[Run] | Comparison, threshold: float = DEFAULT_THRESHOLD) -> str:
    """The comparison as plain-text tables for the terminal (runs: tested against the first, at ``threshold``)."""
    comparison = _as_comparison(runs, threshold)
    metrics, acquisition = comparison_rows(comparison)
    rows = [["metric (phenomena: acc_norm)"] + [run.label for run in comparison.runs], *metrics]
    if acquisition:
        rows += [[_acquired_title(comparison)] + [""] * len(comparison.runs), *[[f"  {r[0]}", *r[1:]] for r in acquisition]]
    lines = _text_table(rows, (0, 5, len(metrics)) if acquisition else (0, 5))
    for title, table in _paired_sections(comparison):
        lines += ["", title, *_text_table([PAIRED_HEADER, *table], (0, 1))]
    return "\n".join(lines + _notes(comparison))


def format_markdown(runs: list[Run] | Comparison, threshold: float = DEFAULT_THRESHOLD) -> str:
    """The comparison as Markdown: metrics (phenomena as acc_norm), acquisition steps, paired tests."""
    comparison = _as_comparison(runs, threshold)
    metrics, acquisition = comparison_rows(comparison)

    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
        return lines + ["| " + " | ".join(row) + " |" for row in rows]

    labels = [run.label for run in comparison.runs]
    lines = ["## TatBLiMP comparison", "", "Phenomena rows are acc_norm.", "", *table(["metric", *labels], metrics)]
    if acquisition:
        what = "its 95% lower bound" if comparison.use_lower_bound else "acc_norm"
        lines += ["", f"### Acquisition step (first step with {what} >= {comparison.threshold} through the last evaluation)", ""]
        lines += table(["phenomenon", *labels], acquisition)
    for title, rows in _paired_sections(comparison):
        lines += ["", f"### {title[0].upper()}{title[1:]}", "", *table(PAIRED_HEADER, rows)]
    notes = _notes(comparison)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[Run], path: str | os.PathLike, threshold: float = DEFAULT_THRESHOLD) -> None:
    """Curves over steps of every sweep among ``runs`` (overall acc_norm, then each phenomenon), with 95% bands."""
    sweeps = {run.label: run.history for run in runs if run.is_sweep}
    if not sweeps:
        raise CompareError("--plot draws curves over steps: give at least one sweep file (tatblimp.jsonl)")
    plot_runs(sweeps, path, threshold=threshold, title="TatBLiMP acc_norm over training (bands: 95% intervals)")


# -- the command ----------------------------------------------------------------------------------


def add_compare_parser(commands) -> None:
    """Add ``tatblimp compare`` to the CLI's sub-commands."""
    parser = commands.add_parser("compare", help="compare results files (score --output or sweep JSONL), with paired tests")
    parser.add_argument(
        "results", nargs="+", help="score --output JSON files and/or sweep JSONL files (RUN.jsonl@STEP: that step)"
    )
    parser.add_argument("--baseline", help="label of the run the others are tested against (default: the first)")
    parser.add_argument("--step", type=int, help="compare every sweep at this step (default: its last)")
    parser.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="side by side only: no paired tests (accepts results without outcomes or of other benchmark files)",
    )
    parser.add_argument("--json", help="write the runs and every paired test as JSON here")
    parser.add_argument("--markdown", help="also write the tables as Markdown here")
    parser.add_argument("--plot", help="draw the sweeps' curves with 95%% bands to this image (needs matplotlib)")
    add_acquisition_arguments(parser)
    parser.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> None:
    runs = load_runs(args.results, step=args.step)
    comparison = compare_runs(runs, args.baseline, args.paired, args.threshold, args.acquisition == "lower-bound")
    # Every suite that all the results have, compared pair by pair as TatBLiMP is.
    suites = {
        name: compare_runs(
            [suite_run(run, name) for run in runs], args.baseline, args.paired, args.threshold, args.acquisition == "lower-bound"
        )
        for name in shared_suites(runs)
    }
    print(format_text(comparison))
    for name, suite in suites.items():
        print(f"\nsuite {name}\n" + format_text(suite))

    def json_text() -> str:
        payload = {**to_json(comparison), **({"suites": {n: to_json(c) for n, c in suites.items()}} if suites else {})}
        return json.dumps(payload, indent=1, ensure_ascii=False) + "\n"

    def markdown() -> str:
        parts = [format_markdown(comparison)]
        parts += [format_markdown(c).replace("## TatBLiMP comparison", f"## Suite {n}", 1) for n, c in suites.items()]
        return "\n".join(parts)

    for option, write in ((args.markdown, markdown), (args.json, json_text)):
        if option:
            Path(option).parent.mkdir(parents=True, exist_ok=True)
            Path(option).write_text(write(), encoding="utf-8")
            print(f"wrote {option}")
    if args.plot:
        plot_comparison(runs, args.plot, args.threshold)
        print(f"wrote {args.plot}")
