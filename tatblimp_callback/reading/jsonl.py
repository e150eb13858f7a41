"""Reading the JSON Lines files this package appends to (history, sweep and endpoint results).

A line ends at ``"\\n"`` only: ``str.splitlines()`` also breaks at U+2028, U+2029, U+0085 and form
feeds, which ``json.dumps(..., ensure_ascii=False)`` writes as they are inside strings. And a file
appended to by a run that was killed mid-write may end in a partial line: that line is dropped (its
record is written again by the run that resumes), so it never makes the whole file unreadable.
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
    """The lines of the file at ``path``, after cutting a partial last line (one without its ``"\\n"``) off the file.

    Raises:
        OSError: the file cannot be read, or cut.
        UnicodeDecodeError: its complete lines are not UTF-8.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        kept = raw[: raw.rfind(b"\n") + 1]
        logger.warning(
            "tatblimp: %s ended in a partial line (%d bytes, from an interrupted write); dropped", path, len(raw) - len(kept)
        )
        path.write_bytes(kept)
        raw = kept
    return split_lines(raw.decode("utf-8"))
