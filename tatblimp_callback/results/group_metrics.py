"""The metrics of one group of pairs (a phenomenon, a subtype, or all), and the grouping both protocols use.

``GroupResult`` holds acc, acc_norm (strict: a tie fails), the mean margin, the ties and the pairs left out for
non-finite log-probs, with the 95% Wilson intervals; ``group_result`` computes it from a group's log-probs and byte
counts. ``grouped`` summarises all pairs and each named group of them, for the log-prob protocol's ``Results``
(``metrics.py``) and the forced-choice results (``chat/choice_results.py``) alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from .stats import wilson_interval


@dataclass
class GroupResult:
    """Metrics of one group of pairs (a phenomenon, a subtype, or all)."""

    n: int  # pairs with finite log-probs (the denominator)
    acc: float
    acc_norm: float
    mean_margin: float  # mean of logP(good) - logP(bad), nats
    ties: int  # pairs with logP(good) == logP(bad)
    ties_norm: int
    non_finite: int = 0  # pairs left out because a log-prob was NaN or inf

    # acc = passed / n exactly (a float mean of n booleans), so round(acc * n) is the count of passed pairs.
    @property
    def acc_ci(self) -> tuple[float, float]:
        """95% Wilson interval of ``acc``."""
        return wilson_interval(round(self.acc * self.n), self.n) if self.n else (math.nan, math.nan)

    @property
    def acc_norm_ci(self) -> tuple[float, float]:
        """95% Wilson interval of ``acc_norm``."""
        return wilson_interval(round(self.acc_norm * self.n), self.n) if self.n else (math.nan, math.nan)

    def to_dict(self) -> dict[str, Any]:
        """The fields and both intervals (``[low, high]``)."""
        return {**asdict(self), "acc_ci": list(self.acc_ci), "acc_norm_ci": list(self.acc_norm_ci)}


G = TypeVar("G")


def overall_metric(name: str) -> property:
    """A read-only property giving ``self.overall.<name>``: a results object's headline numbers."""
    return property(lambda self: getattr(self.overall, name), doc=f"``overall.{name}``")


def grouped(summarise: Callable[[np.ndarray], G], group_index: np.ndarray, names: Sequence[str]) -> tuple[G, dict[str, G]]:
    """``summarise(mask)`` over all pairs, and over each named group of them (both protocols' results use it).

    ``mask`` is a boolean array over pairs; ``group_index[i]`` is pair ``i``'s index in ``names``
    (-1: in no group).
    """
    overall = summarise(np.ones(len(group_index), dtype=bool))
    return overall, {name: summarise(group_index == i) for i, name in enumerate(names)}


def group_result(good, bad, good_bytes, bad_bytes) -> GroupResult:
    """The metrics of a group from its pairs' log-probs and byte counts (numpy arrays, one entry a pair); pairs with a
    non-finite log-prob are left out and counted."""
    finite = np.isfinite(good) & np.isfinite(bad)
    good, bad, good_bytes, bad_bytes = good[finite], bad[finite], good_bytes[finite], bad_bytes[finite]
    n = int(finite.sum())
    good_norm, bad_norm = good / good_bytes, bad / bad_bytes
    return GroupResult(
        n=n,
        acc=float((good > bad).mean()) if n else math.nan,
        acc_norm=float((good_norm > bad_norm).mean()) if n else math.nan,
        mean_margin=float((good - bad).mean()) if n else math.nan,
        ties=int((good == bad).sum()),
        ties_norm=int((good_norm == bad_norm).sum()),
        non_finite=int((~finite).sum()),
    )
