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
from dataclasses import asdict
from typing import Any

from ..reading.option_types import natural_int
from ..results.comparison import Comparison, compare_runs, comparison_rows, paired_header, paired_rows
from ..results.curves import DEFAULT_THRESHOLD, add_acquisition_arguments, check_image_path, plot_runs, require_matplotlib
from ..results.edit_outcomes import acquisition_line, format_runs_by_edit, runs_by_edit, split_rows
from ..results.flips import flips, format_flips, format_sweep_flips, pair_sentences, sweep_flips
from ..results.positions import axis_of
from ..results.runs import CompareError, Run, load_run, load_runs, read_outcomes, shared_suites, suite_run
from ..results.scored_pairs import file_indices
from ..results.stats import ALPHA, METRICS
from .checkpoints import step_of
from .compare_learning import learning_rows, order_lines
from .outputs import check_output_file, say, write_text

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


def to_json(comparison: Comparison, data: str | None = None) -> dict[str, Any]:
    """``--json``: every run's accuracies with intervals, and every paired test with the pairs behind its counts, each
    by its index in the benchmark file (``scored_pairs.file_indices``, the file read from ``data`` or the baseline's
    source for a selection); where that file is not found, by their positions among the pairs scored, and
    ``"pair_numbers": "positions among the pairs scored"`` says so."""
    numbers = file_indices(comparison.baseline.record, data)

    def accuracies(group: dict[str, Any]) -> dict[str, Any]:
        return {key: group.get(key) for key in ("acc", "acc_ci", "acc_norm", "acc_norm_ci")}

    runs = [
        {
            "label": run.label,
            "path": str(run.path),
            **accuracies(run.record),
            "phenomena": {name: {**accuracies(g), "n": g.get("n")} for name, g in run.record["phenomena"].items()},
        }
        for run in comparison.runs
    ]
    paired = []
    by_label = {run.label: run for run in comparison.runs}
    groups = comparison.baseline.outcomes.groups() if comparison.tests else {}
    for label, tests in comparison.tests.items():
        for test in tests:
            a, b = getattr(comparison.baseline.outcomes, test.metric), getattr(by_label[label].outcomes, test.metric)
            flipped = flips(a, b, None if test.group == "overall" else groups[test.group])
            paired.append(
                {
                    "baseline": comparison.baseline.label,
                    "run": label,
                    **asdict(test),
                    "baseline_only_pairs": [numbers[i] for i in flipped.lost] if numbers is not None else flipped.lost,
                    "run_only_pairs": [numbers[i] for i in flipped.learned] if numbers is not None else flipped.learned,
                }
            )
    learning = {label: summary.to_dict() for label, summary in comparison.learning().items() if summary is not None}
    orders = [
        {"baseline": comparison.baseline.label, "run": label, **_no_nan(order.to_dict())}
        for label, order in comparison.orders().items()
    ]
    by_edit = {
        "by_edit": runs_by_edit(comparison.runs, comparison.threshold)
    }  # acc and acc_norm split by how the tokenizer cut the edit
    if numbers is None and paired:
        by_edit["pair_numbers"] = "positions among the pairs scored"
    if not any(run.is_sweep for run in comparison.runs):
        return {"runs": runs, "paired": paired, **by_edit}
    return {"runs": runs, "paired": paired, "learning": learning, "learning_order": orders, **by_edit}


