"""Pooled windows for regression alerts: a group's last w evaluations against earlier windows of w.

A fall that is moderate at one evaluation is clear over a few: the ``"pooled"`` alert mode (the default) compares,
for w = 1, 2 and 3, the window of a group's last w evaluations (the current one included) with each of the
``REFERENCES`` windows of w evaluations before it: the w just before, the w before those, and so on (``lag``: the
evaluations between the two windows, 0, w, 2w, ...). Pairs are the unit. For each pair finite in both windows, d is
the number of the earlier window's evaluations it passes minus the number of the last w it passes (from -w to w);
the statistic is S = sum d, and the pooled drop S / (w n) over the n pairs.

The test is an exact sign-flip test: if the pair's outcomes over the 2w + lag evaluations from the earlier window
on are as likely in one order of time as in the reverse one (outcomes drawn again around fixed pass chances, or
kept and redrawn at random, as a stationary Markov chain is), each d is as likely as -d, since the reverse order
swaps the two windows, independently of the other pairs, so given the |d| the chance of a sum at least S is that of
sum of +-|d| with fair independent signs (``sign_flip_p_value``). Pass chances that rise only make S smaller. With
w = 1 it is the exact one-sided McNemar test against one earlier evaluation (``alert_budget.fall_p_value``).
Several earlier windows make several references for the same last w evaluations: a fall is compared with more of
the run before it, and each reference brings its own noise, so one that happens to be low does not hide the fall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .stats import OUTCOME_NOT_FINITE, OUTCOME_PASS

WIDTHS = (1, 2, 3)
REFERENCES = 4  # earlier windows each width is compared with
# (width, lag) of every window test, in the order of alert_budget.pooled_group_p_value's weights
WINDOW_TESTS = tuple((width, k * width) for width in WIDTHS for k in range(REFERENCES))
KEPT = max(2 * width + lag for width, lag in WINDOW_TESTS)  # the evaluations the longest test spans


@dataclass(frozen=True)
class WindowCounts:
    """A window comparison of one group: ``n`` pairs finite in all its evaluations, ``statistic`` S = sum d,
    ``magnitudes[m - 1]`` the pairs with |d| = m, and the pooled pass rates of the two windows on the n pairs;
    ``lag``: the evaluations between the windows."""

    window: int
    n: int
    statistic: int
    magnitudes: tuple[int, ...]
    before_score: float
    after_score: float
    lag: int = 0

    @property
    def drop(self) -> float:
        return self.statistic / (self.window * self.n) if self.n else 0.0


def window_counts(recent: Sequence[str], window: int, lag: int = 0) -> WindowCounts | None:
    """The comparison of the last ``window`` outcome strings of ``recent`` (oldest first, the current one last)
    with the ``window`` that end ``lag`` evaluations before them; None where ``recent`` has fewer than
    2 ``window`` + ``lag``."""
    import numpy as np  # here, not at the top: `tatblimp --help` loads no numpy

    if len(recent) < 2 * window + lag:
        return None
    compared = [*recent[-2 * window - lag :][:window], *recent[-window:]]
    codes = np.array([np.frombuffer(text.encode("ascii"), np.uint8) for text in compared])
    finite = (codes != ord(OUTCOME_NOT_FINITE)).all(0)
    passes = (codes[:, finite] == ord(OUTCOME_PASS)).astype(np.int64)
    before, after = passes[:window].sum(0), passes[window:].sum(0)
    d = before - after
    n = int(finite.sum())
    magnitudes = tuple(int(count) for count in np.bincount(np.abs(d), minlength=window + 1)[1 : window + 1])
    scale = window * n if n else 1
    before_score, after_score = int(before.sum()) / scale, int(after.sum()) / scale
    return WindowCounts(window, n, int(d.sum()), magnitudes, before_score, after_score, lag)


@lru_cache(maxsize=65536)
def sign_flip_p_value(magnitudes: tuple[int, ...], statistic: int) -> float:
    """Exact P(sum of +-m over ``magnitudes[m - 1]`` pairs of each m, fair independent signs, >= ``statistic``);
    1 where no pair differs. Only magnitude 1: the exact one-sided McNemar p-value."""
    import numpy as np
    from scipy.special import gammaln
    from scipy.stats import binom

    if not any(magnitudes):
        return 1.0
    if not any(magnitudes[1:]):
        b = (magnitudes[0] + statistic) // 2  # pairs lost: S = b - c, b + c = n1
        return float(binom.sf(b - 1, magnitudes[0], 0.5))
    dist, low = np.ones(1), 0  # the distribution of the sum over the integers from ``low`` on
    for m, count in enumerate(magnitudes, 1):
        if not count:
            continue
        part = np.zeros(2 * m * count + 1)
        k = np.arange(count + 1)  # the plus signs: a sum of m (2k - count), with Binomial(count, 1/2) chances
        part[:: 2 * m] = np.exp(gammaln(count + 1) - gammaln(k + 1) - gammaln(count - k + 1) - count * np.log(2))
        dist, low = np.convolve(dist, part), low - m * count
    first = statistic - low
    return float(min(1.0, dist[max(first, 0) :].sum())) if first < len(dist) else 0.0
