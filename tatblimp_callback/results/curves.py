"""Curves over training steps: when each phenomenon is acquired, and plots of the curves.

A history is a list of dicts, one per evaluation, each with ``step`` and flat metric keys such as
``tatblimp/acc_norm`` and ``tatblimp/<phenomenon>/acc_norm`` (``TatBLiMPCallback.history``; a
sweep's JSONL records become one with ``history_from_records``). A curve's 95% interval, where the
history has it, is under ``<key>_ci_low`` and ``<key>_ci_high`` (e.g. ``tatblimp/acc_norm_ci_low``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..reading.data import OFFICIAL_ORDER
from ..reading.option_types import accuracy

DEFAULT_THRESHOLD = 0.75


def acquisition_step(points: Iterable[tuple[int, float]], threshold: float = DEFAULT_THRESHOLD) -> int | None:
    """The first step from which the value is at least ``threshold`` at every later evaluation.

    ``points`` are (step, value) pairs in any order; they are sorted by step. A NaN value counts
    as below the threshold. None when the last evaluation is below the threshold or there are no
    points: a phenomenon that dips below again after crossing is not acquired until it recovers
    for good.
    """
    acquired = None
    for step, value in sorted(points, key=lambda point: point[0]):
        if value is not None and not math.isnan(value) and value >= threshold:
            if acquired is None:
                acquired = step
        else:
            acquired = None
    return acquired


def phenomena_in(history: Sequence[Mapping[str, Any]], metric: str = "acc_norm", prefix: str = "tatblimp") -> list[str]:
    """Phenomenon names with a ``{prefix}/<name>/{metric}`` key in the history, in first-seen order."""
    names: dict[str, None] = {}
    start, end = f"{prefix}/", f"/{metric}"
    for entry in history:
        for key in entry:
            if key.startswith(start) and key.endswith(end):
                name = key[len(start) : -len(end)]
                if name and "/" not in name:
                    names.setdefault(name, None)
    return list(names)


def acquisition_steps(
    history: Sequence[Mapping[str, Any]],
    threshold: float = DEFAULT_THRESHOLD,
    metric: str = "acc_norm",
    prefix: str = "tatblimp",
    use_lower_bound: bool = False,
) -> dict[str, int | None]:
    """``acquisition_step`` of every phenomenon's ``{prefix}/<phenomenon>/{metric}`` curve.

    ``history`` is flat entries (``TatBLiMPCallback.history``) or records with ``step`` and ``Results.to_dict()``'s
    keys (the lines of a sweep's or the callback's history file), as ``plot_curves`` takes.
    With ``use_lower_bound`` the curve is the lower end of its 95% interval (``..._ci_low``): acquired
    means above the threshold with 95% confidence. A history without those keys raises ValueError.
    """
    history = as_history(history, prefix)
    steps = {}
    for name in phenomena_in(history, metric, prefix):
        key = f"{prefix}/{name}/{metric}"
        entries = [entry for entry in history if key in entry]
        if use_lower_bound:
            missing = [entry["step"] for entry in entries if f"{key}_ci_low" not in entry]
            if missing:
                raise ValueError(
                    f"no interval ({key}_ci_low) at step(s) {missing[:5]}: the lower-bound acquisition needs results "
                    "with intervals (sweep records, score --output JSON or a history file written from Results.to_dict)"
                )
            key += "_ci_low"
        steps[name] = acquisition_step([(entry["step"], entry[key]) for entry in entries], threshold)
    return steps


def flat_record(record: Mapping[str, Any], prefix: str = "tatblimp", phenomenon_intervals: bool = True) -> dict[str, Any]:
    """A history entry from one ``score --output`` / sweep record: ``step`` and the flat metrics.

    The overall intervals become ``{prefix}/acc_ci_low`` ... as in ``Results.flat_metrics``; with
    ``phenomenon_intervals`` each phenomenon's too (``{prefix}/<name>/acc_norm_ci_low``, ...).
    """
    flat: dict[str, Any] = {"step": record.get("step")}
    for key in ("acc", "acc_norm", "bits_per_byte_good", "tokens_per_byte"):
        if key in record:
            flat[f"{prefix}/{key}"] = record[key]
    _flat_intervals(flat, f"{prefix}/", record)
    for name, group in record.get("phenomena", {}).items():
        flat[f"{prefix}/{name}/acc"] = group["acc"]
        flat[f"{prefix}/{name}/acc_norm"] = group["acc_norm"]
        if phenomenon_intervals:
            _flat_intervals(flat, f"{prefix}/{name}/", group)
    return flat


def _flat_intervals(flat: dict[str, Any], start: str, group: Mapping[str, Any]) -> None:
    for metric in ("acc", "acc_norm"):
        if group.get(f"{metric}_ci") is not None:
            flat[f"{start}{metric}_ci_low"], flat[f"{start}{metric}_ci_high"] = group[f"{metric}_ci"]


def as_history(entries: Sequence[Mapping[str, Any]], prefix: str = "tatblimp") -> list[Mapping[str, Any]]:
    """``entries`` as history entries: records with ``Results.to_dict()``'s keys go through ``flat_record``,
    flat entries stay as they are."""
    return [flat_record(entry, prefix) if "phenomena" in entry else entry for entry in entries]


def history_from_records(records: Sequence[Mapping[str, Any]], prefix: str = "tatblimp") -> list[dict[str, Any]]:
    """A history (sorted by step) from sweep records."""
    return sorted((flat_record(r, prefix) for r in records), key=lambda entry: entry["step"])


def plot_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    metric: str = "acc_norm",
    title: str | None = None,
    threshold: float | None = DEFAULT_THRESHOLD,
    prefix: str = "tatblimp",
) -> None:
    """Draw one run's curves over steps to an image: overall ``metric``, then one panel per phenomenon.

    ``history`` is ``TatBLiMPCallback.history``, or records with ``step`` and ``Results.to_dict()``'s
    keys (a sweep's lines, the callback's history file), whose intervals are drawn for every panel.
    """
    plot_runs({title or "run": history}, path, metric=metric, title=title, threshold=threshold, prefix=prefix)


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike,
    metric: str = "acc_norm",
    title: str | None = None,
    threshold: float | None = DEFAULT_THRESHOLD,
    prefix: str = "tatblimp",
    levels: Mapping[str, Mapping[str, Any]] | None = None,
    x_label: str = "step",
) -> None:
    """Draw several runs' curves over steps (one line per run) to an image file (PNG, SVG, PDF, ...).

    The first panel is the overall ``{prefix}/{metric}``; then one panel per phenomenon, in the benchmark's
    order. Where the history has a curve's interval (``<key>_ci_low``, ``<key>_ci_high``) it is drawn as a band
    around the line (an error bar for a run of one point, drawn as a large marker). A dashed line marks
    ``threshold`` (None: no line), a dotted one chance (0.5); the legend names every line. A history may also be
    records with ``Results.to_dict()``'s keys (see ``plot_curves``). ``levels``: results without a step
    (label -> entry or record), each drawn as a horizontal line. ``x_label``: what the steps count (a sweep of Hub
    revisions may count tokens or words, its ticks then read ``4B``). Needs matplotlib
    (``pip install tatblimp-callback[plot]``).
    """
    plt = require_matplotlib()
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from .positions import readable

    levels = {label: as_history([entry], prefix)[0] for label, entry in (levels or {}).items()}
    if not any(runs.values()) and not levels:
        raise ValueError("nothing to plot: every history is empty")
    runs = {label: as_history(history, prefix) for label, history in runs.items()}
    names: dict[str, None] = {}
    for history in [*runs.values(), list(levels.values())]:
        names.update(dict.fromkeys(phenomena_in(history, metric, prefix)))
    panels = [("overall", f"{prefix}/{metric}")] + [(name, f"{prefix}/{name}/{metric}") for name in benchmark_order(names)]
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows + 0.8), squeeze=False)
    colors = dict(zip([*runs, *levels], plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10))
    for axis, (name, key) in zip(axes.flat, panels):
        for label, history in runs.items():
            _draw_run(axis, label, history, key, colors[label])
        for label, entry in levels.items():
            if key in entry:
                axis.axhline(entry[key], color=colors[label], linestyle="-.", linewidth=1.2, label=f"{label} (no step)")
        if threshold is not None:
            axis.axhline(threshold, color="grey", linestyle="--", linewidth=0.8, label=f"threshold ({threshold:g})")
        axis.axhline(0.5, color="darkgrey", linestyle=":", linewidth=0.8, label="chance (0.5)")
        axis.set_ylim(-0.02, 1.02)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        if x_label != "step":  # counts of tokens or words: 4B, not 4 and an offset of 1e9
            axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _, axis=x_label: readable(value, axis)))
        axis.set_title(name, fontsize=8, fontweight="bold" if name == "overall" else "normal")
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    figure.supxlabel(x_label, fontsize=8)
    figure.supylabel(metric, fontsize=8)
    handles = {}
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    order = [*runs, *(f"{label} (no step)" for label in levels)]  # the runs first, then the reference lines
    legend = {
        label: handles[label] for label in sorted(handles, key=lambda name: order.index(name) if name in order else len(order))
    }
    height = figure.get_figheight()  # inches: the title and the legend above the panels take fixed room
    figure.suptitle(title or f"TatBLiMP {metric}", fontsize=10, y=1 - 0.08 / height, va="top")
    columns = len(legend) if len(legend) <= 5 else 4
    figure.legend(
        legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height), ncol=columns, fontsize=7
    )
    figure.tight_layout(rect=(0, 0, 1, 1 - (0.3 + 0.16 * math.ceil(len(legend) / columns)) / height))
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)  # as the commands' other output files
    figure.savefig(os.fspath(path), dpi=110)
    plt.close(figure)


def _draw_run(axis, label: str, history: Sequence[Mapping[str, Any]], key: str, color: str) -> None:
    """One run's curve of ``key`` in one panel: a line with its interval band, or a marker with an error bar."""
    points = sorted((entry["step"], entry[key]) for entry in history if key in entry)
    if not points:
        return
    steps, values = zip(*points)
    band = sorted((e["step"], e[f"{key}_ci_low"], e[f"{key}_ci_high"]) for e in history if f"{key}_ci_low" in e)
    if len(points) == 1:  # a single result: a marker at its step
        error = None
        if band:
            error = [[values[0] - band[0][1]], [band[0][2] - values[0]]]
        axis.errorbar(steps, values, yerr=error, color=color, marker="D", markersize=5, capsize=2, linewidth=1, label=label)
        return
    axis.plot(steps, values, color=color, marker="o", markersize=2.5, linewidth=1.2, label=label, gid=f"curve:{label}:{key}")
    if band:
        band_steps, lows, highs = zip(*band)
        axis.fill_between(band_steps, lows, highs, color=color, alpha=0.2, linewidth=0)


