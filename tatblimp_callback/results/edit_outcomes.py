"""A run's outcomes split by how its tokenizer cut the edit: does a tokenizer ablation's score follow the cut?

A results record (a score JSON, a sweep's or the callback's line) carries each pair's outcomes (``outcomes``)
and, per pair, whether the edit is aligned with token boundaries and the sign of bad's token count minus
good's (``edit_tokens``: ``Results.edit_tokens``). From those, for acc and acc_norm, overall and per
phenomenon:

- **by alignment**: accuracy over the aligned pairs and over the others, each with its 95% Wilson
  interval, their difference, and Fisher's exact test of it (two-sided; the two groups are different
  pairs, not the same pairs twice, so not McNemar);
- **by length**: the same for the pairs whose bad sentence has more tokens (``+``: raw acc favoured, bad's
  log-prob sums more terms) against the others (``0`` and ``-``).

A phenomenon is tested only where each group has at least ``MIN_GROUP`` pairs; otherwise its row holds the
counts and no test. With a sweep, ``split_acquisition`` gives the step from which the aligned pairs' (and
the unaligned pairs') acc_norm stays at or above the threshold, as ``curves.acquisition_step`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .curves import DEFAULT_THRESHOLD, acquisition_step
from .stats import METRICS, OUTCOME_NOT_FINITE, OUTCOME_PASS, Outcomes, wilson_interval

__all__ = [
    "MIN_GROUP",
    "format_edit_splits",
    "format_runs_by_edit",
    "runs_by_edit",
    "split_acquisition",
    "split_by_edit",
    "split_rows",
]

MIN_GROUP = 5
SPLITS = {  # split name -> (label of the group, label of the rest, does pair i belong to the group)
    "alignment": ("aligned", "unaligned", lambda aligned, sign: aligned == "1"),
    "length": ("bad_longer", "bad_not_longer", lambda aligned, sign: sign == "+"),
}


def edit_marks(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """(aligned, length_sign) strings of a record; None when it has no alignment (older results, no offsets)."""
    marks = record.get("edit_tokens") or {}
    if not marks.get("aligned") or not marks.get("length_sign"):
        return None
    return marks["aligned"], marks["length_sign"]


def _group(outcomes: str, indices: Sequence[int]) -> dict[str, Any]:
    finite = [i for i in indices if outcomes[i] != OUTCOME_NOT_FINITE]
    passed = sum(outcomes[i] == OUTCOME_PASS for i in finite)
    n = len(finite)
    return {"n": n, "passed": passed, "acc": passed / n if n else None, "ci": list(wilson_interval(passed, n)) if n else None}


def _compare(outcomes: str, inside: Sequence[int], outside: Sequence[int]) -> dict[str, Any]:
    from scipy.stats import fisher_exact

    a, b = _group(outcomes, inside), _group(outcomes, outside)
    row: dict[str, Any] = {"in": a, "out": b, "difference": None, "p_value": None}
    if a["n"] >= MIN_GROUP and b["n"] >= MIN_GROUP:
        table = [[a["passed"], a["n"] - a["passed"]], [b["passed"], b["n"] - b["passed"]]]
        row["difference"] = a["acc"] - b["acc"]
        row["p_value"] = float(fisher_exact(table).pvalue)
    return row


def split_by_edit(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{split: {"groups": [in, out], metric: {"overall": row, "phenomena": {name: row}}}}``; None without marks.

    A row: ``in`` and ``out`` (``n``, ``passed``, ``acc``, Wilson ``ci``), ``difference`` (in minus out) and
    Fisher's ``p_value``, both None where a group has fewer than ``MIN_GROUP`` pairs.
    """
    marks = edit_marks(record)
    if marks is None:
        return None
    outcomes = Outcomes.from_record(record)
    aligned, signs = marks
    if not len(aligned) == len(signs) == len(outcomes.phenomena):
        raise ValueError(f"edit_tokens hold {len(aligned)} pairs, the outcomes {len(outcomes.phenomena)}")
    groups = {"overall": list(range(len(aligned))), **outcomes.groups()}
    result: dict[str, Any] = {}
    for split, (inside_name, outside_name, belongs) in SPLITS.items():
        member = [belongs(aligned[i], signs[i]) for i in range(len(aligned))]
        result[split] = {"groups": [inside_name, outside_name]}
        for metric in METRICS:
            text = getattr(outcomes, metric)
            rows = {
                name: _compare(text, [i for i in indices if member[i]], [i for i in indices if not member[i]])
                for name, indices in groups.items()
            }
            overall = rows.pop("overall")
            result[split][metric] = {"overall": overall, "phenomena": rows}
    return result


