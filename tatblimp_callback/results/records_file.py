"""The one writer of the JSON Lines files the package appends to: a sweep's ``tatblimp.jsonl`` and its failures,
the callback's history files, an endpoint's answers.

Each record is one line, ``json.dumps(..., ensure_ascii=False)`` and ``"\\n"``. A run killed mid-write may have
left a partial last line (no ``"\\n"``); readers skip it and never touch the file (``reading.jsonl``: a reader on
another process may be reading while the writer writes), and the writer, the one process that appends, cuts it
off before it appends, so that the new record starts a line of its own.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ..reading.jsonl import read_complete_lines

logger = logging.getLogger(__name__)

_CHUNK = 1 << 16


def cut_partial_line(path: str | os.PathLike) -> int:
    """Cut a partial last line (one without its ``"\\n"``) off the file at ``path``; the bytes cut (0: none, or no file).

    Reads backwards from the end, a chunk at a time: a long file is not read whole.
    """
    path = Path(path)
    try:
        handle = path.open("rb+")
    except FileNotFoundError:
        return 0
    with handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:  # an empty file (a history file started afresh) has no partial line
            return 0
        end = size
        while end > 0:
            start = max(0, end - _CHUNK)
            handle.seek(start)
            chunk = handle.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        handle.truncate(end)
    logger.warning("tatblimp: %s ended in a partial line (%d bytes, from an interrupted write); cut off", path, size - end)
    return size - end


def open_for_append(path: str | os.PathLike) -> IO[str]:
    """``path`` opened to append lines (UTF-8), its folder made and a partial last line cut off first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cut_partial_line(path)
    return path.open("a", encoding="utf-8")


def append_record(path: str | os.PathLike, record: dict[str, Any], sync: bool = False) -> None:
    """Append ``record`` as one JSON line to ``path`` (see ``open_for_append``); ``sync``: on the disk before returning."""
    with open_for_append(path) as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def drop_records(path: str | os.PathLike, unwanted: Callable[[dict[str, Any]], bool]) -> int:
    """``path`` written again without the records ``unwanted`` picks (a new file moved over it, so that a reader
    sees the old one or the new one whole); how many were dropped. A missing file, or none picked: left as it is."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = read_complete_lines(path)
    kept = [line for line in lines if not unwanted(json.loads(line))]
    if len(kept) < len(lines):
        fresh = path.with_name(f".{path.name}.new")
        fresh.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        fresh.replace(path)
    return len(lines) - len(kept)


@contextmanager
def sole_writer(path: str | os.PathLike) -> Iterator[str | None]:
    """Within the block, this process is the one writer of ``path``: an advisory lock on ``.NAME.lock`` beside it,
    which the system lets go when the process ends, however it ends. Yields None, or why not: another process holds
    it (two sweeps of one run folder, a ``--watch`` left running, would score and write every checkpoint twice)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks of this kind, no check
        yield None
        return
    lock = Path(path).with_name(f".{Path(path).name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            yield f"{path}: {holder} is writing it (another sweep of this run, a --watch left running?); wait for it to end"
            return
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        try:
            yield None
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
