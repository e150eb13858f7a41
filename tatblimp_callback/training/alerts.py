"""The callback's regression alerts, and what it keeps for the end of training's learning summary.

After each evaluation ``RegressionAlerts.observe`` hands the results (TatBLiMP's and each suite's per-pair
outcomes) to ``regressions.RegressionMonitor``; each alert it raises is a warning line, one more in the
``<prefix>/alerts`` count, an entry under ``alerts`` in that step's history-file record and, where a wandb run
is active, ``run.alert(title, text, level=WARN)`` (wandb's email or Slack notification). An error here is
logged and never stops training. ``plan``, the run's planned number of evaluations (the callback's, from the
Trainer's ``max_steps``), goes to the monitor with each evaluation and into each record (``alert_plan``), so that a
replay of the file spends the run's budget as the callback did. It also keeps TatBLiMP's outcomes of every
evaluation, from which the end of training fits each phenomenon's acquisition and reads its trend
(``learning.py``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine import distributed
from ..reading.jsonl import read_complete_lines
from ..results.learning import LearningSummary, learning_summary
from ..results.metrics import Results
from ..results.regressions import DEFAULT_ALERT_MODE, RegressionAlert, RegressionMonitor, record_plan
from ..results.stats import Outcomes
from .reporting import learning_line, print_line, wandb_run

logger = logging.getLogger(__name__)


class RegressionAlerts:
    """Regression alerts of one training run (``enabled``: ``alert_on_regression``), keys under ``prefix``."""

    def __init__(
        self,
        enabled: bool,
        alpha: float,
        min_drop: float,
        prefix: str,
        restored: Sequence[dict[str, Any]] = (),
        mode: str = DEFAULT_ALERT_MODE,
    ):
        self.enabled, self.prefix = enabled, prefix
        self.plan: int | None = None  # the run's planned number of evaluations (set by the callback)
        self.monitor = RegressionMonitor(alpha, min_drop, mode=mode)
        self.alerts: list[RegressionAlert] = []
        # A resumed run's count goes on from its restored log history, and so does the per-run budget's sequence of
        # evaluations (on every process, with or without a history file to compare with).
        self.count = int(max((entry.get(f"{prefix}/alerts", 0) for entry in restored), default=0))
        self._restored_evaluations = sum(f"{prefix}/acc" in entry for entry in restored)
        if self._restored_evaluations:  # their spending is known only from the history file (``restore``)
            self.monitor.continue_after(self._restored_evaluations)
        self.evaluations: list[tuple[int, Outcomes]] = []  # TatBLiMP's outcomes at each step, for the summary
        self._by_step: dict[int, list[RegressionAlert]] = {}

    def observe(self, step: int, results: Results, main_process: bool = True) -> dict[str, float]:
        """Check the evaluation at ``step``; returns the metrics to log with it: ``<prefix>/alerts``, the run's count,
        from its first alert on (as ``<prefix>/failures``)."""
        try:
            outcomes = {self.prefix: Outcomes.from_dict(results.outcomes())}
            self.evaluations.append((step, outcomes[self.prefix]))
            if not self.enabled:
                return {}
            outcomes.update({name: Outcomes.from_dict(suite.outcomes()) for name, suite in results.suites.items()})
            raised = self.monitor.observe(step, outcomes, self.plan)
        except Exception as error:  # a monitoring error never stops training
            logger.warning("tatblimp: step %d: the regression check failed (%s: %s)", step, type(error).__name__, error)
            return {}
        self._by_step[step] = raised
        self.alerts += raised
        self.count += len(raised)
        if main_process:
            for alert in raised:
                logger.warning("tatblimp: REGRESSION: %s", alert.text)
                self._to_wandb(alert)
        return {f"{self.prefix}/alerts": float(self.count)} if self.count else {}  # as failures: once there are any

    def agreed_count(self, main_process: bool = True) -> dict[str, float]:
        """``<prefix>/alerts``, the run's count, the same on every process (a collective under torch.distributed,
        called by all after ``observe``): the main process's, since only it compared a resumed run's evaluations
        with those of its history file. From the first alert on (as ``<prefix>/failures``)."""
        if self.enabled:
            self.count = distributed.check_in(value=self.count if main_process else 0)[1]
        return {f"{self.prefix}/alerts": float(self.count)} if self.count else {}

    def restore(self, path: os.PathLike | str) -> None:
        """A resumed run: the evaluations kept in its history file (those up to the checkpoint) go through the monitor
        again, silently, so that the next evaluation is compared with the run's best, not only with the evaluations
        after the resume. TatBLiMP only: a suite's comparisons start again at the resume. A record that cannot be
        read is left out (and said, with its line), but still counted in the per-run budget's sequence, under the
        plan of the record before it."""
        try:
            lines = [line for line in read_complete_lines(Path(path)) if line.strip()]
        except OSError as error:
            logger.warning("tatblimp: the regression check starts afresh: cannot read %s (%s)", path, error)
            return
        records, unreadable, plan = [], [], None
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                records.append((record["step"], Outcomes.from_record(record), record_plan(record)))
                plan = records[-1][2]
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                unreadable.append(f"record {number}: {type(error).__name__}: {error}")
                records.append((None, None, plan))
        if unreadable:
            logger.warning(
                "tatblimp: the regression check leaves out %d record(s) of %s it cannot read (%s); it compares with the "
                "others", len(unreadable), path, "; ".join(unreadable[:3]),
            )  # fmt: skip
        old = self.monitor
        self.monitor = RegressionMonitor(old.alpha, old.min_drop, old.metric, old.mode)
        for step, outcomes, plan in records:
            if outcomes is not None:
                self.evaluations.append((step, outcomes))
            if self.enabled:
                self.monitor.observe(step, {self.prefix: outcomes} if outcomes is not None else {}, plan)
        if self.monitor.evaluations < self._restored_evaluations:  # lines missing: what they spent is not known
            self.monitor.continue_after(self._restored_evaluations)

    def fields(self, step: int) -> dict[str, Any]:
        """What the history-file record of ``step`` gets: ``{"alerts": [...]}`` while alerts are on, and
        ``"alert_plan"``, the planned number of evaluations, where there is one."""
        if not self.enabled:
            return {}
        plan = {"alert_plan": self.plan} if self.plan is not None else {}
        return {"alerts": [alert.to_dict() for alert in self._by_step.get(step, [])], **plan}

    def summary(self, main_process: bool = True) -> LearningSummary | None:
        """Fits and trends of TatBLiMP's phenomena over the evaluations seen (``learning.learning_summary``), the
        trends also said in one console line (main process); None (and a warning) if they cannot be computed."""
        try:
            summary = learning_summary(self.evaluations)
        except Exception as error:  # a monitoring error never stops training
            logger.warning("tatblimp: the learning summary failed (%s: %s)", type(error).__name__, error)
            return None
        if main_process and self.evaluations:  # none: no log-prob evaluation (forced choice only) to speak of
            print_line(learning_line(summary))
        return summary

    @staticmethod
    def _to_wandb(alert: RegressionAlert) -> None:
        run = wandb_run()
        if run is None:
            return
        try:
            import wandb

            run.alert(title=alert.title, text=alert.text, level=wandb.AlertLevel.WARN, wait_duration=1)
        except Exception as error:
            logger.warning("tatblimp: could not send the alert to wandb (%s: %s)", type(error).__name__, error)
