"""The callback's side of more suites: its options checked, which suites an evaluation scores, their history files."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..reading.suites import check_suites
from . import reporting

logger = logging.getLogger(__name__)


def check_suite_options(suites: dict[str, Any] | None, suite_every: int | dict[str, int], log_prefix: str, protocol: str) -> None:
    """``ValueError`` for ``suites`` that are not ``{name: path or Suite}`` (``check_suites``), a ``log_prefix`` that
    is not a non-empty string, a ``suite_every`` that is not k >= 1 (or ``{known suite: k >= 1}``), a suite name that
    clashes with the log prefix or holds "/", or suites without the log-prob protocol."""
    check_suites(suites)
    if not isinstance(log_prefix, str) or not log_prefix:
        raise ValueError(f"log_prefix must be a non-empty string (the logged keys' section), got {log_prefix!r}")
    names = set(suites or {})
    every = suite_every if isinstance(suite_every, dict) else {"suite_every": suite_every}
    if any(not isinstance(k, int) or k < 1 for k in every.values()) or set(every) - {"suite_every", *names}:
        raise ValueError(f"suite_every must be an int >= 1 or {{suite name: int >= 1}}, got {suite_every!r}")
    if {log_prefix, f"{log_prefix}_fc"} & names or any("/" in name for name in names):
        raise ValueError(f"suite names must differ from the log prefix and hold no '/': {sorted(names)}")
    if names and protocol == "forced-choice":
        raise ValueError("suites= are scored by log-probs: use protocol 'logprob' or 'both'")


def suite_period(suites: dict[str, Any] | None, suite_every: int | dict[str, int], key: str) -> int:
    """Every how many evaluations the logged ``key`` is scored: its suite's k (``suite_every``), else 1."""
    name = key.removeprefix("eval_").split("/", 1)[0]
    if name not in (suites or {}):
        return 1
    return suite_every.get(name, 1) if isinstance(suite_every, dict) else suite_every


def suites_due(suites: dict[str, Any] | None, suite_every: int | dict[str, int], evaluation: int) -> list[str]:
    """The suites the ``evaluation``-th evaluation (from 0) scores: those whose k (``suite_every``) divides it."""
    every = suite_every if isinstance(suite_every, dict) else dict.fromkeys(suites or {}, suite_every)
    return [name for name in suites or {} if evaluation % every.get(name, 1) == 0]


def unscored_placeholders(monitored: Iterable[str], metrics: dict[str, float]) -> dict[str, float]:
    """The one rule of what a monitored key holds after an evaluation, for both callbacks: its value where this
    evaluation's ``metrics`` have it, else NaN: a suite that ``suite_every`` skips here, or scoring that failed.
    Returns ``{key: NaN}`` for each key of ``monitored`` missing from ``metrics``.

    NaN is never the best: the Trainer's ``np.greater`` and ``np.less`` are False on it, Lightning's
    ``ModelCheckpoint`` ranks it as the worst; a stale value would rank these weights by other weights' score
    (and the Trainer's ``KeyError`` on a missing ``metric_for_best_model`` would end the run)."""
    return {key: float("nan") for key in monitored if key not in metrics}


def never_logged(wanted: str, metrics: dict[str, float]) -> bool:
    """True when an evaluation logged ``wanted``'s section (``eval_blimp/...``) but not ``wanted`` itself: a key
    the callback never logs (a typo in ``metric_for_best_model``), which would be NaN at every evaluation."""
    section = wanted.split("/", 1)[0] + "/"
    return wanted not in metrics and any(key.startswith(section) for key in metrics)


def suite_history_files(
    history_file: reporting.HistoryFile | None, suites: dict[str, Any] | None, history: list[dict[str, Any]]
) -> dict[str, reporting.HistoryFile]:
    """``<history_file stem>.<name>.jsonl`` per suite, keeping a resumed run's lines of the steps in ``history``."""
    if history_file is None:
        return {}
    files = {}
    for name in suites or {}:
        path = history_file.path
        suite_file = reporting.HistoryFile(path.with_name(f"{path.stem}.{name}{path.suffix}"))
        try:
            suite_file.start({entry["step"] for entry in history if f"{name}/acc" in entry})
        except (OSError, ValueError) as err:  # unreadable, or not JSON lines: say so, and train on
            logger.warning("tatblimp: cannot use the history file %s (%s); none is written in this run", suite_file.path, err)
            continue
        files[name] = suite_file
    return files
