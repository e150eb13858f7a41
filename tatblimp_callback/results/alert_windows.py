"""Pooled windows for regression alerts: a group's last w evaluations against the w evaluations before them.

A fall that is moderate at one evaluation is clear over a few: the ``"pooled"`` alert mode (the default) compares,
for w = 1, 2 and 3, the window of a group's last w evaluations (the current one included) with the window of the
w evaluations before it, with the pairs as the unit. For each pair finite in all 2w evaluations, d is the number of
those before it passes minus the number of the last w it passes (from -w to w); the statistic is S = sum d, and
the pooled drop S / (w n) over the n pairs.

The test is an exact sign-flip test: if the pair's outcomes over the 2w evaluations are as likely in one order of
time as in the reverse one (outcomes drawn again around fixed pass chances, or kept and redrawn at random, as a
stationary Markov chain is), each d is as likely as -d, independently of the other pairs, so given the |d| the
chance of a sum at least S is that of sum of +-|d| with fair independent signs (``sign_flip_p_value``). Pass
chances that rise only make S smaller. With w = 1 it is the exact one-sided McNemar test against the previous
evaluation (``alert_budget.fall_p_value``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .stats import OUTCOME_NOT_FINITE, OUTCOME_PASS

WINDOWS = (1, 2, 3)
MAX_MAGNITUDE = max(WINDOWS)


@dataclass(frozen=True)
class WindowCounts:
    """A window comparison of one group: ``n`` pairs finite in all its evaluations, ``statistic`` S = sum d,
    ``magnitudes[m - 1]`` the pairs with |d| = m, and the pooled pass rates of the two windows on the n pairs."""

    window: int
    n: int
    statistic: int
    magnitudes: tuple[int, ...]
    before_score: float
    after_score: float

    @property
    def drop(self) -> float:
        return self.statistic / (self.window * self.n) if self.n else 0.0


def window_counts(recent: Sequence[str], window: int) -> WindowCounts | None:
    """The comparison of the last ``window`` outcome strings of ``recent`` (oldest first, the current one last)
    with the ``window`` before them; None where ``recent`` has fewer than 2 ``window``."""
    import numpy as np  # here, not at the top: `tatblimp --help` loads no numpy

    if len(recent) < 2 * window:
        return None
    codes = np.array([np.frombuffer(text.encode("ascii"), np.uint8) for text in recent[-2 * window :]])
    finite = (codes != ord(OUTCOME_NOT_FINITE)).all(0)
    passes = (codes[:, finite] == ord(OUTCOME_PASS)).astype(np.int64)
    before, after = passes[:window].sum(0), passes[window:].sum(0)
    d = before - after
    n = int(finite.sum())
    magnitudes = tuple(int(count) for count in np.bincount(np.abs(d), minlength=window + 1)[1 : window + 1])
    scale = window * n if n else 1
    return WindowCounts(window, n, int(d.sum()), magnitudes, int(before.sum()) / scale, int(after.sum()) / scale)


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
