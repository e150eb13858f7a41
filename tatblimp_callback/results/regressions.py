"""Regressions during training: a phenomenon that scores significantly worse than at earlier evaluations.

After each evaluation, every group (the overall score and each phenomenon, of TatBLiMP and of each suite) is
compared pair by pair with earlier evaluations (acc_norm outcomes, see ``stats.py``). Three modes:

- ``"pooled"`` (the default): the chance that a run which never regresses raises any alert is at most ``alpha``,
  over the whole run, whatever the number of evaluations and groups (``alert_budget.py``). Each group's last 1, 2
  and 3 evaluations are compared with each of the 4 windows of as many evaluations before them (exact sign-flip
  tests over the pairs, ``alert_windows.py``; one evaluation: McNemar against one of the 4 before), and its current
  evaluation with the best earlier one (exact one-sided McNemar, corrected for the choice of the best), each test
  with its weight of the group's share; each evaluation spends its own share of ``alpha``, split over the groups
  by Holm's method. With a plan (the run's planned number of evaluations, given to ``observe`` and written in
  every history-file record as ``alert_plan``), the budget is spread evenly over the planned evaluations, a
  reserve kept for any beyond the plan (``alert_budget.Spending``).
- ``"per_run"`` (the default before pooling): the same budget, with the previous and the best evaluations only.
- ``"per_evaluation"`` (the earliest behaviour): the best earlier evaluation only (exact two-sided McNemar, times
  the number of earlier evaluations), Benjamini-Hochberg adjusted over the groups of the evaluation, q below
  ``alpha`` at each evaluation: the chances of a false alarm add up over a run.

Every test needs a fall of at least ``min_drop`` (5 points) on its pairs (those finite in all the evaluations it
compares: a window's drop is pooled over its evaluations). A group does not alert again until it recovers, that
is until it is back within half of ``min_drop`` of its best score on every pair finite there (an evaluation where
some of those pairs are not finite neither recovers nor clears anything). A score measured on fewer than half as
many finite pairs as the best does not become the best, and a best measured on fewer than half as many as a
later evaluation gives way to it.

``RegressionMonitor`` does this one evaluation at a time (the callback); ``replay_alerts`` runs it over the
records of a sweep or a history file (the report). ``benchmarks/bench_alert_false_alarms.py`` measures the
modes (see the long-runs guide).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from . import alert_budget, alert_windows
from .stats import Outcomes, PairedCounts, bh_adjust, outcome_share, paired_counts

DEFAULT_ALERT_Q = 0.05
DEFAULT_MIN_DROP = 0.05
ALERT_MODES = ("pooled", "per_run", "per_evaluation")
DEFAULT_ALERT_MODE = "pooled"
_KEPT = alert_windows.KEPT - 1  # earlier evaluations a group's windows need


@dataclass(frozen=True)
class RegressionAlert:
    """One group's significant fall: ``score`` at ``step`` against ``best_score`` at ``best_step`` (acc_norm), the
    reference (``reference``: "best", the best earlier evaluation; "previous", the one before; "earlier", one of the
    3 before that; "last 2" or "last 3": the pooled score of the last 2 or 3 evaluations, ``score``, against that of
    as many earlier evaluations, from ``best_step`` on, ``best_score``, on the ``n`` pairs finite in all of them)."""

    benchmark: str  # "tatblimp" (the log prefix) or a suite's name
    group: str  # "overall" or a phenomenon
    step: int
    best_step: int
    score: float
    best_score: float
    n: int  # pairs finite at both steps
    p_value: float  # exact one-sided McNemar or sign-flip (pooled, per_run), two-sided McNemar (per_evaluation)
    q_value: float  # pooled, per_run: run-wide (see alert_budget.run_q_values); per_evaluation: Benjamini-Hochberg
    mode: str = "per_evaluation"  # records written before the per-run mode have neither field
    reference: str = "best"

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.group}"

    @property
    def title(self) -> str:
        """A short title (wandb allows under 64 characters)."""
        return f"{self.benchmark}: {self.group} fell"[:63]

    @property
    def text(self) -> str:
        if self.reference.startswith("last "):
            w = self.reference.split()[1]
            return (
                f"{self.benchmark} {self.group} acc_norm fell from {self.best_score:.4f} over the {w} evaluations from "
                f"step {self.best_step} to {self.score:.4f} over the {w} up to step {self.step} (q = {self.q_value:.2g}, "
                f"exact sign-flip test on {self.n} pairs, within the run's false-alarm budget)"
            )
        if self.mode in ("pooled", "per_run"):
            how = f"exact one-sided McNemar on {self.n} pairs, within the run's false-alarm budget"
        else:
            how = f"exact McNemar on {self.n} pairs, Benjamini-Hochberg adjusted"
        which = {"previous": " (the previous evaluation)", "earlier": " (an earlier evaluation)"}.get(self.reference, "")
        return (
            f"{self.benchmark} {self.group} acc_norm fell from {self.best_score:.4f} at step {self.best_step}{which} to "
            f"{self.score:.4f} at step {self.step} (q = {self.q_value:.2g}, {how})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RegressionAlert:
        """From ``to_dict`` (a history file's ``alerts``); ValueError naming what is missing."""
        names = [f.name for f in fields(cls)]
        try:
            return cls(**{name: record[name] for name in names if name in record or name not in ("mode", "reference")})
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed alert record ({type(err).__name__}: {err})") from None


@dataclass
class _Evaluation:
    score: float
    step: int
    outcomes: str  # the group's acc_norm outcomes at that step
    finite: int  # pairs finite there


@dataclass
class _Comparison:
    benchmark: str
    group: str
    current: _Evaluation
    best: _Evaluation
    against_best: PairedCounts
    previous: _Evaluation | None
    against_previous: PairedCounts | None
    earlier: int  # earlier evaluations with a score, among which the best was chosen
    recent: list[_Evaluation]  # the group's last evaluations with a score, oldest first, the current one last

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.group}"