def _no_nan(record: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def format_flips_text(comparison: Comparison, data: str | None = None) -> str:
    """``--flips``: for each run against the baseline and each metric, the lost and learned pairs with their
    sentences; for each sweep, per phenomenon, the pairs never learned and the unstable ones (acc_norm)."""
    if not comparison.tests:
        raise CompareError("--flips compares pair by pair: give at least two results, without --no-paired")
    base = comparison.baseline
    sentences, numbers = pair_sentences(base.record, data), file_indices(base.record, data)
    lines = []
    for run in comparison.runs:
        if run is base:
            continue
        for metric in METRICS:
            flipped = flips(getattr(base.outcomes, metric), getattr(run.outcomes, metric))
            lines += ["", *format_flips(flipped, base.outcomes.phenomena, sentences, base.label, run.label, metric, numbers)]
    for run in comparison.runs:
        if run.is_sweep and len(run.history) > 1:
            outcomes = [read_outcomes(r, f"{run.path} at step {r['step']}") for r in run.records_up_to_step]
            own = file_indices(run.record, data) if run is base or data else None
            own = own if own is not None else file_indices(run.record)  # --data may be another run's file
            lines += ["", *format_sweep_flips(run.label, sweep_flips(outcomes), "acc_norm", own)]
    return "\n".join(lines).lstrip("\n")


# -- tables ---------------------------------------------------------------------------------------


def _paired_sections(comparison: Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    base = comparison.baseline.label
    return [
        (f"paired, {metric}: {label} against {base} (baseline)", paired_header(base, label), paired_rows(tests, metric))
        for label, tests in comparison.tests.items()
        for metric in METRICS
    ]


def _notes(comparison: Comparison) -> list[str]:
    notes = []
    md5s = {run.record.get("benchmark", {}).get("md5") for run in comparison.runs}
    if len(md5s) > 1:
        notes.append("note: the runs were scored on different benchmark files; their numbers are not comparable")
    selections = {run.record.get("selection") for run in comparison.runs}
    if len(md5s) == 1 and len(selections) > 1:
        each = "; ".join(f"{run.label}: {run.record.get('selection') or 'all pairs'}" for run in comparison.runs)
        notes.append(f"note: the runs were scored on different pairs of the file ({each}); side by side only")
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
    header, fitted = learning_rows(comparison)
    if fitted:
        lines += [
            "",
            "acquisition fits (logistic in log step, 95% bootstrap interval) and trends",
            *_text_table([header, *fitted], (0,)),
        ]
    order = order_lines(comparison)
    if order:
        lines += ["", *order]
    for title, header, table in _paired_sections(comparison):
        lines += ["", title, *_text_table([header, *table], (0, 1))]
    by_edit = runs_by_edit(comparison.runs, comparison.threshold)
    if by_edit:  # overall only on the terminal; --markdown and --json have the phenomena too
        lines += _by_edit_text(by_edit)
    return "\n".join(lines + _notes(comparison))


def _by_edit_text(by_edit: dict[str, Any]) -> list[str]:
    """``runs_by_edit`` (overall rows) as fixed-width tables like the others on the terminal, not Markdown's."""
    lines = []
    for label, data in by_edit.items():
        for split, splits in data["splits"].items():
            inside, outside = splits["groups"]
            header = ["group", "metric", inside, outside, "difference", "p (Fisher)"]
            lines += ["", f"{label}: acc and acc_norm by {split} ({inside} / {outside})"]
            lines += _text_table([header, *split_rows(splits, phenomena=False)], (0,))
        if data["acquisition"] is not None:
            lines.append(acquisition_line(label, data["acquisition"]))
    return lines


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
        axis = axis_of(r for run in comparison.runs if run.is_sweep for r in run.records)
        lines += [
            "",
            f"### Acquisition {axis} (first {axis} with {what} >= {comparison.threshold} through the last evaluation)",
            "",
        ]
        lines += table(["phenomenon", *labels], acquisition)
    header, fitted = learning_rows(comparison)
    if fitted:
        lines += ["", "### Fitted acquisition step (logistic in log step, 95% bootstrap interval) and trend", ""]
        lines += table(header, fitted)
    order = order_lines(comparison)
    if order:
        lines += ["", "### Learning order", "", *(f"- {line.strip()}" for line in order)]
    for title, header, rows in _paired_sections(comparison):
        lines += ["", f"### {title[0].upper()}{title[1:]}", "", *table(header, rows)]
    by_edit = runs_by_edit(comparison.runs, comparison.threshold)
    if by_edit:
        lines += ["", "### By how the tokenizer cut the edit (95% Wilson intervals, Fisher's exact test)", ""]
        lines += [format_runs_by_edit(by_edit).rstrip()]
    notes = _notes(comparison)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[Run], path: str | os.PathLike, threshold: float = DEFAULT_THRESHOLD) -> None:
    """Curves over steps of every sweep among ``runs`` (overall acc_norm, then each phenomenon), with 95% bands.

    A single result is a marker at its step (its ``step``, else the step number of its ``checkpoint-<step>``
    model folder), or, with no step to be found, a horizontal line.
    """
    if not any(run.is_sweep for run in runs):
        raise CompareError("--plot draws curves over steps: give at least one sweep file (tatblimp.jsonl)")
    curves, levels = {}, {}
    for run in runs:
        step = None if run.is_sweep else run.record.get("step", step_of(run.record.get("model")))
        if run.is_sweep:
            curves[run.label] = run.history
        elif step is not None:
            curves[run.label] = [{**run.record, "step": step}]
        else:
            levels[run.label] = run.record
    axes = sorted(
        {record.get("x", "step") for run in runs if run.is_sweep for record in run.records}
    )  # Hub revisions: tokens, words
    title = "TatBLiMP acc_norm over training (95% intervals)"
    plot_runs(curves, path, threshold=threshold, levels=levels, title=title, x_label=" / ".join(axes))


# -- the command ----------------------------------------------------------------------------------


def add_compare_parser(commands) -> None:
    """Add ``tatblimp compare`` to the CLI's sub-commands."""
    parser = commands.add_parser("compare", help="compare results files (score --output or sweep JSONL), with paired tests")
    parser.add_argument(
        "results",
        nargs="+",
        help="score --output JSON files and/or sweep JSONL files (RUN.jsonl@STEP: that step; of a revision series also "
        "@4B or @REVISION)",
    )
    parser.add_argument("--baseline", help="label of the run the others are tested against (default: the first)")
    parser.add_argument("--step", type=natural_int, help="compare every sweep at this step (default: its last)")
    parser.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="side by side only: no paired tests (accepts results without outcomes or of other benchmark files)",
    )
    parser.add_argument("--json", help="write the runs and every paired test as JSON here")
    parser.add_argument("--markdown", help="also write the tables as Markdown here")
    parser.add_argument("--plot", help="draw the sweeps' curves with 95%% bands to this image (needs matplotlib)")
    parser.add_argument(
        "--flips",
        action="store_true",
        help="list the pairs each run lost and learned against the baseline, and each sweep's never-learned and unstable pairs",
    )
    parser.add_argument(
        "--data",
        help="the benchmark file, for the sentences of --flips and, of a --limit or --phenomena run, the pairs' numbers in "
        "it (default: the one the results name)",
    )
    add_acquisition_arguments(parser)
    parser.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> None:
    if args.data and not (args.flips or args.json):
        raise ValueError(
            f"--data {args.data}: the benchmark file of --flips' sentences and --json's pair numbers; neither is given"
        )
    for option, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        check_output_file(path, option, [*args.results, args.data])
    if args.plot:
        require_matplotlib()  # before the work, not after the tables
        check_image_path(args.plot, "--plot")
    runs = load_runs(args.results, step=args.step)
    comparison = compare_runs(runs, args.baseline, args.paired, args.threshold, args.acquisition == "lower-bound")
    flipped = format_flips_text(comparison, args.data) if args.flips else None  # its errors before any output
    # Every suite that all the results have, compared pair by pair as TatBLiMP is.
    suites = {
        name: compare_runs(
            [suite_run(run, name) for run in runs], args.baseline, args.paired, args.threshold, args.acquisition == "lower-bound"
        )
        for name in shared_suites(runs)
    }

    def json_text() -> str:
        payload = {**to_json(comparison, args.data), **({"suites": {n: to_json(c) for n, c in suites.items()}} if suites else {})}
        return json.dumps(payload, indent=1, ensure_ascii=False) + "\n"

    def markdown() -> str:
        parts = [format_markdown(comparison)]
        parts += [format_markdown(c).replace("## TatBLiMP comparison", f"## Suite {n}", 1) for n, c in suites.items()]
        return "\n".join(parts)

    # The files first: a reader that closes stdout early (| head) must not cost them.
    written = []
    for option, write in ((args.markdown, markdown), (args.json, json_text)):
        if option:
            write_text(option, write())
            written.append(option)
    if args.plot:
        plot_comparison(runs, args.plot, args.threshold)
        written.append(args.plot)
    say(format_text(comparison))
    for name, suite in suites.items():
        say(f"\nsuite {name}\n" + format_text(suite))
    if flipped is not None:
        say("\n" + flipped)
    for path in written:
        say(f"wrote {path}")
