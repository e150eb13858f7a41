"""The report's sections on how the runs learned: regression alerts, fitted acquisition steps with trends, and
the order of acquisition of two runs side by side.

Alerts are those the callback wrote in its history file (``alerts`` in each record); for a sweep, or a run
without them, the report replays the monitor over the records with the default thresholds and says so.
"""

from __future__ import annotations

import math
from html import escape

from ..commands.compare import Comparison, learning_rows
from ..results.positions import axis_of, readable
from ..results.regressions import RegressionAlert, recorded_alerts, replay_alerts
from ..results.runs import Run


def _table(header, rows, cls: str, attrs: str = "") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join(
        row if isinstance(row, str) else "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<div class="scroll"><table class="{cls}" {attrs}><tr>{head}</tr>{body}</table></div>'


def run_alerts(run: Run) -> tuple[list[RegressionAlert], bool]:
    """(alerts, recorded): the alerts of ``run``'s history file, else those replayed over its records."""
    try:
        recorded = recorded_alerts(run.records_up_to_step)
        if recorded is not None:
            return recorded, True
        return replay_alerts(run.records_up_to_step), False
    except ValueError:  # records without per-pair outcomes: nothing to replay
        return [], False


def _alerts_section(sweeps: list[Run]) -> str:
    parts = [
        "<h2>Regression alerts</h2>",
        '<div class="meta">A phenomenon or overall score significantly below earlier evaluations (exact tests on '
        "the pairs) by at least 5 points of acc_norm, once until it recovers (alerts written by the callback: by its "
        "own alert_min_drop and alert_q, 5 points and 0.05 by default). Replayed and default alerts hold a "
        "false-alarm rate of 0.05 for the whole run (the last 1, 2 and 3 evaluations compared with each of the 4 "
        "windows of as many before them, and the latest with the best earlier one, each evaluation spending its own "
        "share, evenly over the run's planned evaluations where its records name the plan); alerts written in the "
        "per_evaluation mode: q &lt; 0.05 at each evaluation (Benjamini-Hochberg). The reference is the best earlier "
        "evaluation unless marked &ldquo;previous&rdquo;, &ldquo;earlier&rdquo; (one of the 3 before the previous), "
        "or &ldquo;last 2&rdquo; or &ldquo;last 3&rdquo; (the pooled score of the last 2 or 3 evaluations against "
        "that of as many earlier ones, from the reference step on).</div>",
    ]
    for run in sweeps:
        alerts, recorded = run_alerts(run)
        source = "written by the callback" if recorded else "replayed by the report with the default thresholds"
        axis = axis_of(run.records_up_to_step)  # a revision series: tokens or words
        rows = [
            f'<tr class="alert" data-step="{a.step}" data-group="{escape(a.key)}"><td>{readable(a.step, axis)}</td>'
            f'<td style="text-align: left">{escape(a.key)}</td>'
            f"<td>{readable(a.best_step, axis)}{'' if a.reference == 'best' else f' ({a.reference})'}</td><td>{a.best_score:.4f}</td>"
            f"<td>{a.score:.4f}</td><td>{a.q_value:.2g}</td></tr>"
            for a in alerts
        ]
        parts.append(
            f'<h3>{escape(run.label)}: <b class="alert-count">{len(alerts)}</b> alert{"s" if len(alerts) != 1 else ""} '
            f'<span class="meta">({source})</span></h3>'
        )
        if rows:
            header = [axis, "what", f"reference {axis}", "reference acc_norm", "acc_norm", "q"]
            parts.append(_table(header, rows, "alerts", f'data-run="{escape(run.label)}"'))
    return "".join(parts)


def _fits_section(comparison: Comparison) -> str:
    header, rows = learning_rows(comparison)
    if not rows:
        return ""
    axis = escape(axis_of(r for run in comparison.runs if run.is_sweep for r in run.records_up_to_step))
    return (
        "<h2>Acquisition fits and trends</h2>"
        f'<div class="meta">Fitted {axis}: the midpoint of a logistic curve in log(1 + {axis}) from chance (0.5) to a fitted '
        "plateau, with a 95% bootstrap interval over pairs (200 draws, seeded). Trend: the latest evaluation against the "
        "one three evaluations earlier, pair by pair (rising or falling where the BH-adjusted McNemar q &lt; 0.05).</div>"
        + _table(header, rows, "fits")
    )


def _order_section(comparison: Comparison) -> str:
    orders = comparison.orders()
    if not orders:
        return ""
    parts = ["<h2>Order of acquisition</h2>"]
    base = comparison.baseline.label
    for label, order in orders.items():
        tau = "n/a" if math.isnan(order.tau) else f"{order.tau:+.3f}"
        p = "" if math.isnan(order.p_value) else f" (p = {order.p_value:.3g})"
        parts.append(
            f'<h3>{escape(label)} against {escape(base)}: Kendall\'s tau <b class="tau" data-run="{escape(label)}">{tau}</b>'
            f"{p} over {len(order.phenomena)} phenomena both acquired</h3>"
        )
        length = max(len(order.order_a), len(order.order_b))
        rows = [
            f"<tr><td>{rank + 1}</td>"
            + "".join(
                f'<td style="text-align: left">{escape(names[rank]) if rank < len(names) else ""}</td>'
                for names in (order.order_a, order.order_b)
            )
            + "</tr>"
            for rank in range(length)
        ]
        parts.append(_table(["#", f"{base} (earliest first)", f"{label} (earliest first)"], rows, "order"))
    return "".join(parts)


def learning_sections(comparison: Comparison) -> list[str]:
    """The HTML of the alerts, fits-and-trends and order sections (empty without a sweep)."""
    sweeps = [run for run in comparison.runs if run.is_sweep]
    if not sweeps:
        return []
    return [section for section in (_alerts_section(sweeps), _fits_section(comparison), _order_section(comparison)) if section]