def split_acquisition(records: Sequence[Mapping[str, Any]], threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any] | None:
    """A sweep's acquisition step of its aligned and unaligned pairs' acc_norm (``{"aligned": step, ...}``),
    with each step's two accuracies (``curve``); None when the records carry no alignment."""
    points: dict[str, list[tuple[int, float]]] = {"aligned": [], "unaligned": []}
    for record in records:
        marks = edit_marks(record)
        if marks is None or "step" not in record:
            return None
        outcomes = Outcomes.from_record(record).acc_norm
        aligned = marks[0]
        for name, want in (("aligned", "1"), ("unaligned", "0")):
            group = _group(outcomes, [i for i, mark in enumerate(aligned) if mark == want])
            points[name].append((record["step"], group["acc"]))
    if not points["aligned"]:
        return None
    return {
        "threshold": threshold,
        **{f"{name}_step": acquisition_step(values, threshold) for name, values in points.items()},
        "curve": [[step, a, u] for (step, a), (_, u) in zip(points["aligned"], points["unaligned"])],
    }


def _cell(group: Mapping[str, Any]) -> str:
    if not group["n"]:
        return "- (0)"
    low, high = group["ci"]
    return f"{group['acc']:.3f} [{low:.3f}, {high:.3f}] ({group['n']})"


def split_rows(data: Mapping[str, Any], phenomena: bool = True) -> list[list[str]]:
    """One split's rows for a table: group, metric, each side's accuracy [95% CI] (n), the difference, Fisher's p."""
    rows = []
    for metric in METRICS:
        groups = {"overall": data[metric]["overall"], **(data[metric]["phenomena"] if phenomena else {})}
        for name, row in groups.items():
            difference = "-" if row["difference"] is None else f"{row['difference']:+.3f}"
            p_value = "-" if row["p_value"] is None else f"{row['p_value']:.3g}"
            rows.append([name, metric, _cell(row["in"]), _cell(row["out"]), difference, p_value])
    return rows


def format_edit_splits(label: str, splits: Mapping[str, Any], phenomena: bool = True) -> str:
    """A Markdown table per split of one run: each group's accuracy [95% CI] (n), the difference and Fisher's p."""
    out = []
    for split, data in splits.items():
        inside, outside = data["groups"]
        out += [f"#### {label}: acc and acc_norm by {split} ({inside} / {outside})", ""]
        out += [f"| group | metric | {inside} | {outside} | difference | p (Fisher) |", "|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(row) + " |" for row in split_rows(data, phenomena)]
        out.append("")
    return "\n".join(out)


def runs_by_edit(runs: Sequence[Any], threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """Each run's (``results.runs.Run``) ``split_by_edit`` at its compared record, and for a sweep its
    ``split_acquisition`` at ``threshold`` through the compared step; runs whose records carry no alignment are left
    out."""
    by_label = {}
    for run in runs:
        splits = split_by_edit(run.record)
        if splits is not None:
            acquisition = split_acquisition(run.records_up_to_step, threshold) if run.is_sweep else None
            by_label[run.label] = {"splits": splits, "acquisition": acquisition}
    return by_label


def format_runs_by_edit(by_label: Mapping[str, Any], phenomena: bool = True) -> str:
    """``runs_by_edit`` as Markdown: each run's split tables, and a sweep's acquisition steps of both groups."""
    out = []
    for label, data in by_label.items():
        out.append(format_edit_splits(label, data["splits"], phenomena))
        if data["acquisition"] is not None:
            out.append(acquisition_line(label, data["acquisition"]) + "\n")
    return "\n".join(out)


def acquisition_line(label: str, acquisition: Mapping[str, Any]) -> str:
    """A sweep's acc_norm acquisition steps of the aligned and unaligned pairs, as one line."""
    steps = {name: acquisition[f"{name}_step"] for name in ("aligned", "unaligned")}
    return f"{label}: acc_norm acquisition step (>= {acquisition['threshold']} through the last evaluation): " + ", ".join(
        f"{name} pairs {'not acquired' if step is None else step}" for name, step in steps.items()
    )