def benchmark_order(names: Iterable[str]) -> list[str]:
    """Phenomenon names in the order of the official benchmark file; others after them, in the order given."""
    official = {name: index for index, name in enumerate(OFFICIAL_ORDER)}
    names = list(names)
    return sorted(names, key=lambda name: (official.get(name, len(official)), names.index(name)))


def require_matplotlib():
    """``matplotlib.pyplot`` with the Agg backend; ImportError with the install line when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'tatblimp-callback[plot]'") from err
    return plt


def check_image_path(path: str | os.PathLike, option: str) -> None:
    """ValueError naming ``option`` when ``path`` does not end in a format matplotlib writes: it would write a
    path without a suffix as ``PATH.png``, and stop on another suffix only once the drawing is done."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"{option} {path}: not an image file name; end it in .png, .svg or .pdf ({', '.join(sorted(formats))})")


def add_acquisition_arguments(parser) -> None:
    """``--threshold`` and ``--acquisition``, the options of ``sweep`` and ``compare`` that define "acquired"."""
    parser.add_argument(
        "--threshold", type=accuracy, default=DEFAULT_THRESHOLD, help="acc_norm that counts as acquired (default 0.75)"
    )
    parser.add_argument(
        "--acquisition",
        choices=("estimate", "lower-bound"),
        default="estimate",
        help="acquired when acc_norm (estimate, default) or its 95%% interval's lower bound stays >= threshold",
    )
