"""Inline SVG charts for the HTML report: curves with 95% bands, and a phenomenon x step heatmap.

Plain strings of SVG, drawn here in Python, so that the report needs no script, library or font
from anywhere: it opens from disk, from a mail attachment or in a wandb panel as it is. The x axis is
the steps, or what a revision series is placed by (``axis``: tokens, words), its values written as ``4B``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

from ..results.positions import readable

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


@dataclass
class Series:
    """One line of a chart: (step, value) points and, where known, each point's 95% interval and its name (the
    revision of a Hub series)."""

    label: str
    points: list[tuple[int, float]]
    bands: list[tuple[int, float, float]] = field(default_factory=list)  # (step, low, high)
    color: str = PALETTE[0]
    names: dict[int, str] = field(default_factory=dict)  # step -> revision name


def _finite(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About ``count`` round tick values from ``low`` to ``high``."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def line_chart(
    series: Sequence[Series],
    title: str,
    *,
    threshold: float | None = None,
    width: int = 540,
    height: int = 280,
    chart_id: str = "",
    axis: str = "step",
) -> str:
    """An SVG chart of accuracies (y from 0 to 1) over steps (or the tokens or words of ``axis``): lines with points,
    95% bands, chance and threshold lines."""
    left, right, top, bottom = 46, 26, 28, 38  # right: room for half of the last step label, centred on its tick
    legend = legend_layout([line.label[:30] for line in series], left + 8 + 7.5 * len(title), left, width - right)
    top += LEGEND_ROW * max(row for _, row in legend or [(0, 0)])  # rows of legend below the title push the plot down
    steps = [s for line in series for s, _ in line.points]
    x_low, x_high = (min(steps), max(steps)) if steps else (0, 1)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1

    def x(step: float) -> float:
        return left + (step - x_low) / (x_high - x_low) * (width - left - right)

    def y(value: float) -> float:
        return top + (1 - value) * (height - top - bottom)

    parts = [
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{left}" y="16" class="chart-title">{escape(title)}</text>',
    ]
    for value in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" class="tick" text-anchor="end">{value:g}</text>')
    for step in _ticks(x_low, x_high):
        text = f"{step:g}" if axis == "step" else readable(step, axis)
        parts.append(f'<text x="{x(step):.1f}" y="{height - bottom + 16}" class="tick" text-anchor="middle">{text}</text>')
    parts.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 6}" class="tick x-label" text-anchor="middle">{escape(axis)}</text>'
    )
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0.5):.1f}" y2="{y(0.5):.1f}" class="chance"/>')
    if threshold is not None:
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(threshold):.1f}" y2="{y(threshold):.1f}" class="threshold"/>'
        )
    for line in series:
        bands = sorted(b for b in line.bands if _finite(b[1]) and _finite(b[2]))
        if len(bands) > 1:
            outline = [f"{x(s):.1f},{y(high):.1f}" for s, _, high in bands]
            outline += [f"{x(s):.1f},{y(low):.1f}" for s, low, _ in reversed(bands)]
            parts.append(f'<polygon class="band" points="{" ".join(outline)}" fill="{line.color}"/>')
        points = sorted((s, v) for s, v in line.points if _finite(v))
        if len(points) > 1:
            path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
            parts.append(f'<polyline class="curve" points="{path}" stroke="{line.color}"/>')
        for s, v in points:
            where = f"{axis} {readable(s, axis)}" + (f" ({line.names[s]})" if s in line.names else "")
            parts.append(
                f'<circle class="point" cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.6" fill="{line.color}">'
                f"<title>{escape(line.label)} {escape(where)}: {v:.4f}</title></circle>"
            )
    for line, (x_legend, row) in zip(series, legend):  # the legend, from the title's line on: it never covers a curve
        parts.append(f'<rect x="{x_legend:.0f}" y="{7 + LEGEND_ROW * row}" width="10" height="10" fill="{line.color}"/>')
        parts.append(f'<text x="{x_legend + 14:.0f}" y="{16 + LEGEND_ROW * row}" class="legend">{escape(line.label[:30])}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


LEGEND_ROW = 15  # pixels between two rows of legend
LEGEND_CHAR = 6.5  # the width of a legend character, an estimate on the safe side for 11px system fonts


def legend_layout(labels: Sequence[str], start: float, left: float, right: float) -> list[tuple[float, int]]:
    """(x, row) of each legend entry (a 10px swatch, 4px, the label): on the title's row from ``start``, and
    on new rows from ``left`` where an entry would pass ``right``, the plot's right edge."""
    placed, x, row = [], start, 0
    for label in labels:
        extent = 14 + LEGEND_CHAR * len(label)
        if x + extent > right and x > left:
            x, row = left, row + 1
        placed.append((x, row))
        x += extent + 10
    return placed


