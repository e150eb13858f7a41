"""Reading the JSON Lines files this package appends to (history, sweep and endpoint results).

A line ends at ``"\\n"`` only: ``str.splitlines()`` also breaks at U+2028, U+2029, U+0085 and form
feeds, which ``json.dumps(..., ensure_ascii=False)`` writes as they are inside strings. And a file
appended to by a run that was killed mid-write (or being written now) may end in a partial line: that
line is left out (its record is written again by the run that resumes), so it never makes the whole file
unreadable. Reading never writes: the repair is the writer's (``results.records_file``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def split_lines(text: str) -> list[str]:
    """The lines of JSON Lines ``text``, split at ``"\\n"`` only (a ``"\\r"`` before it dropped); none for blank text."""
    if not text.strip():
        return []
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]


def read_complete_lines(path: str | os.PathLike) -> list[str]:
    """The complete lines of the file at ``path``: a partial last line (one without its ``"\\n"``) is left out, and
    the file is not touched (``results.records_file``, the one writer, cuts such a line off before it appends).

    Raises:
        OSError: the file cannot be read.
        UnicodeDecodeError: its complete lines are not UTF-8.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        kept = raw[: raw.rfind(b"\n") + 1]
        logger.warning(
            "tatblimp: %s ends in a partial line (%d bytes, an interrupted or ongoing write); left out",
            path,
            len(raw) - len(kept),
        )
        raw = kept
    return split_lines(raw.decode("utf-8"))