def _drop(counts: PairedCounts) -> float:
    return (counts.baseline_only - counts.run_only) / counts.n


class RegressionMonitor:
    """Compares each evaluation with earlier ones, group by group, and says which groups fell.

    Args:
        alpha: per_run: the chance over the whole run of any alert where nothing regresses; per_evaluation: the
            q-value (Benjamini-Hochberg) an alert needs at each evaluation.
        min_drop: an alert also needs a fall of at least this much acc_norm (0.05: 5 points) on the pairs finite in
            both evaluations.
        metric: the outcomes compared ("acc_norm" or "acc").
        mode: "pooled" (default), "per_run" or "per_evaluation" (see the module's docstring).

    ``spending`` (pooled, per_run) holds what the run has spent of ``alpha``, evaluation by evaluation, under the
    plans ``observe`` was given.
    """

    def __init__(
        self,
        alpha: float = DEFAULT_ALERT_Q,
        min_drop: float = DEFAULT_MIN_DROP,
        metric: str = "acc_norm",
        mode: str = DEFAULT_ALERT_MODE,
    ):
        if not 0 < alpha < 1:
            raise ValueError(f"the alert q threshold must be between 0 and 1, got {alpha!r}")
        if not 0 <= min_drop < 1:
            raise ValueError(f"the minimum drop of an alert must be at least 0 and below 1, got {min_drop!r}")
        if mode not in ALERT_MODES:
            raise ValueError(f"the alert mode must be one of {', '.join(map(repr, ALERT_MODES))}, got {mode!r}")
        self.alpha, self.min_drop, self.metric, self.mode = alpha, min_drop, metric, mode
        self.evaluations = 0  # evaluations observed in the run: the per-run budget's count goes on across benchmarks
        self.spending = alert_budget.Spending()
        self._best: dict[str, _Evaluation] = {}
        self._recent: dict[str, list[_Evaluation]] = {}  # the last evaluations with a score (the last: previous)
        self._fallen: set[str] = set()  # groups alerted and not recovered yet
        self._seen: dict[str, int] = {}  # earlier evaluations of each group with a score
        self._pairs: dict[str, tuple[str, ...]] = {}  # the phenomenon of each pair, by benchmark

    def observe(self, step: int, outcomes: Mapping[str, Outcomes], plan: int | None = None) -> list[RegressionAlert]:
        """The alerts of the evaluation at ``step``; ``outcomes``: benchmark name -> its per-pair outcomes (a suite
        not scored at this evaluation is simply absent; ``{}`` for an evaluation that cannot be read, which still
        counts); ``plan``: the run's planned number of evaluations, the first included (None: not known). Then each
        group's best and previous evaluations are updated."""
        self.evaluations += 1
        # Every evaluation after the first spends its share, compared or not, so that a replay spends alike.
        share = self.spending.share(plan - 1 if plan is not None else None) if self.evaluations > 1 else math.nan
        compared: list[_Comparison] = []
        current: dict[str, _Evaluation] = {}
        for benchmark, result in outcomes.items():
            if self._pairs.get(benchmark) != result.phenomena:  # new, or other pairs: start afresh
                self._pairs[benchmark] = result.phenomena
                for key in [key for key in self._seen if key.startswith(f"{benchmark}/")]:
                    self._best.pop(key, None), self._recent.pop(key, None), self._seen.pop(key)
                    self._fallen.discard(key)
            text = getattr(result, self.metric)
            for group, indices in {"overall": None, **result.groups()}.items():
                key = f"{benchmark}/{group}"
                part = text if indices is None else "".join(text[i] for i in indices)
                passed, finite = outcome_share(part)
                now = current[key] = _Evaluation(passed / finite if finite else math.nan, step, part, finite)
                best, recent = self._best.get(key), self._recent.get(key, [])
                previous = recent[-1] if recent else None
                if best is None or not finite:
                    continue
                against_best = paired_counts(best.outcomes, part)
                against_previous = paired_counts(previous.outcomes, part) if previous is not None else None
                if against_best.n:  # no pair finite in both: nothing to compare (neither a fall nor a recovery)
                    compared.append(
                        _Comparison(
                            benchmark,
                            group,
                            now,
                            best,
                            against_best,
                            previous,
                            against_previous,
                            self._seen[key],
                            [*recent, now],
                        )
                    )
        if self.mode == "pooled":
            alerts = self._pooled(compared, share)
        else:
            alerts = self._per_run(compared, share) if self.mode == "per_run" else self._per_evaluation(compared)
        for key, now in current.items():
            if math.isnan(now.score):
                continue
            self._seen[key] = self._seen.get(key, 0) + 1
            self._recent[key] = [*self._recent.get(key, [])[-_KEPT + 1 :], now]
            best = self._best.get(key)
            # A score on fewer than half the best's finite pairs does not become the best (a few pairs can score
            # high by chance and hide later falls); a best on fewer than half of a later evaluation's gives way.
            if best is None or (now.score > best.score and 2 * now.finite >= best.finite) or 2 * best.finite < now.finite:
                self._best[key] = now
        return alerts

    def _recovered_or_fallen(self, comparison: _Comparison) -> bool:
        """True for a group alerted before and not recovered at this evaluation (then it does not alert again)."""
        if comparison.key not in self._fallen:
            return False
        counts = comparison.against_best
        if counts.n == comparison.best.finite and _drop(counts) < self.min_drop / 2:  # every pair of the best: back
            self._fallen.discard(comparison.key)
        return True

    def continue_after(self, evaluations: int) -> None:
        """Go on after ``evaluations`` evaluations not observed here (a resumed run whose history file cannot be
        read): their spending is not known, so from now on only the reserve is spent (``Spending.forget_past``)."""
        self.evaluations = evaluations
        self.spending.forget_past(max(evaluations - 1, 0))

    def _per_run(self, compared: list[_Comparison], share: float) -> list[RegressionAlert]:
        p_values, chosen = [], []
        for c in compared:
            p_best = alert_budget.fall_p_value(c.against_best.baseline_only, c.against_best.run_only)
            p_best = p_best if _drop(c.against_best) >= self.min_drop else 1.0
            p_previous = 1.0
            counts = c.against_previous
            if counts is not None and counts.n and _drop(counts) >= self.min_drop:
                p_previous = alert_budget.fall_p_value(counts.baseline_only, counts.run_only)
            p_values.append(alert_budget.group_p_value(p_previous, p_best, c.earlier))
            by_previous = p_previous / alert_budget.PREVIOUS_SHARE < p_best * c.earlier / (1 - alert_budget.PREVIOUS_SHARE)
            chosen.append(
                ("previous", c.previous, counts, p_previous) if by_previous else ("best", c.best, c.against_best, p_best)
            )
        q_values = alert_budget.run_q_values(p_values, share) if compared else []
        alerts = []
        for c, (reference, earlier, counts, p_value), q_value in zip(compared, chosen, q_values):
            if self._recovered_or_fallen(c) or not q_value <= self.alpha:
                continue
            self._fallen.add(c.key)
            alerts.append(self._alert(c, earlier, counts.n, p_value, float(q_value), reference))
        return alerts

    def _pooled(self, compared: list[_Comparison], share: float) -> list[RegressionAlert]:
        p_values, chosen = [], []
        for c in compared:
            p_best = alert_budget.fall_p_value(c.against_best.baseline_only, c.against_best.run_only)
            p_best = p_best if _drop(c.against_best) >= self.min_drop else 1.0
            weights, best_weight = alert_budget.pooled_weights(c.earlier)
            tests = [(p_best * max(c.earlier, 1) / best_weight, p_best, None)]
            outcomes = [e.outcomes for e in c.recent]
            for (w, lag), weight in zip(alert_windows.WINDOW_TESTS, weights):
                counts = alert_windows.window_counts(outcomes, w, lag)
                if counts is None or not counts.n or counts.drop < self.min_drop:
                    continue
                p = alert_windows.sign_flip_p_value(counts.magnitudes, counts.statistic)
                tests.append((p / weight, p, counts))
            weighted, p_value, counts = min(tests, key=lambda test: test[0])
            p_values.append(min(weighted, 1.0))
            chosen.append((p_value, counts))
        q_values = alert_budget.run_q_values(p_values, share) if compared else []
        alerts = []
        for c, (p_value, counts), q_value in zip(compared, chosen, q_values):
            if self._recovered_or_fallen(c) or not q_value <= self.alpha:
                continue
            self._fallen.add(c.key)
            if counts is None:
                alerts.append(self._alert(c, c.best, c.against_best.n, p_value, float(q_value), "best"))
                continue
            reference = c.recent[-2 * counts.window - counts.lag]  # the first evaluation of the earlier window
            if counts.window == 1:
                name = "previous" if counts.lag == 0 else "earlier"
                alerts.append(self._alert(c, reference, counts.n, p_value, float(q_value), name))
            else:
                alert = RegressionAlert(
                    c.benchmark, c.group, c.current.step, reference.step, counts.after_score, counts.before_score,
                    counts.n, float(p_value), float(q_value), self.mode, f"last {counts.window}",
                )  # fmt: skip
                alerts.append(alert)
        return alerts

    def _per_evaluation(self, compared: list[_Comparison]) -> list[RegressionAlert]:
        # The best of k earlier evaluations is the one that differs most: its p-value times k (Bonferroni) is a
        # valid p-value of "below some earlier evaluation"; then BH over the groups.
        q_values = bh_adjust([min(1.0, c.against_best.p_value * c.earlier) for c in compared])
        alerts = []
        for c, q_value in zip(compared, q_values):
            if self._recovered_or_fallen(c):
                continue
            if q_value < self.alpha and _drop(c.against_best) >= self.min_drop:
                self._fallen.add(c.key)
                alerts.append(self._alert(c, c.best, c.against_best.n, c.against_best.p_value, q_value, "best"))
        return alerts

    def _alert(self, c: _Comparison, earlier: _Evaluation, n: int, p_value, q_value, reference) -> RegressionAlert:
        return RegressionAlert(
            c.benchmark, c.group, c.current.step, earlier.step, c.current.score, earlier.score, n,
            float(p_value), float(q_value), self.mode, reference,
        )  # fmt: skip


