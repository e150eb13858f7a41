"""Results side by side: ``tatblimp compare RESULTS... [--markdown out.md] [--plot out.png]``.

Each RESULTS file is a ``tatblimp score --output`` JSON or a sweep's ``tatblimp.jsonl``; for a
sweep the last step is shown, plus the step at which each phenomenon was acquired.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .curves import DEFAULT_THRESHOLD, acquisition_steps, history_from_records, plot_runs


class CompareError(ValueError):
    """A results file cannot be read or compared."""


@dataclass
class Run:
    """One results file: a single score, or a sweep's records in step order."""

    label: str
    path: Path
    records: list[dict[str, Any]]
    is_sweep: bool

    @property
    def final(self) -> dict[str, Any]:
        return self.records[-1]

    @cached_property
    def history(self) -> list[dict[str, Any]]:
        return history_from_records(self.records) if self.is_sweep else []

    def acquisition(self, threshold: float = DEFAULT_THRESHOLD) -> dict[str, int | None]:
        return acquisition_steps(self.history, threshold) if self.is_sweep else {}


def load_run(path: str | os.PathLike, label: str | None = None) -> Run:
    """Read a ``score --output`` JSON file or a sweep JSONL file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CompareError(f"{path}: cannot read ({err.strerror or err})") from None
    label = label or (path.parent.name if path.name == "tatblimp.jsonl" and path.parent.name else path.stem)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        _check_record(whole, str(path))
        return Run(label, path, [whole], is_sweep=False)
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CompareError(f"{path}:{number}: neither a results JSON file nor a JSONL line ({err.msg})") from None
        _check_record(record, f"{path}:{number}")
        if "step" not in record:
            raise CompareError(f"{path}:{number}: a sweep line needs a 'step'")
        records.append(record)
    if not records:
        raise CompareError(f"{path}: holds no results")
    return Run(label, path, sorted(records, key=lambda r: r["step"]), is_sweep=True)


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict) or not {"acc", "acc_norm", "phenomena"} <= record.keys():
        raise CompareError(f"{where}: not TatBLiMP results (expected the keys acc, acc_norm, phenomena)")


def load_runs(paths: list[str | os.PathLike]) -> list[Run]:
    """``load_run`` for each path; runs with the same label are told apart by their path."""
    runs = [load_run(path) for path in paths]
    labels = [run.label for run in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = str(run.path)
    return runs


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def comparison_rows(runs: list[Run], threshold: float = DEFAULT_THRESHOLD) -> tuple[list[list[str]], list[list[str]]]:
    """(metric rows, acquisition rows); each row is the name then one cell per run.

    Acquisition rows are empty when no run is a sweep; a run that is not a sweep shows ``n/a``.
    """
    phenomena: dict[str, None] = {}
    for run in runs:
        phenomena.update(dict.fromkeys(run.final["phenomena"]))
    metrics = [
        ["step"] + [_fmt(run.final.get("step")) for run in runs],
        ["acc"] + [_fmt(run.final["acc"]) for run in runs],
        ["acc_norm"] + [_fmt(run.final["acc_norm"]) for run in runs],
        ["bits/byte (good)"] + [_fmt(run.final.get("bits_per_byte_good"), 3) for run in runs],
        ["tokens/byte"] + [_fmt(run.final.get("tokens_per_byte")) for run in runs],
    ]
    for name in phenomena:
        metrics.append([name] + [_fmt(run.final["phenomena"].get(name, {}).get("acc_norm")) for run in runs])
    acquisition: list[list[str]] = []
    if any(run.is_sweep for run in runs):
        steps = [run.acquisition(threshold) for run in runs]
        for name in phenomena:
            acquisition.append(
                [name]
                + [("never" if s.get(name) is None else str(s[name])) if run.is_sweep else "n/a" for run, s in zip(runs, steps)]
            )
    return metrics, acquisition


def _notes(runs: list[Run]) -> list[str]:
    notes = []
    md5s = {run.final.get("benchmark", {}).get("md5") for run in runs}
    if len(md5s) > 1:
        notes.append("note: the runs were scored on different benchmark files; their numbers are not comparable")
    return notes


def format_text(runs: list[Run], threshold: float = DEFAULT_THRESHOLD) -> str:
    """The comparison as a plain-text table for the terminal."""
    metrics, acquisition = comparison_rows(runs, threshold)
    header = ["metric (phenomena: acc_norm)"] + [run.label for run in runs]
    rows = [header, *metrics]
    if acquisition:
        rows += [[f"acquired (>= {threshold})"] + [""] * len(runs), *[[f"  {r[0]}", *r[1:]] for r in acquisition]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if index in (0, 5) or (acquisition and index == len(metrics)):
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines + _notes(runs))


def format_markdown(runs: list[Run], threshold: float = DEFAULT_THRESHOLD) -> str:
    """The comparison as Markdown tables: metrics (phenomena as acc_norm), then acquisition steps."""
    metrics, acquisition = comparison_rows(runs, threshold)

    def table(first: str, rows: list[list[str]]) -> list[str]:
        lines = ["| " + " | ".join([first] + [run.label for run in runs]) + " |"]
        lines.append("|" + "---|" + "---:|" * len(runs))
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return lines

    lines = ["## TatBLiMP comparison", "", "Phenomena rows are acc_norm.", "", *table("metric", metrics)]
    if acquisition:
        lines += ["", f"### Acquisition step (first step with acc_norm >= {threshold} through the last evaluation)", ""]
        lines += table("phenomenon", acquisition)
    notes = _notes(runs)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[Run], path: str | os.PathLike, threshold: float = DEFAULT_THRESHOLD) -> None:
    """Curves over steps of every sweep among ``runs`` (overall acc_norm, then each phenomenon)."""
    sweeps = {run.label: run.history for run in runs if run.is_sweep}
    if not sweeps:
        raise CompareError("--plot draws curves over steps: give at least one sweep file (tatblimp.jsonl)")
    plot_runs(sweeps, path, threshold=threshold, title="TatBLiMP acc_norm over training")


# -- the command ----------------------------------------------------------------------------------


def add_compare_parser(commands) -> None:
    """Add ``tatblimp compare`` to the CLI's sub-commands."""
    parser = commands.add_parser("compare", help="show results files (score --output or sweep JSONL) side by side")
    parser.add_argument("results", nargs="+", help="score --output JSON files and/or sweep tatblimp.jsonl files")
    parser.add_argument("--markdown", help="also write the table as Markdown here")
    parser.add_argument("--plot", help="draw the sweeps' curves over steps to this image (needs matplotlib)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="acc_norm that counts as acquired (default 0.75)")
    parser.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> None:
    runs = load_runs(args.results)
    print(format_text(runs, args.threshold))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_markdown(runs, args.threshold), encoding="utf-8")
        print(f"wrote {args.markdown}")
    if args.plot:
        plot_comparison(runs, args.plot, args.threshold)
        print(f"wrote {args.plot}")
