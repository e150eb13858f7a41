"""``tatblimp compare``'s reading of how the sweeps learned: each sweep's fitted acquisition steps and trends,
the order of acquisition of each against the baseline (Kendall's tau), as table rows and lines (``learning.py``).
"""

from __future__ import annotations

import math

from ..results.positions import axis_of


def _fmt_p(p: float) -> str:
    return f"{p:.1e}" if p < 0.01 else f"{p:.3f}"


def learning_rows(comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of each sweep's fitted acquisition step [95% interval] (or why there is none) and latest
    trend, per phenomenon; no rows without a sweep."""
    learning = {label: summary for label, summary in comparison.learning().items() if summary is not None}
    if not learning:
        return [], []
    axes = {run.label: axis_of(run.records) for run in comparison.runs}  # a revision series: tokens or words
    header = ["phenomenon"]
    for label in learning:
        header += [f"{label}: fitted {axes[label]} [95%]", f"{label}: trend"]
    names: dict[str, None] = {}
    for summary in learning.values():
        names.update(dict.fromkeys(summary.fits))
    rows = []
    for name in names:
        row = [name]
        for label, summary in learning.items():
            fit, trend = summary.fits.get(name), summary.trends.get(name)
            row += [fit.describe(axes[label]) if fit is not None else "-", trend.direction if trend is not None else "-"]
        rows.append(row)
    return header, rows


def order_lines(comparison) -> list[str]:
    """Kendall's tau between the baseline's order of acquisition and each other sweep's, and the orders."""
    lines = []
    learning = comparison.learning()
    for label, order in comparison.orders().items():
        tau = "n/a (fewer than 2 phenomena acquired by both)" if math.isnan(order.tau) else f"{order.tau:+.3f}"
        p = "" if math.isnan(order.p_value) else f", p = {_fmt_p(order.p_value)}"
        lines.append(
            f"learning order, {label} against {comparison.baseline.label}: Kendall's tau {tau}{p} "
            f"over {len(order.phenomena)} phenomena both acquired (fitted steps)"
        )
        for run_label, names in ((comparison.baseline.label, order.order_a), (label, order.order_b)):
            lines.append(f"  {run_label}: {' < '.join(names) if names else 'none acquired'}")
    missing = [label for label, summary in learning.items() if summary is None]
    if missing:
        lines.append(f"no fitted acquisition for {', '.join(missing)}: the file has no per-pair outcomes")
    return lines
