"""A run's false-alarm budget for regression alerts: how much of ``alert_q`` each evaluation may spend.

The pooled mode of ``regressions.RegressionMonitor`` (the default) and its per-run mode hold the chance that a run
which never regresses raises any alert at or below ``alert_q``, whatever the number of evaluations, by a union
bound:

- the j-th comparison of the run (its (j+1)-th evaluation) may spend ``alert_q * look_share(j)``, and the shares
  sum to at most 1 over any number of evaluations (``look_share``), so the number of evaluations need not be
  known in advance; where it is (a plan: a Trainer knows its ``max_steps``), ``Spending`` spreads
  ``1 - PLAN_RESERVE`` evenly over the planned comparisons and keeps the reserve for comparisons beyond the plan,
  spent by ``look_share``;
- within an evaluation that share is split over the groups compared (overall and each phenomenon, of TatBLiMP
  and of each suite) by Holm's step-down (``holm_adjust``), valid whatever the dependence between the groups;
- within a group, the share is split over its tests by weights that add up to 1 (weighted Bonferroni). Per run:
  half to the comparison with the previous evaluation and half to the one with the best earlier evaluation, whose
  p-value is multiplied by the number of earlier evaluations it was chosen from, which accounts for choosing the
  best (``group_p_value``). Pooled: ``WIDTH_WEIGHTS`` to the last 1, 2 and 3 evaluations, each width's weight
  split evenly over its windows against the earlier windows of as many evaluations (``alert_windows.py``), and
  ``BEST_WEIGHT`` to the best, chosen alike; while a group has too few evaluations for some windows, the tests
  that fit share the whole (``pooled_weights``, ``pooled_group_p_value``).

The comparisons of two evaluations are exact one-sided McNemar tests on the pairs only one of them passes
(``fall_p_value``); the windows' are exact sign-flip tests. Everything here takes numpy arrays as well as numbers, so that the false-alarm benchmark
(``benchmarks/bench_alert_false_alarms.py``) runs the same arithmetic over thousands of simulated runs at once.
"""

from __future__ import annotations

import math

from . import alert_windows

# look_share(j) = 1 / (SPENDING_NORMALISER * (j + SPENDING_OFFSET) * ln(j + SPENDING_OFFSET)^2). The normaliser is
# the sum of the first million terms plus 1 / ln(10^6 + offset), which bounds the rest from above (the integral
# of 1 / (x ln^2 x) from there on), so the shares sum to at most 1 (tested). The offset of 10 moves budget from the
# first few evaluations (while a model learns fast, falls are rare) to the tens and hundreds.
SPENDING_OFFSET = 10
SPENDING_NORMALISER = 0.42515696619253746
PREVIOUS_SHARE = 0.5  # per_run: of a group's share, the comparison with the previous evaluation; the rest, the best
# pooled: of a group's share, the windows of the last 1, 2 and 3 evaluations (each width's split evenly over its
# alert_windows.REFERENCES earlier windows) and the best. Chosen on the false-alarm benchmark's detection runs with
# seed 1 (the long-runs guide reports seed 0): the width-3 windows find a moderate fall within 2 evaluations, the
# last evaluation finds a large one at once.
WIDTH_WEIGHTS = (0.2, 0.1, 0.65)
BEST_WEIGHT = 0.05
PLAN_RESERVE = 0.1  # with a plan: of the run's budget, what comparisons beyond it may spend (the long-runs guide)


def look_share(j):
    """The share of the run's budget the j-th comparison may spend (j = 1 at the second evaluation)."""
    import numpy as np  # in each function, not at the top: `tatblimp --help` loads no numpy

    x = np.asarray(j, dtype=float) + SPENDING_OFFSET
    share = 1.0 / (SPENDING_NORMALISER * x * np.log(x) ** 2)
    return float(share) if np.ndim(share) == 0 else share


def fall_p_value(baseline_only, run_only):
    """Exact one-sided McNemar p-value of a fall: P(Binomial(b + c, 1/2) >= b), b the pairs only the reference
    passes, c those only the later evaluation passes; 1 where there is no discordant pair."""
    import numpy as np
    from scipy.stats import binom

    b, c = np.asarray(baseline_only), np.asarray(run_only)
    p = np.where(b + c > 0, binom.sf(b - 1, b + c, 0.5), 1.0)
    return float(p) if np.ndim(p) == 0 else p


def group_p_value(p_previous, p_best, earlier):
    """One group's p-value against both references: ``p_previous`` (the previous evaluation) and ``p_best`` (the
    best of ``earlier`` earlier evaluations), each given its part of the group's share; pass 1.0 for a reference
    that is not tested (none, or a drop under the minimum)."""
    import numpy as np

    earlier = np.maximum(np.asarray(earlier), 1)
    p = np.minimum(np.asarray(p_previous) / PREVIOUS_SHARE, np.asarray(p_best) * earlier / (1 - PREVIOUS_SHARE))
    p = np.minimum(p, 1.0)
    return float(p) if np.ndim(p) == 0 else p


def window_weight(width: int) -> float:
    """The base weight of each window test of ``width`` evaluations (``alert_windows.WINDOW_TESTS``)."""
    return WIDTH_WEIGHTS[alert_windows.WIDTHS.index(width)] / alert_windows.REFERENCES


