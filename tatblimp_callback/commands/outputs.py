"""The files and the terminal output of the ``tatblimp`` commands.

Output files are checked before any work (a typo in ``--output`` should not cost a model load) and
written before anything is printed, so that ``tatblimp compare ... --json out.json | head -3`` still
writes ``out.json``. A reader that closes stdout early (``| head``) is not an error: what is left to
print is dropped, and the command goes on and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path


def check_output_file(
    path: str | os.PathLike | None, option: str, inputs: Iterable[str | os.PathLike | None] = (), appends: bool = False
) -> None:
    """Raise ValueError, naming ``option``, when ``path`` cannot be written: a folder, under a file, a folder
    that cannot be created or written in (``/proc/x/out.json``, a read-only mount), or one of the command's ``inputs``
    (given as on its command line: ``PATH``, a suite's ``NAME=PATH``, a run's ``PATH@STEP``), which writing would destroy.

    A file that holds a run's evaluations (a sweep's or a history's lines) is refused too, unless the command
    ``appends`` to it. It tries: the missing folders on the way are made, a probe file is written in the last one, and both are
    removed again, so a command that fails later leaves nothing behind. None: nothing to check.
    """
    if path is None:
        return
    path = Path(path)
    for given in filter(None, inputs):
        text = str(given)
        candidates = {text, text.split("=", 1)[-1], text.rsplit("@", 1)[0], text.split("=", 1)[-1].rsplit("@", 1)[0]}
        if any(_same_file(path, candidate) for candidate in candidates):
            raise ValueError(f"{option} {path}: the same file as the input {given}, which writing it would destroy")
    if path.is_dir():
        raise ValueError(f"{option} {path}: a folder; give a file name")
    if not appends and _holds_evaluations(path):
        raise ValueError(
            f"{option} {path}: holds the evaluations of a run (a sweep's or a history file's JSON lines, with steps), "
            "which writing it would replace; give another file name"
        )
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, not a folder")
    made = []
    try:
        folder = existing
        for part in path.parent.relative_to(existing).parts:
            folder = folder / part
            folder.mkdir()
            made.append(folder)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tatblimp-probe-"):
            pass
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot write in {folder} ({err.strerror or err})") from None
    finally:
        for made_folder in reversed(made):
            made_folder.rmdir()


def _holds_evaluations(path: Path) -> bool:
    """Whether ``path`` is a file whose first line is one evaluation's record (``{"step": ..., "acc_norm": ...}``): a
    sweep's results, a callback's history. No command writes one whole, so none may replace one."""
    try:
        with path.open("rb") as handle:
            first = json.loads(handle.readline(1 << 22))
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and "step" in first and "acc_norm" in first


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, creating its folder.

    Raises:
        OSError: naming ``path`` (the system's own error names none: ``[Errno 28] No space left on device``).
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as err:
        raise OSError(f"{path}: cannot write ({err.strerror or err})") from err


def silence_stdout() -> None:
    """After a ``BrokenPipeError``: point stdout at the null device, so later prints (and the flush at exit) do
    not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def say(text: str) -> None:
    """Print ``text`` to stdout; a closed stdout (``| head``) silences the rest of the output instead of failing."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()


@contextmanager
def quiet_progress_bars():
    """transformers' progress bars (and huggingface_hub's) off inside; as they were after. Usable as a decorator."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _same_file(path: Path, other: str) -> bool:
    try:
        return os.path.samefile(path, other)
    except (OSError, ValueError):  # either does not exist (a new output is no input), or a name no path can have
        return False
