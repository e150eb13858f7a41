"""How a run learns: a fitted acquisition step with its interval, the order of acquisition, and the latest trend.

- ``fit_acquisition``: each phenomenon's acc_norm over the evaluations is fitted (``scipy.optimize.curve_fit``,
  least squares) by a logistic curve in ``x = log(1 + step)`` that rises from chance to a fitted plateau,
  ``0.5 + (plateau - 0.5) / (1 + exp(-slope * (x - x_mid)))``; the acquisition step is the midpoint,
  ``exp(x_mid) - 1``, the step at which the phenomenon is halfway from chance to its plateau. Its 95% interval
  is a percentile bootstrap over pairs: the phenomenon's pairs are drawn with replacement (the same draw at every
  evaluation, so the pairing over time is kept), the curve is fitted again, ``bootstrap`` times (200) from a
  generator seeded by ``seed`` (0) and the phenomenon's name, so the same history gives the same interval. The
  interval is never narrower than the two evaluations around the midpoint (the curve is only seen there) and is
  clipped to the evaluated steps (``open_ended`` where it reached past the last one).
  Where the fit does not hold the status says why: "not enough evaluations" (fewer than 4 steps),
  "no fit" (the fit does not converge), "not acquired" (a plateau less than 0.1 above chance, or a midpoint
  after the last evaluation: still rising), "before the first evaluation" (the midpoint precedes it).
- ``learning_order``: Kendall's tau (``scipy.stats.kendalltau``, tau-b, with its two-sided p-value) between two
  runs' fitted acquisition steps over the phenomena both acquired: do they learn in the same order?
- ``trends``: the latest evaluation against the one ``lookback`` evaluations earlier (3; the first when there are
  fewer), pair by pair (exact McNemar, Benjamini-Hochberg over the phenomena): "rising" or "falling" where the
  difference is significant at 0.05, else "flat". Is the run still learning?
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .positions import readable
from .stats import ALPHA, OUTCOME_NOT_FINITE, OUTCOME_PASS, Outcomes, bh_adjust, paired_counts

CHANCE = 0.5
MIN_EVALUATIONS = 4  # the curve has three parameters
MIN_RISE = 0.1  # a plateau at least this far above chance counts as learned
BOOTSTRAP = 200
LOOKBACK = 3

ACQUIRED = "acquired"
NOT_ACQUIRED = "not acquired"
NOT_ENOUGH = "not enough evaluations"
NO_FIT = "no fit"
BEFORE_FIRST = "before the first evaluation"


@dataclass(frozen=True)
class AcquisitionFit:
    """One phenomenon's fitted curve: ``status``, and where it was acquired, the midpoint step and its interval."""

    status: str
    step: float | None = None  # the fitted midpoint, in steps (acquired only)
    interval: tuple[float, float] | None = None  # its 95% bootstrap interval (acquired only)
    plateau: float | None = None
    slope: float | None = None  # per unit of log(1 + step)
    bootstrap_fits: int = 0  # of the bootstrap draws, those whose fit converged
    open_ended: bool = False  # the interval's upper end reached past the last evaluation (clipped to it)

    @property
    def acquired(self) -> bool:
        return self.status == ACQUIRED

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "interval": list(self.interval) if self.interval is not None else None}

    def describe(self, axis: str = "step") -> str:
        """``"420 [310, 560]"`` when acquired (``560+``: the interval reaches past the last evaluation), else the status;
        on a revision series' ``axis`` of tokens or words, ``"3.7B [2B, 4B]"``."""
        if not self.acquired:
            return self.status
        low, high = (readable(value, axis) for value in self.interval)
        return f"{readable(self.step, axis)} [{low}, {high}{'+' if self.open_ended else ''}]"


def _curve(x, plateau, x_mid, slope):
    """The fitted curve: from chance at the far left to ``plateau``, halfway at ``x_mid``."""
    from scipy.special import expit

    return CHANCE + (plateau - CHANCE) * expit(slope * (x - x_mid))


def _fit(x: np.ndarray, y: np.ndarray, start: tuple[float, float, float] | None = None) -> tuple[float, float, float] | None:
    """(plateau, x_mid, slope) by least squares (``curve_fit``, Levenberg-Marquardt), from ``start`` or a guess from
    the data; None where the fit does not converge.

    The fit runs in unbounded parameters, so that Levenberg-Marquardt needs no bounds: plateau = 0.5 + 0.5 * expit(a)
    (between chance and 1), slope = top * expit(b) (positive, at most ``top`` = 100 / the span of log steps: a jump
    between two evaluations, which has no finite best slope, converges to the steepest).
    """
    from scipy.optimize import OptimizeWarning, curve_fit
    from scipy.special import expit, logit

    span = max(float(x[-1] - x[0]), 1e-6)
    top = 100.0 / span

    def natural(a, x_mid, b):
        return CHANCE + (1 - CHANCE) * expit(a), x_mid, top * expit(b)

    def model(x, a, x_mid, b):
        return _curve(x, *natural(a, x_mid, b))

    def jacobian(x, a, x_mid, b):
        plateau, _, slope = natural(a, x_mid, b)
        g = expit(slope * (x - x_mid))
        dg, e, f = g * (1.0 - g), expit(a), expit(b)
        rise = plateau - CHANCE
        return np.stack([(1 - CHANCE) * e * (1 - e) * g, -rise * slope * dg, rise * (x - x_mid) * dg * top * f * (1 - f)], axis=1)

    if start is None:
        highest = float(np.max(y))
        above = np.nonzero(y >= CHANCE + (highest - CHANCE) / 2)[0]
        start = (highest, float(x[above[0]]) if len(above) else float(x[-1]), 4.0 / span)
    plateau, x_mid, slope = start
    p0 = (
        float(logit(min(max((plateau - CHANCE) / (1 - CHANCE), 0.02), 0.98))),
        x_mid,
        float(logit(min(max(slope / top, 1e-4), 1 - 1e-4))),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)  # the covariance (unused here) may not be estimable
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            params, _ = curve_fit(model, x, y, p0=p0, jac=jacobian, method="lm", maxfev=600)
        except (RuntimeError, ValueError):
            return None
    if not np.all(np.isfinite(params)):
        return None
    return tuple(float(v) for v in natural(*params))


