"""Runs compared: the paired tests of every run against a baseline, and the tables that show them, which
``tatblimp compare`` (text, Markdown) and ``tatblimp report`` (HTML) both print.

The tables are rows of strings; their columns are named for the runs (or the steps) compared,
``only <baseline>`` and ``only <run>``: the pairs only one side passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..reading.identity import record_fingerprint
from .curves import DEFAULT_THRESHOLD
from .positions import axis_of, readable
from .runs import CompareError, Run
from .stats import PairedTest, format_interval, paired_tests

if TYPE_CHECKING:  # learning.py brings numpy and scipy: imported when a comparison first needs it, not by --help
    from .learning import LearningOrder, LearningSummary

__all__ = ["Comparison", "compare_runs", "comparison_rows", "paired_header", "paired_rows"]


@dataclass
class Comparison:
    """Runs, their baseline and the paired tests of every other run against it (empty without ``paired``)."""

    runs: list[Run]
    baseline: Run
    tests: dict[str, list[PairedTest]]  # run label -> tests
    threshold: float = DEFAULT_THRESHOLD
    use_lower_bound: bool = False
    _learning: dict[str, LearningSummary | None] | None = field(default=None, repr=False)

    def significant(self, run: Run, metric: str, group: str) -> bool:
        return any(t.metric == metric and t.group == group and t.significant for t in self.tests.get(run.label, []))

    def learning(self) -> dict[str, LearningSummary | None]:
        """Each sweep's fitted acquisitions and trends (``learning.py``), by label, computed once; None for a sweep
        without per-pair outcomes (written by an older tatblimp-callback)."""
        if self._learning is None:
            self._learning = sweep_learning(self.runs)
        return self._learning

    def orders(self) -> dict[str, LearningOrder]:
        """The order of acquisition of each other sweep against the baseline's (Kendall's tau), by the other's label."""
        return orders_against(self.baseline.label, self.learning())


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
        md5s = {run.path: run.record.get("benchmark", {}).get("md5") for run in runs}  # the files, in an error
        if len(set(md5s.values())) > 1 or None in md5s.values():
            listed = ", ".join(f"{path}: {md5}" for path, md5 in md5s.items())
            raise CompareError(
                f"the results were scored on different benchmark files (md5 {listed}); their pairs cannot be compared "
                "pair by pair (--no-paired shows them side by side)"
            )
        selections = {run.label: run.record.get("selection") for run in runs}  # --limit, --phenomena
        # What was scored (identity.fingerprint): the same bytes read with another column mapping, or another
        # subset of them, are other pairs at the same indices. Records without a fingerprint: md5 and selection.
        fingerprints = {record_fingerprint(run.record) for run in runs} - {None}
        if len(set(selections.values())) > 1 or len(fingerprints) > 1:
            listed = ", ".join(f"{label}: {selection or 'all pairs'}" for label, selection in selections.items())
            raise CompareError(
                f"the results cover different pairs ({listed}); they cannot be compared pair by pair "
                "(--no-paired shows them side by side)"
            )
        for run in runs:
            if run is not base:
                try:
                    tests[run.label] = paired_tests(base.outcomes, run.outcomes)
                except ValueError as err:
                    raise CompareError(f"{run.label} against {base.label}: {err}") from None
    return Comparison(runs, base, tests, threshold, use_lower_bound)


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
        [axis_of(r for run in runs for r in run.records)] + [_position(run) for run in runs],
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
        axes = [axis_of(run.records) for run in runs]
        for name in phenomena:
            acquisition.append(
                [name]
                + [
                    ("never" if s.get(name) is None else readable(s[name], axis)) if run.is_sweep else "n/a"
                    for run, s, axis in zip(runs, steps, axes)
                ]
            )
    return metrics, acquisition


def _position(run: Run) -> str:
    """The step of the run's record, or the tokens or words of a revision series' (``4B tokens``: the row is named
    for every run's axis, ``step / tokens`` for two kinds)."""
    step, axis = run.record.get("step"), run.record.get("x", "step")
    if step is None or axis == "step":
        return _fmt(step)
    return f"{readable(step, axis)} {axis}"


def paired_header(before: str, after: str) -> list[str]:
    """The header of ``paired_rows``, its columns named for what is compared: two runs' labels, or two steps."""
    return ["group", "n", f"only {before}", f"only {after}", "difference", "p", "p (BH)", "significant"]


def paired_rows(tests: list[PairedTest], metric: str) -> list[list[str]]:
    """One metric's paired tests as table rows (``paired_header``: the pairs only the first side passes, only the second)."""
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


def sweep_learning(runs: Sequence[Run]) -> dict[str, LearningSummary | None]:
    """Each sweep's fitted acquisitions and trends, by label; None for a sweep without per-pair outcomes."""
    from .learning import evaluations_from_records, learning_summary

    found: dict[str, LearningSummary | None] = {}
    for run in runs:
        if run.is_sweep:
            try:
                evaluations = evaluations_from_records(run.records_up_to_step, str(run.path))
            except ValueError:
                found[run.label] = None
                continue
            found[run.label] = learning_summary(evaluations)
    return found


def orders_against(baseline: str, learning: dict[str, LearningSummary | None]) -> dict[str, LearningOrder]:
    """Kendall's tau of each other sweep's order of acquisition against the baseline's, by the other's label."""
    from .learning import learning_order

    base = learning.get(baseline)
    if base is None:
        return {}
    return {
        label: learning_order(base.fits, summary.fits)
        for label, summary in learning.items()
        if label != baseline and summary is not None
    }
