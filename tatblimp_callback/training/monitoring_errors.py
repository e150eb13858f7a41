"""What a monitoring error does to a training run: nothing but a log line and a count (unless the user asks
for ``raise_on_error``); the random number generators are left as they were by ``engine.model_state``.

An error is logged with its traceback the first time; the same error again (a setting that cannot change,
such as a context shorter than the longest sentence) gets one line per evaluation, not another traceback.
After a success of the same step (scoring, a reporter), an error that comes back is news: it gets its
traceback again.
"""

from __future__ import annotations

import functools
import logging
import traceback
from typing import Any

logger = logging.getLogger(__name__)


class ErrorLog:
    """Logs the exception being handled: with its traceback when it differs from the last one of its source, else in one line."""

    def __init__(self):
        self.last: dict[Any, str] = {}  # source -> "Type: message" of its last error, until it succeeds

    def failed(self, what: str, error: BaseException, source: Any = None) -> None:
        """Log ``error`` (the exception being handled); ``what`` says what failed and what happens now;
        ``source``: what raised it (a function), whose errors are compared with each other."""
        text = f"{type(error).__name__}: {error}"
        source = _source(source)
        if text == self.last.get(source):
            logger.error("tatblimp: %s: %s (as before)", what, text)
            return
        self.last[source] = text
        # The traceback goes in as text: a record holding exc_info would keep the failed
        # evaluation's frames, and every tensor they reference, alive in any handler that stores records.
        logger.error("tatblimp: %s\n%s", what, traceback.format_exc())

    def succeeded(self, source: Any = None) -> None:
        """``source`` worked: its next error is logged with its traceback, even if it is the last one again."""
        self.last.pop(_source(source), None)


def _source(source: Any) -> Any:
    """What a function is, for its errors: a ``functools.partial`` (the callback makes one per evaluation, with the
    suites due) is the function it calls, or the same error would be news at every evaluation."""
    while isinstance(source, functools.partial):
        source = source.func
    return source
