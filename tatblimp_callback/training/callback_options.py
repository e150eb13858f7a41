"""``TatBLiMPCallback``'s settings: all of them checked when it is built (``check_options``); those that follow the
Trainer's conventions: ``eval_steps`` as a count or a fraction of the run's steps, and file names relative to
``output_dir``; the run's planned number of evaluations (``planned_evaluations``), which the regression alerts spread
their budget over."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from pathlib import Path

from ..engine.head_choice import HeadMethod
from ..engine.memory_budget import check_sizes
from ..engine.precision import check_precision
from ..reading.option_types import check_flags, is_whole_number
from ..tokenized.tokenization import check_prefix_token_id, check_tokenizer
from .suite_schedule import check_suite_options


def check_options(options) -> int | None:
    """Check the options of a ``TatBLiMPCallback`` being built; the steps between evaluations (``check_eval_steps``).

    Raises:
        ValueError: an option's value is invalid, named with what it should be.
    """
    every = check_eval_steps(options.eval_steps)
    check_shared_options(options)
    if options.report_file is not None and options.history_file is None:
        raise ValueError("report_file is drawn from the history file: it needs history_file (not None)")
    if options.report_file is not None and options.protocol == "forced-choice":
        raise ValueError(
            "report_file is drawn from the log-prob evaluations' history, which protocol='forced-choice' has none of: "
            "use protocol='both', or drop report_file"
        )
    return every


def check_shared_options(options) -> None:
    """Check the options both callbacks take (``TatBLiMPCallback``'s and ``TatBLiMPLightningCallback``'s), so that
    a typo stops the run when the callback is built rather than failing every evaluation of a run that goes on.

    Raises:
        ValueError: an option's value is invalid, named with what it should be.
    """
    check_alert_evaluations(options.alert_evaluations)
    # Every option declared a bool ("no" or "False" would read as True), in the order declared
    flags = [field.name for field in dataclasses.fields(options) if field.type in ("bool", bool)]
    check_flags(**{name: getattr(options, name) for name in flags})
    check_sizes(options.memory_budget, options.row_length)
    check_tokenizer(options.tokenizer)
    check_prefix_token_id(options.prefix_token_id)
    if options.head_method is not None:
        HeadMethod.parse(options.head_method)
    check_precision(options.precision)
    if options.protocol not in ("logprob", "forced-choice", "both"):
        raise ValueError(f"protocol must be 'logprob', 'forced-choice' or 'both', got {options.protocol!r}")
    threshold = options.acquisition_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold <= 1:
        raise ValueError(f"acquisition_threshold must be an acc_norm from 0 to 1, got {threshold!r}")
    check_suite_options(options.suites, options.suite_every, options.log_prefix, options.protocol)


def check_eval_steps(eval_steps) -> int | None:
    """The steps between evaluations ``eval_steps`` gives, or None when it is a fraction of a run's steps
    (known when training starts; see ``steps_between``).

    Raises:
        ValueError: not a whole number of steps of at least 1, nor a fraction between 0 and 1.
    """
    if isinstance(eval_steps, numbers.Real) and not isinstance(eval_steps, bool):
        if 0 < eval_steps < 1:
            return None
        if eval_steps >= 1 and float(eval_steps).is_integer():
            return int(eval_steps)
    raise ValueError(
        "eval_steps must be a number of steps (a whole number, at least 1) or a fraction of the run's total steps "
        f"(a float between 0 and 1, as in TrainingArguments), got {eval_steps!r}"
    )


def steps_between(eval_steps: int | float, max_steps: int) -> int:
    """Steps between evaluations in a run of ``max_steps``: ``eval_steps``, or for a fraction
    ``ceil(eval_steps * max_steps)`` (at least 1), as the Trainer computes its own ``eval_steps``."""
    every = check_eval_steps(eval_steps)
    return every if every is not None else max(1, math.ceil(eval_steps * max_steps))


def check_alert_evaluations(value) -> None:
    """``alert_evaluations``: None or a whole number of at least 2 (one evaluation compares nothing).

    Raises:
        ValueError: anything else.
    """
    if value is not None and (not is_whole_number(value) or value < 2):
        raise ValueError(
            "alert_evaluations must be the run's planned number of evaluations (a whole number, at least 2) or None "
            f"(from the Trainer's max_steps), got {value!r}"
        )


def planned_evaluations(max_steps, every: int, start: bool, end: bool, also_every: int | None = None) -> int | None:
    """The evaluations of a run of ``max_steps`` steps (a number; anything else, or under 1: None, not known):
    at step 0 (``start``), at every multiple of ``every`` and of ``also_every`` (the Trainer's own evaluations,
    which the callback also scores; one step counted once) and at the last step (``end``)."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Real) or not 1 <= max_steps < math.inf:
        return None
    max_steps = int(max_steps)
    count = int(start) + max_steps // every
    if also_every:
        count += max_steps // also_every - max_steps // math.lcm(every, also_every)
    if end and max_steps % every and not (also_every and max_steps % also_every == 0):
        count += 1
    return count


def under_output_dir(path: str | os.PathLike | None, output_dir: str | os.PathLike | None) -> Path | None:
    """``path`` taken relative to ``output_dir`` (an absolute ``path`` stays; without ``output_dir``: as given)."""
    if path is None:
        return None
    if output_dir is None or Path(path).is_absolute():
        return Path(path)
    return Path(output_dir) / path