def pooled_weights(earlier: int) -> tuple[tuple[float, ...], float]:
    """(each window test's weight, in the order of ``alert_windows.WINDOW_TESTS``, and the best's) at a comparison
    of a group with ``earlier`` earlier evaluations: the tests whose windows fit in its ``earlier`` + 1 evaluations
    share the whole of the group's share in proportion to their base weights (``window_weight``, ``BEST_WEIGHT``),
    so that early in a run, where the longer windows do not fit yet, the others are not starved; 0 for the rest."""
    base = [window_weight(w) if 2 * w + lag <= earlier + 1 else 0.0 for w, lag in alert_windows.WINDOW_TESTS]
    total = sum(base) + BEST_WEIGHT
    return tuple(weight / total for weight in base), BEST_WEIGHT / total


def pooled_group_p_value(window_p_values, p_best, earlier: int):
    """The pooled mode's group p-value: the smallest of each window test's p-value divided by its weight and of
    ``p_best`` times ``earlier`` divided by the best's weight (``pooled_weights(earlier)``; weighted Bonferroni:
    the weights sum to 1); window p-values in the order of ``alert_windows.WINDOW_TESTS``, 1.0 for a test not
    made."""
    import numpy as np

    weights, best_weight = pooled_weights(earlier)
    p = np.asarray(p_best) * max(earlier, 1) / best_weight
    for p_window, weight in zip(window_p_values, weights, strict=True):
        if weight:
            p = np.minimum(p, np.asarray(p_window) / weight)
    p = np.minimum(p, 1.0)
    return float(p) if np.ndim(p) == 0 else p


def holm_adjust(p_values):
    """Holm step-down adjusted p-values along the last axis (rows: runs of the benchmark); an alert needs its
    adjusted p-value at or below the evaluation's level."""
    import numpy as np

    p = np.asarray(p_values, dtype=float)
    if p.shape[-1] == 0:
        return p
    m = p.shape[-1]
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1) * (m - np.arange(m))
    ranked = np.minimum(np.maximum.accumulate(ranked, axis=-1), 1.0)
    adjusted = np.empty_like(ranked)
    np.put_along_axis(adjusted, order, ranked, axis=-1)
    return adjusted


def planned_share(j, comparisons, reserve=PLAN_RESERVE):
    """The share of the j-th comparison in a run planned for ``comparisons`` comparisons from the start, the plan
    never changed (what ``Spending`` gives then): ``(1 - reserve) / comparisons`` up to the plan, beyond it
    ``reserve * look_share(j - comparisons)``."""
    import numpy as np

    j = np.asarray(j)
    beyond = reserve * look_share(np.maximum(j - comparisons, 1))
    share = np.where(j <= comparisons, (1 - reserve) / max(comparisons, 1), beyond)
    return float(share) if np.ndim(share) == 0 else share


class Spending:
    """What a run has spent of its budget, comparison by comparison; ``share(plan)`` is the next comparison's.

    ``plan``: the planned number of comparisons of the whole run (None: not known). Without a plan, the j-th
    comparison spends ``look_share(k)``, k the comparisons so far outside a plan (k = j in a run that never has
    one: the unknown-length spending). With a plan, comparison j up to it spends an even part of what is left of
    ``1 - reserve``: ``(1 - reserve - spent) / (plan - j + 1)``, spent counting every share not taken from the
    reserve, so a plan that changes (a run resumed with another ``max_steps``) spreads what is left over the
    comparisons still planned; comparisons beyond the plan, or without one once a plan was seen, spend
    ``reserve * look_share(k)``. The shares of a run add up to at most 1 whatever the plans: with S the spending
    before the first plan, at most S + max(0, 1 - reserve - S) + reserve (1 - S) <= 1.
    """

    def __init__(self, reserve: float = PLAN_RESERVE):
        if not 0 < reserve < 1:
            raise ValueError(f"the reserve kept beyond a plan must be between 0 and 1, got {reserve!r}")
        self.reserve = reserve
        self.comparisons = 0  # j: comparisons so far
        self.unplanned = 0  # k: comparisons so far outside a plan
        self.spent = 0.0  # the shares not taken from the reserve
        self.total = 0.0  # every share
        self.planned = False  # a plan was seen (from then on, comparisons outside one spend the reserve)
        self.past_unknown = False  # forget_past: the reserve only

    def share(self, plan: int | None = None) -> float:
        """The next comparison's share of the run's budget, under ``plan`` (planned comparisons, or None)."""
        self.comparisons += 1
        if plan is not None and self.comparisons <= plan and not self.past_unknown:
            share = max(0.0, 1 - self.reserve - self.spent) / (plan - self.comparisons + 1)
            self.planned, self.spent = True, self.spent + share
        else:
            self.unplanned += 1
            share = look_share(self.unplanned)
            if self.planned:
                share *= self.reserve
            else:
                self.spent += share
        self.total += share
        return share

    def forget_past(self, comparisons: int) -> None:
        """Go on after ``comparisons`` comparisons whose spending is not known (a resumed run whose history file
        cannot be read): from then on only the reserve is spent, ``look_share`` from k = ``comparisons`` on."""
        self.comparisons = self.unplanned = comparisons
        self.planned = self.past_unknown = True
        self.total = math.nan


def run_q_values(group_p_values, share):
    """The run-wide q-value of each group at a comparison given ``share`` of the run's budget (``look_share``,
    ``planned_share`` or ``Spending.share``; one per row for rows of runs): its Holm-adjusted p-value divided by the
    share; an alert needs it at or below ``alert_q``."""
    import numpy as np

    share = share if np.ndim(share) == 0 else np.asarray(share)[..., None]
    return np.minimum(holm_adjust(group_p_values) / share, math.inf)