def heat_color(value: float | None) -> str:
    """A diverging colour for an accuracy: red below chance (0.5), white at it, blue above; grey for none."""
    if not _finite(value):
        return "#dddddd"
    low, mid, high = (178, 24, 43), (247, 247, 247), (33, 102, 172)
    share = min(max(value, 0.0), 1.0)
    start, end, t = (low, mid, share / 0.5) if share < 0.5 else (mid, high, (share - 0.5) / 0.5)
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(start, end))


def heatmap(
    rows: Sequence[str],
    steps: Sequence[int],
    values: Mapping[tuple[str, int], float],
    title: str,
    *,
    chart_id: str = "",
    marks: Mapping[str, int | None] | None = None,
    axis: str = "step",
) -> str:
    """An SVG grid: one row per phenomenon, one column per step, each cell coloured by its value and labelled.

    ``marks``: per row, a step whose cell gets a black outline (the acquisition step). ``axis``: what the steps
    count (tokens, words: the columns read ``4B``).
    """
    label_width, cell_w, cell_h, top = 210, max(34, min(90, 760 // max(len(steps), 1))), 20, 30
    marks_width = 110 if marks is not None else 0
    width, height = label_width + cell_w * len(steps) + marks_width + 8, top + cell_h * len(rows) + 30
    parts = [
        f'<svg class="heatmap" id="{escape(chart_id)}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="16" class="chart-title">{escape(title)}</text>',
    ]
    for column, step in enumerate(steps):
        parts.append(
            f'<text x="{label_width + cell_w * (column + 0.5):.1f}" y="{height - 12}" class="tick" '
            f'text-anchor="middle">{readable(step, axis)}</text>'
        )
    parts.append(f'<text x="{label_width - 6}" y="{height - 12}" class="tick x-label" text-anchor="end">{escape(axis)}</text>')
    if marks is not None:
        parts.append(f'<text x="{label_width + cell_w * len(steps) + 8}" y="{top - 6}" class="tick">acquired at</text>')
    for row, name in enumerate(rows):
        y = top + cell_h * row
        parts.append(f'<text x="{label_width - 6}" y="{y + 14}" class="tick" text-anchor="end">{escape(name)}</text>')
        if marks is not None:
            acquired = "never" if marks.get(name) is None else f"{axis} {readable(marks[name], axis)}"
            parts.append(f'<text x="{label_width + cell_w * len(steps) + 8}" y="{y + 14}" class="tick">{acquired}</text>')
        for column, step in enumerate(steps):
            value = values.get((name, step))
            x = label_width + cell_w * column
            mark = marks is not None and marks.get(name) == step
            outline = ' stroke="#000" stroke-width="2"' if mark else ""
            text = f"{value:.2f}" if _finite(value) else "-"
            ink = "#fff" if _finite(value) and abs(value - 0.5) > 0.32 else "#222"
            parts.append(
                f'<rect class="cell" x="{x}" y="{y}" width="{cell_w - 1}" height="{cell_h - 1}" '
                f'fill="{heat_color(value)}"{outline}><title>{escape(name)} {escape(axis)} {readable(step, axis)}: {text}</title></rect>'
            )
            parts.append(f'<text x="{x + cell_w / 2:.1f}" y="{y + 14}" class="cell-text" fill="{ink}">{text}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
