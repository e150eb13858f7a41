"""What Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` read from ``TatBLiMPLightningCallback``: each
evaluation's metrics in ``trainer.callback_metrics``, and a warning where their schedule cannot see them.

Both read a monitored key from ``trainer.callback_metrics``: ``ModelCheckpoint(every_n_train_steps=N)`` at
``on_train_batch_end`` (Lightning runs every ``Checkpoint`` after the other callbacks, so after that step's
evaluation), ``ModelCheckpoint`` without it and ``EarlyStopping`` at the end of a training epoch or of a
validation run (after the batch's hooks). A key missing at a check makes them raise (``EarlyStopping``'s
``strict``; ``ModelCheckpoint`` once a validation loop has run) or skip the save silently, so between
evaluations the keys keep the last evaluation's values. At an evaluation, a key of ours it did not score (a
suite that ``suite_every`` skips, a failed evaluation) is NaN, as in the Trainer callback: never a stale score.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from .suite_schedule import suite_period, unscored_placeholders

logger = logging.getLogger(__name__)


def expose(trainer, metrics: dict[str, float], is_ours: Callable[[str], bool]) -> None:
    """Put one evaluation's ``metrics`` in ``trainer.callback_metrics`` (float64 tensors, as the monitors compare
    tensors), and NaN in each key of ours (``is_ours``) that this evaluation did not score (a suite that
    ``suite_every`` skips, a failed evaluation): ``suite_schedule.unscored_placeholders``, the Trainer callback's
    rule too. Between evaluations the keys keep the last one's values."""
    ours = [name for name in trainer.callback_metrics if is_ours(name)]
    fresh = {**metrics, **unscored_placeholders(ours, metrics)}
    trainer.callback_metrics.update({name: torch.tensor(float(value), dtype=torch.float64) for name, value in fresh.items()})


def warn_about_monitors(trainer, callback: Any) -> None:
    """Warn (rank 0) about each monitoring callback whose monitored key is one of ``callback``'s but which would
    read it where no evaluation measured the weights: before the first one, or between two (where its schedule
    is known: ``every_n_train_steps``, or epoch ends of a known length; not validation runs), or at an evaluation
    that ``suite_every`` scores without its suite (NaN there)."""
    if not trainer.is_global_zero:
        return
    every = callback.eval_every_n_steps
    for each in trainer.callbacks:
        monitor = getattr(each, "monitor", None)
        if each is callback or not isinstance(monitor, str) or not callback._monitor.is_our_metric(monitor):
            continue
        name = f"{type(each).__name__}(monitor={monitor!r})"
        if not callback.eval_on_start and monitor not in trainer.callback_metrics:
            logger.warning(
                "tatblimp: %s: with eval_on_start=False, %s is there only from the first evaluation (step %d); a check "
                "before it raises (EarlyStopping strict=True) or skips the checkpoint; keep eval_on_start=True",
                name,
                monitor,
                every,
            )
        steps = _reads_every(trainer, each)
        if steps and steps % every:
            logger.warning(
                "tatblimp: %s checks every %d steps, TatBLiMP is scored every %d: at the steps between, it reads the "
                "last evaluation's value, measured on other weights; make every_n_train_steps a multiple of "
                "eval_every_n_steps",
                name,
                steps,
                every,
            )
        elif (period := suite_period(callback.suites, callback.suite_every, monitor)) > 1:
            _warn_about_suite_schedule(name, monitor, each, steps, every, period)


def _warn_about_suite_schedule(name: str, monitor: str, each, steps: int | None, every: int, period: int) -> None:
    """The warnings for a monitored suite key that ``suite_every`` scores at every ``period``-th evaluation only."""
    suite = monitor.removeprefix("eval_").split("/", 1)[0]
    if not steps or steps % (every * period):
        logger.warning(
            "tatblimp: %s: %s is scored at every %d-th evaluation only (suite_every), every %d steps; at the "
            "evaluations between, %s is NaN (ModelCheckpoint ranks it the worst); make the checks every %d steps",
            name,
            suite,
            period,
            every * period,
            monitor,
            every * period,
        )
    if getattr(each, "check_finite", False):
        logger.warning(
            "tatblimp: %s stops training at the first NaN (check_finite=True), and %s is NaN at the evaluations that "
            "suite_every skips; pass check_finite=False, or suite_every=1 for %s",
            name,
            monitor,
            suite,
        )


def _reads_every(trainer, each) -> int | None:
    """Every how many steps the monitoring callback ``each`` reads its key, where Lightning's settings tell."""
    steps = getattr(each, "_every_n_train_steps", 0) or 0
    if steps:
        return steps
    epochs = getattr(each, "_every_n_epochs", 1) or 0
    at_epoch_end = getattr(each, "_check_on_train_epoch_end", None)  # EarlyStopping's, set in its setup
    if at_epoch_end is None and hasattr(each, "_should_save_on_train_epoch_end"):  # ModelCheckpoint's
        at_epoch_end = each._should_save_on_train_epoch_end(trainer)
    batches = trainer.num_training_batches
    if not at_epoch_end or epochs < 1 or not isinstance(batches, int) or batches < 1:
        return None
    return math.ceil(batches / trainer.accumulate_grad_batches) * epochs