def _best_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float] | None:
    """``_fit`` from the data's own guess and from a midpoint between each two evaluations (gentle and steep):
    the fit with the least squared error (a single start can miss a jump between two evaluations)."""
    span = max(float(x[-1] - x[0]), 1e-6)
    top = float(np.clip(np.max(y), CHANCE + 0.01, 0.99))
    starts = [None] + [(top, float(m), slope / span) for m in (x[1:] + x[:-1]) / 2 for slope in (4.0, 40.0)]
    fits = [fit for fit in (_fit(x, y, start) for start in starts) if fit is not None]
    if not fits:
        return None
    return min(fits, key=lambda fit: float(np.sum((_curve(x, *fit) - y) ** 2)))


def _shares(passed: np.ndarray, finite: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    if columns is not None:
        passed, finite = passed[:, columns], finite[:, columns]
    counts = finite.sum(axis=1)
    return np.where(counts > 0, passed.sum(axis=1) / np.maximum(counts, 1), np.nan)


def fit_acquisition(
    steps: Sequence[int], outcomes: Sequence[str], bootstrap: int = BOOTSTRAP, seed: int | str = 0
) -> AcquisitionFit:
    """The fitted acquisition of one phenomenon from its acc_norm outcome strings at each of ``steps``.

    ``outcomes[i]`` is the phenomenon's per-pair outcome string at ``steps[i]`` (the same pairs each time); see the
    module's docstring for the curve, the bootstrap and the statuses.
    """
    order = np.argsort(np.asarray(steps), kind="stable")
    steps = [int(steps[i]) for i in order]
    outcomes = [outcomes[i] for i in order]
    if len(set(steps)) < MIN_EVALUATIONS:
        return AcquisitionFit(NOT_ENOUGH)
    if len({len(text) for text in outcomes}) != 1:
        raise ValueError("the outcome strings of one phenomenon must cover the same pairs at every step")
    rows = np.array([list(text) for text in outcomes])
    passed, finite = rows == OUTCOME_PASS, rows != OUTCOME_NOT_FINITE
    x = np.log1p(np.asarray(steps, dtype=float))
    y = _shares(passed, finite)
    keep = ~np.isnan(y)
    if keep.sum() < MIN_EVALUATIONS:
        return AcquisitionFit(NOT_ENOUGH)
    fitted = _best_fit(x[keep], y[keep])
    if fitted is None:
        return AcquisitionFit(NO_FIT)
    plateau, x_mid, slope = fitted
    if plateau - CHANCE < MIN_RISE or x_mid > x[keep][-1]:
        return AcquisitionFit(NOT_ACQUIRED, plateau=plateau, slope=slope)
    if x_mid < x[keep][0]:
        return AcquisitionFit(BEFORE_FIRST, plateau=plateau, slope=slope)
    rng = np.random.default_rng([zlib.crc32(str(seed).encode()), bootstrap])
    mids = []
    for _ in range(bootstrap):
        y_draw = _shares(passed, finite, rng.integers(0, rows.shape[1], rows.shape[1]))
        ok = ~np.isnan(y_draw)
        if ok.sum() >= MIN_EVALUATIONS:
            refit = _fit(x[ok], y_draw[ok], fitted)
            if refit is not None:
                mids.append(refit[1])
    if not mids:
        return AcquisitionFit(NO_FIT, plateau=plateau, slope=slope)
    step = float(np.expm1(x_mid))
    ends = np.clip(np.percentile(mids, [2.5, 97.5]), -1.0, x[-1] + 1.0)  # clipped below anyway
    low, high = (float(v) for v in np.expm1(ends))
    # The step is only known between the evaluations around it (a jump between two fits any midpoint there), and
    # nothing is known outside the evaluated steps: the interval spans the first and is clipped to the second.
    seen = [s for s, k in zip(steps, keep) if k]
    low = max(min(low, max(s for s in seen if s <= step)), seen[0])
    open_ended = max(high, min(s for s in seen if s >= step)) > seen[-1]
    high = min(max(high, min(s for s in seen if s >= step)), seen[-1])
    return AcquisitionFit(ACQUIRED, step, (low, high), plateau, slope, len(mids), open_ended)


def evaluations_from_records(records: Sequence[Mapping[str, Any]], where: str = "") -> list[tuple[int, Outcomes]]:
    """(step, Outcomes) of each record (a sweep's or history file's), in step order; a step written twice: the last."""
    by_step = {}
    for record in sorted(records, key=lambda r: r["step"]):
        try:
            by_step[record["step"]] = Outcomes.from_record(record)
        except ValueError as err:
            raise ValueError(f"{where or 'a record'} at step {record['step']}: {err}") from None
    return list(by_step.items())


def acquisition_fits(
    evaluations: Sequence[tuple[int, Outcomes]], bootstrap: int = BOOTSTRAP, seed: int = 0, metric: str = "acc_norm"
) -> dict[str, AcquisitionFit]:
    """``fit_acquisition`` of every phenomenon (the last evaluation's order, over the evaluations of its pairs), from (step, Outcomes) pairs."""
    if not evaluations:
        return {}
    last = evaluations[-1][1]
    same = [(step, outcomes) for step, outcomes in evaluations if outcomes.phenomena == last.phenomena]  # these pairs
    steps = [step for step, _ in same]
    texts = [getattr(outcomes, metric) for _, outcomes in same]
    groups = last.groups()
    return {
        name: fit_acquisition(steps, ["".join(text[i] for i in indices) for text in texts], bootstrap, f"{seed}:{name}")
        for name, indices in groups.items()
    }


@dataclass(frozen=True)
class LearningOrder:
    """Kendall's tau between two runs' acquisition steps over the ``phenomena`` both acquired (nan below two)."""

    tau: float
    p_value: float
    phenomena: tuple[str, ...]
    order_a: tuple[str, ...]  # the phenomena run A acquired, earliest first
    order_b: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def acquisition_order(fits: Mapping[str, AcquisitionFit]) -> tuple[str, ...]:
    """The acquired phenomena, earliest fitted step first."""
    return tuple(sorted((name for name, fit in fits.items() if fit.acquired), key=lambda name: fits[name].step))


def learning_order(fits_a: Mapping[str, AcquisitionFit], fits_b: Mapping[str, AcquisitionFit]) -> LearningOrder:
    """Do two runs acquire their phenomena in the same order? Kendall's tau-b of the fitted steps (scipy)."""
    from scipy.stats import kendalltau

    both = tuple(name for name in fits_a if fits_a[name].acquired and name in fits_b and fits_b[name].acquired)
    tau = p_value = math.nan
    if len(both) >= 2:
        result = kendalltau([fits_a[n].step for n in both], [fits_b[n].step for n in both])
        tau, p_value = float(result.statistic), float(result.pvalue)
    return LearningOrder(tau, p_value, both, acquisition_order(fits_a), acquisition_order(fits_b))


@dataclass(frozen=True)
class Trend:
    """One phenomenon's latest direction: ``to_step`` against ``from_step``, pair by pair."""

    direction: str  # "rising", "falling", "flat"
    from_step: int
    to_step: int
    difference: float  # acc_norm at to_step minus at from_step, on the pairs finite in both
    p_value: float
    q_value: float  # Benjamini-Hochberg over the phenomena

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trends(evaluations: Sequence[tuple[int, Outcomes]], lookback: int = LOOKBACK, metric: str = "acc_norm") -> dict[str, Trend]:
    """Each phenomenon's trend over the latest evaluations (see the module's docstring); {} below two evaluations."""
    if len(evaluations) < 2:
        return {}
    (from_step, before), (to_step, after) = evaluations[max(0, len(evaluations) - 1 - lookback)], evaluations[-1]
    if before.phenomena != after.phenomena:
        return {}
    a, b = getattr(before, metric), getattr(after, metric)
    counts = {name: paired_counts(a, b, indices) for name, indices in after.groups().items()}
    q_values = bh_adjust([c.p_value for c in counts.values()])
    found = {}
    for (name, c), q_value in zip(counts.items(), q_values):
        difference = (c.run_only - c.baseline_only) / c.n if c.n else math.nan
        direction = "flat" if not q_value < ALPHA else "rising" if difference > 0 else "falling"
        found[name] = Trend(direction, from_step, to_step, difference, c.p_value, q_value)
    return found


@dataclass
class LearningSummary:
    """A run's fitted acquisitions and latest trends, by phenomenon."""

    fits: dict[str, AcquisitionFit] = field(default_factory=dict)
    trends: dict[str, Trend] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "acquisition_fits": {name: fit.to_dict() for name, fit in self.fits.items()},
            "trends": {name: trend.to_dict() for name, trend in self.trends.items()},
        }


def learning_summary(
    evaluations: Sequence[tuple[int, Outcomes]], bootstrap: int = BOOTSTRAP, lookback: int = LOOKBACK
) -> LearningSummary:
    """``acquisition_fits`` and ``trends`` of one run's evaluations."""
    return LearningSummary(acquisition_fits(evaluations, bootstrap), trends(evaluations, lookback))
