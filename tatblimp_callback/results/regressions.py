"""Regressions during training: a phenomenon that scores significantly worse than at its best earlier evaluation.

After each evaluation, every group (the overall score and each phenomenon, of TatBLiMP and of each suite) is
compared with the earlier evaluation where it scored best, pair by pair: the exact McNemar test on the pairs
only one of the two passes (acc_norm outcomes, see ``stats.py``), Benjamini-Hochberg adjusted over every group
compared at that evaluation. A group raises an alert when its q-value is below ``alpha`` (0.05) and it fell by
at least ``min_drop`` (5 points) on the pairs finite in both. It does not alert again until it recovers, that
is until it is back within half of ``min_drop`` of that best score (so that a score hovering at the edge does
not alert at every other evaluation); after that a new fall alerts again.

``RegressionMonitor`` does this one evaluation at a time (the callback); ``replay_alerts`` runs it over the
records of a sweep or a history file (the report). The false-alarm rate of these defaults on runs that only
fluctuate is measured by ``benchmarks/bench_alert_false_alarms.py`` (see the long-runs guide).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .stats import Outcomes, bh_adjust, outcome_share, paired_counts

DEFAULT_ALERT_Q = 0.05
DEFAULT_MIN_DROP = 0.05


@dataclass(frozen=True)
class RegressionAlert:
    """One group's significant fall: ``score`` at ``step`` against ``best_score`` at ``best_step`` (acc_norm)."""

    benchmark: str  # "tatblimp" (the log prefix) or a suite's name
    group: str  # "overall" or a phenomenon
    step: int
    best_step: int
    score: float
    best_score: float
    n: int  # pairs finite at both steps
    p_value: float  # exact two-sided McNemar
    q_value: float  # Benjamini-Hochberg over every group compared at this step

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.group}"

    @property
    def title(self) -> str:
        """A short title (wandb allows under 64 characters)."""
        return f"{self.benchmark}: {self.group} fell"[:63]

    @property
    def text(self) -> str:
        return (
            f"{self.benchmark} {self.group} acc_norm fell from {self.best_score:.4f} at step {self.best_step} to "
            f"{self.score:.4f} at step {self.step} (q = {self.q_value:.2g}, exact McNemar on {self.n} pairs, "
            "Benjamini-Hochberg adjusted)"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RegressionAlert:
        """From ``to_dict`` (a history file's ``alerts``); ValueError naming what is missing."""
        try:
            return cls(**{name: record[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed alert record ({type(err).__name__}: {err})") from None


@dataclass
class _Best:
    score: float
    step: int
    outcomes: str  # the group's acc_norm outcomes at that step


class RegressionMonitor:
    """Compares each evaluation with the best earlier one, group by group, and says which groups fell.

    Args:
        alpha: an alert needs a BH-adjusted p-value (q) below this.
        min_drop: and a fall of at least this much acc_norm (0.05: 5 points) on the pairs finite in both.
        metric: the outcomes compared ("acc_norm" or "acc").
    """

    def __init__(self, alpha: float = DEFAULT_ALERT_Q, min_drop: float = DEFAULT_MIN_DROP, metric: str = "acc_norm"):
        if not 0 < alpha < 1:
            raise ValueError(f"the alert q threshold must be between 0 and 1, got {alpha!r}")
        if not 0 <= min_drop < 1:
            raise ValueError(f"the minimum drop of an alert must be at least 0 and below 1, got {min_drop!r}")
        self.alpha, self.min_drop, self.metric = alpha, min_drop, metric
        self._best: dict[str, _Best] = {}
        self._fallen: set[str] = set()  # groups alerted and not recovered yet
        self._seen: dict[str, int] = {}  # earlier evaluations of each group
        self._pairs: dict[str, tuple[str, ...]] = {}  # the phenomenon of each pair, by benchmark

    def observe(self, step: int, outcomes: Mapping[str, Outcomes]) -> list[RegressionAlert]:
        """The alerts of the evaluation at ``step``; ``outcomes``: benchmark name -> its per-pair outcomes (a suite
        not scored at this evaluation is simply absent). Then each group's best score is updated."""
        compared = []  # (benchmark, group, best, counts, score)
        current: dict[str, tuple[float, str]] = {}
        for benchmark, result in outcomes.items():
            if self._pairs.get(benchmark) != result.phenomena:  # new, or other pairs: start afresh
                self._pairs[benchmark] = result.phenomena
                for key in [key for key in self._seen if key.startswith(f"{benchmark}/")]:
                    self._best.pop(key, None), self._seen.pop(key), self._fallen.discard(key)
            text = getattr(result, self.metric)
            for group, indices in {"overall": None, **result.groups()}.items():
                key = f"{benchmark}/{group}"
                part = text if indices is None else "".join(text[i] for i in indices)
                passed, finite = outcome_share(part)
                score = passed / finite if finite else math.nan
                current[key] = (score, part)
                best = self._best.get(key)
                if best is None:
                    continue
                compared.append((benchmark, group, best, paired_counts(best.outcomes, part), score))
        # The best of k earlier evaluations is the one that differs most: its p-value times k (Bonferroni) is a
        # valid p-value of "below some earlier evaluation"; then BH over the groups.
        selected = [min(1.0, counts.p_value * self._seen[f"{b}/{g}"]) for b, g, _, counts, _ in compared]
        q_values = bh_adjust(selected)
        alerts = []
        for (benchmark, group, best, counts, score), q_value in zip(compared, q_values):
            key = f"{benchmark}/{group}"
            drop = (counts.baseline_only - counts.run_only) / counts.n if counts.n else 0.0
            if key in self._fallen:
                if drop < self.min_drop / 2:
                    self._fallen.discard(key)
                continue
            if q_value < self.alpha and drop >= self.min_drop:
                self._fallen.add(key)
                alerts.append(
                    RegressionAlert(benchmark, group, step, best.step, score, best.score, counts.n, counts.p_value, q_value)
                )
        for key, (score, part) in current.items():
            self._seen[key] = self._seen.get(key, 0) + 1
            best = self._best.get(key)
            if not math.isnan(score) and (best is None or score > best.score):
                self._best[key] = _Best(score, step, part)
        return alerts


def record_outcomes(record: Mapping[str, Any], prefix: str = "tatblimp") -> dict[str, Outcomes]:
    """The per-pair outcomes of one results record and of each of its suites (name -> Outcomes)."""
    found = {prefix: Outcomes.from_record(record)}
    for name, suite in record.get("suites", {}).items():
        if "outcomes" in suite or suite.get("pairs"):
            found[name] = Outcomes.from_record(suite)
    return found


def replay_alerts(
    records: Sequence[Mapping[str, Any]], alpha: float = DEFAULT_ALERT_Q, min_drop: float = DEFAULT_MIN_DROP
) -> list[RegressionAlert]:
    """The alerts a monitor raises over ``records`` (a sweep's or a history file's, in step order)."""
    monitor = RegressionMonitor(alpha, min_drop)
    alerts = []
    for record in sorted(records, key=lambda r: r["step"]):
        alerts += monitor.observe(record["step"], record_outcomes(record))
    return alerts


def recorded_alerts(records: Sequence[Mapping[str, Any]]) -> list[RegressionAlert] | None:
    """The alerts a history file holds (the callback writes ``alerts`` in every record while it watches);
    None when no record has them (a sweep, or a run with ``alert_on_regression=False``)."""
    if not any("alerts" in record for record in records):
        return None
    return [RegressionAlert.from_dict(alert) for record in records for alert in record.get("alerts", [])]
