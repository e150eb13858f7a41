"""``TatBLiMPCallback`` settings that follow the Trainer's conventions: ``eval_steps`` as a count or a
fraction of the run's steps, and file names relative to ``output_dir``."""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path


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


def under_output_dir(path: str | os.PathLike | None, output_dir: str | os.PathLike | None) -> Path | None:
    """``path`` taken relative to ``output_dir`` (an absolute ``path`` stays; without ``output_dir``: as given)."""
    if path is None:
        return None
    if output_dir is None or Path(path).is_absolute():
        return Path(path)
    return Path(output_dir) / path
