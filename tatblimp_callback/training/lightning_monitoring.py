"""What Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` read from ``TatBLiMPLightningCallback``: each
evaluation's metrics in ``trainer.callback_metrics``, and a warning where their schedule cannot see them.

Both read a monitored key from ``trainer.callback_metrics``: ``ModelCheckpoint(every_n_train_steps=N)`` at
``on_train_batch_end`` (Lightning runs every ``Checkpoint`` after the other callbacks, so after that step's
evaluation), ``ModelCheckpoint`` without it and ``EarlyStopping`` at the end of a training epoch or of a
validation run (after the batch's hooks). A key missing at a check makes them raise (``EarlyStopping``'s
``strict``; ``ModelCheckpoint`` once a validation loop has run) or skip the save silently, so between
evaluations the keys keep the last evaluation's values. At an evaluation, a key of ours it did not score (a
suite that ``suite_every`` skips, a failed evaluation) is NaN, as in the Trainer callback: never a stale score.
``ModelCheckpoint`` ranks NaN the worst, and ``EarlyStopping`` counts it as no improvement, as the Trainer's
``EarlyStoppingCallback`` does: its ``check_finite`` (on by default, meant for a diverging loss) would end the run
at the first failed evaluation, so ``UnscoredChecks`` sets it aside while the key it monitors holds that NaN.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from .suite_schedule import suite_period, unscored_placeholders

logger = logging.getLogger(__name__)


def expose(
    trainer, metrics: dict[str, float], is_ours: Callable[[str], bool], step: int, checks: UnscoredChecks | None = None
) -> None:
    """Put one evaluation's ``metrics`` in ``trainer.callback_metrics`` (float64 tensors, as the monitors compare
    tensors), and NaN in each key of ours (``is_ours``) that this evaluation did not score (a suite that
    ``suite_every`` skips, a failed evaluation): ``suite_schedule.unscored_placeholders``, the Trainer callback's
    rule too. Between evaluations the keys keep the last one's values. ``checks``: the ``EarlyStopping`` finite
    checks to set aside on those NaN (and put back on a score). A key of ours that a monitor reads is among them
    before any evaluation has scored it: missing, it would make ``EarlyStopping`` end the run when every evaluation
    fails (a data path that does not exist)."""
    monitored = (getattr(each, "monitor", None) for each in trainer.callbacks)
    ours = {
        *(name for name in trainer.callback_metrics if is_ours(name)),
        *(m for m in monitored if isinstance(m, str) and is_ours(m)),
    }
    unscored = unscored_placeholders(ours, metrics)
    fresh = {**metrics, **unscored}
    trainer.callback_metrics.update({name: torch.tensor(float(value), dtype=torch.float64) for name, value in fresh.items()})
    if checks is not None:
        checks.follow(trainer, step, set(unscored), set(metrics))


class UnscoredChecks:
    """``EarlyStopping(check_finite=True)`` on a key of ours, made to count an evaluation that did not score the key
    as no improvement (the Trainer's ``EarlyStoppingCallback`` rule), not as a diverging run.

    Its ``check_finite`` is set to False while the key holds the NaN of an unscored evaluation (a failure, a suite
    that ``suite_every`` skips), and put back as the user set it once the key is scored again, and when training
    ends (``put_back``). A NaN that scoring itself gave is not set aside. One instance a callback; every rank sets
    aside its own ``EarlyStopping``'s check.
    """

    def __init__(self):
        self._held: list[Any] = []  # the EarlyStopping callbacks whose check_finite is set aside now

    def follow(self, trainer, step: int, unscored: set[str], scored: set[str]) -> None:
        """After one evaluation: set aside the check of each ``EarlyStopping`` monitoring a key in ``unscored``; put
        back that of each monitoring a key in ``scored``."""
        from lightning.pytorch.callbacks import EarlyStopping

        for each in trainer.callbacks:
            if not isinstance(each, EarlyStopping):
                continue
            held = any(each is other for other in self._held)
            if each.monitor in unscored and each.check_finite and not held:
                each.check_finite = False
                self._held.append(each)
                logger.info(
                    "tatblimp: step %d: %s was not scored (NaN): EarlyStopping(monitor=%r) counts it as no improvement, "
                    "its check_finite set aside until the key is scored again",
                    step,
                    each.monitor,
                    each.monitor,
                )
            elif each.monitor in scored and held:
                each.check_finite = True
                self._held = [other for other in self._held if other is not each]

    def put_back(self) -> None:
        """Every check set aside, as the user set it (training ended, or stopped on an error)."""
        for each in self._held:
            each.check_finite = True
        self._held = []


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
            _warn_about_suite_schedule(name, monitor, steps, every, period)


def _warn_about_suite_schedule(name: str, monitor: str, steps: int | None, every: int, period: int) -> None:
    """The warning for a monitored suite key that ``suite_every`` scores at every ``period``-th evaluation only."""
    suite = monitor.removeprefix("eval_").split("/", 1)[0]
    if not steps or steps % (every * period):
        logger.warning(
            "tatblimp: %s: %s is scored at every %d-th evaluation only (suite_every), every %d steps; at the "
            "evaluations between, %s is NaN (ModelCheckpoint ranks it the worst, EarlyStopping counts it as no "
            "improvement); make the checks every %d steps",
            name,
            suite,
            period,
            every * period,
            monitor,
            every * period,
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