def record_outcomes(record: Mapping[str, Any], prefix: str = "tatblimp") -> dict[str, Outcomes]:
    """The per-pair outcomes of one results record and of each of its suites (name -> Outcomes)."""
    found = {prefix: Outcomes.from_record(record)}
    for name, suite in record.get("suites", {}).items():
        if "outcomes" in suite or suite.get("pairs"):
            found[name] = Outcomes.from_record(suite)
    return found


def one_record_a_step(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``records`` in step order, a step written twice (a sweep's checkpoint scored again) kept once: the last."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for record in sorted(records, key=lambda r: r["step"]):
        by_step[record["step"]] = record
    return list(by_step.values())


def replay_alerts(
    records: Sequence[Mapping[str, Any]],
    alpha: float = DEFAULT_ALERT_Q,
    min_drop: float = DEFAULT_MIN_DROP,
    mode: str = DEFAULT_ALERT_MODE,
    evaluations: int | None = None,
) -> list[RegressionAlert]:
    """The alerts a monitor raises over ``records`` (a sweep's or a history file's), one evaluation a step, each
    under the plan its record names (``alert_plan``, written by the callbacks), or ``evaluations`` (the planned
    number of evaluations) for every record where given; neither: the spending of a run of unknown length."""
    monitor = RegressionMonitor(alpha, min_drop, mode=mode)
    alerts = []
    for record in one_record_a_step(records):
        plan = evaluations if evaluations is not None else record_plan(record)
        alerts += monitor.observe(record["step"], record_outcomes(record), plan)
    return alerts


def record_plan(record: Mapping[str, Any]) -> int | None:
    """The planned number of evaluations a record names (``alert_plan``), None where it names none; ValueError for
    one that is not a whole number of at least 1."""
    plan = record.get("alert_plan")
    if plan is not None and (isinstance(plan, bool) or not isinstance(plan, int) or plan < 1):
        raise ValueError(
            f"the record of step {record.get('step')!r}: alert_plan must be a whole number of at least 1, got {plan!r}"
        )
    return plan


def recorded_alerts(records: Sequence[Mapping[str, Any]]) -> list[RegressionAlert] | None:
    """The alerts a history file holds (the callback writes ``alerts`` in every record while it watches);
    None when no record has them (a sweep, or a run with ``alert_on_regression=False``)."""
    if not any("alerts" in record for record in records):
        return None
    return [RegressionAlert.from_dict(alert) for record in records for alert in record.get("alerts", [])]
