"""The checkpoints of a training run's folder, and when each is complete enough to read.

Checkpoints are the sub-folders of a run folder named as a checkpoint (the Trainer's ``checkpoint-<step>``,
or ``step_1000``, ``ckpt42``, ``global_step500``, ``iter_0300``, or the step alone, ``1000``) that hold a
``config.json``, or a PEFT adapter's ``adapter_config.json`` (scored on its base model, see ``adapters``).
Other model folders of a run, ``export_fp16`` or ``merged_v2``, end in digits that are not steps: they
are not swept (a warning names them).

A checkpoint is read only once it is complete: when its ``trainer_state.json`` exists (the
Trainer writes it after the weights), or else when it holds a weights file (``model.safetensors``,
``pytorch_model.bin`` or a sharded index) and the size and modification time of every file in it
stayed the same between two polls ``interval`` seconds apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .adapters import ADAPTER_WEIGHTS, MODEL_WEIGHTS, is_adapter_folder

logger = logging.getLogger(__name__)
_warned: set[Path] = set()  # a watching sweep polls every few seconds: each such folder is named once

TRAINER_STATE = "trainer_state.json"
WEIGHTS_FILES = (*MODEL_WEIGHTS, *ADAPTER_WEIGHTS)
_STEP_NAME = re.compile(r"^(?:(?:checkpoint|ckpt|step|global[-_]?step|iter|iteration)[-_]?)?(\d+)$", re.IGNORECASE)
_ENDS_IN_DIGITS = re.compile(r"\d$")
_CHECKPOINT_NAME = re.compile(r"(?:checkpoint|step|ckpt)[-_]?(\d+)$", re.IGNORECASE)


class SweepError(RuntimeError):
    """A run folder or its results file cannot be swept (two checkpoints with one step, a bad line, ...)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def find_checkpoints(run_dir: str | os.PathLike) -> list[Checkpoint]:
    """Sub-folders of ``run_dir`` named as checkpoints (``checkpoint-<step>``, ``step_<step>``, ...) and holding a
    ``config.json`` (or a PEFT adapter's ``adapter_config.json``), by step."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SweepError(f"{run_dir}: {'a file, not a run folder' if run_dir.exists() else 'no such folder'}")
    by_step: dict[int, Path] = {}
    for child in sorted(run_dir.iterdir()):
        if not child.is_dir() or not ((child / "config.json").is_file() or is_adapter_folder(child)):
            continue
        match = _STEP_NAME.match(child.name)
        if not match:
            if _ENDS_IN_DIGITS.search(child.name) and child not in _warned:
                _warned.add(child)
                logger.warning(
                    "tatblimp: %s holds a model, but its name is not a checkpoint's (checkpoint-<step>, step_<step>, "
                    "ckpt<step>, ...): not swept",
                    child,
                )
            continue
        step = int(match.group(1))
        if step in by_step:
            raise SweepError(f"{run_dir}: {by_step[step].name} and {child.name} both claim step {step}")
        by_step[step] = child
    return [Checkpoint(step, by_step[step]) for step in sorted(by_step)]


def step_of(path: str | os.PathLike | None) -> int | None:
    """The step of a model folder named as a checkpoint (``runs/x/checkpoint-40``: 40; also ``step_1000``,
    ``ckpt-5``); None for any other name (``model0`` is not a step)."""
    match = _CHECKPOINT_NAME.search(Path(path).name) if path else None
    return int(match.group(1)) if match else None


def has_weights(path: Path) -> bool:
    return any((path / name).is_file() for name in WEIGHTS_FILES)


_SAMPLE = 1 << 20  # bytes read at each end of a weights file
_identities: dict[tuple, str] = {}  # (file, size, mtime_ns) of a folder's weights -> its identity, read once a process


def weights_identity(path: Path) -> str:
    """What a checkpoint's weights are, cheaply: each weights file's name and size and its first and last MiB, hashed
    (a copy of the folder keeps it; a checkpoint saved again in place, by a new run into the same folder, changes it).
    Read once for each state of the files."""
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin") or f.name in WEIGHTS_FILES)
    key = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if (path, key) not in _identities:
        digest = hashlib.sha256()
        for file, (name, size, _) in zip(files, key):
            with file.open("rb") as handle:
                head = handle.read(_SAMPLE)
                handle.seek(max(size - _SAMPLE, 0))
                digest.update(f"{name}\0{size}\0".encode() + head + handle.read())
        _identities[path, key] = digest.hexdigest()[:16]
    return _identities[path, key]


def _snapshot(path: Path) -> tuple:
    entries = []
    for file in sorted(path.rglob("*")):
        try:
            stat = file.stat()
        except FileNotFoundError:  # deleted between listing and stat: the folder is changing
            entries.append((str(file), -1, -1))
            continue
        if file.is_file():
            entries.append((str(file.relative_to(path)), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


class CheckpointWatcher:
    """Tells complete checkpoints from those still being written, by polling (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, interval: float):
        self.run_dir = Path(run_dir)
        self.interval = interval
        self._seen: dict[Path, tuple[tuple, float]] = {}  # path -> (snapshot, when it was first seen so)

    def poll(self, now: float | None = None) -> tuple[list[Checkpoint], list[Checkpoint]]:
        """(complete, not yet complete) checkpoints, each in step order."""
        now = time.monotonic() if now is None else now
        ready, pending = [], []
        for checkpoint in find_checkpoints(self.run_dir):
            (ready if self._is_complete(checkpoint.path, now) else pending).append(checkpoint)
        return ready, pending

    def _is_complete(self, path: Path, now: float) -> bool:
        if (path / TRAINER_STATE).is_file():
            return True
        if not has_weights(path):
            return False
        snapshot = _snapshot(path)
        previous = self._seen.get(path)
        if previous is None or previous[0] != snapshot:
            self._seen[path] = (snapshot, now)
            return False
        return now - previous[1] >= self.interval


def no_checkpoints_message(run_dir: str | os.PathLike) -> str:
    """One line for a folder without checkpoints: what was looked for, and where checkpoints are instead
    (sub-folders that hold some, or the folder's own run folder when it is itself a checkpoint)."""
    run_dir = Path(run_dir)
    message = (
        f"{run_dir}: no checkpoints found (looked for sub-folders named with a step number, e.g. checkpoint-500, "
        "holding a config.json or adapter_config.json)"
    )
    if (run_dir / "config.json").is_file() or is_adapter_folder(run_dir):
        message += f"; {run_dir} is itself a checkpoint: score it with `tatblimp score {run_dir}`"
        if run_dir.resolve() in {c.path.resolve() for c in _checkpoints_or_none(run_dir.resolve().parent)}:
            message += f", or sweep its run folder {run_dir.parent}"
        return message
    holding = [str(folder) for folder in _folders_with_checkpoints(run_dir)]
    if holding:
        listed = ", ".join(holding[:5]) + (f" and {len(holding) - 5} more" if len(holding) > 5 else "")
        return message + f"; these sub-folders hold checkpoints: {listed} (sweep one of them)"
    unnamed = [child.name for child in _subfolders(run_dir) if _STEP_NAME.match(child.name)]
    if unnamed:
        return message + f"; {', '.join(unnamed[:5])} {'is' if len(unnamed) == 1 else 'are'} named like one but without either"
    model = run_dir / "model"  # where the demo (and many scripts) save the final model
    if (model / "config.json").is_file() or is_adapter_folder(model):
        message += f"; {model} holds a saved model: score it with `tatblimp score {model}`"
    return message + (
        "; a Trainer saves checkpoints only with save_steps (TrainingArguments(save_strategy='steps', save_steps=N); "
        "the demo: examples/train_tiny_tatar.py --save-steps N)"
    )


def run_folder_message(folder: str | os.PathLike) -> str | None:
    """One line for a run folder given where one model is wanted (``score``, ``explain``, ``report --model``): its
    checkpoints by name and what to give instead; None for a model folder or a folder without checkpoints."""
    folder = Path(folder)
    if (folder / "config.json").is_file() or is_adapter_folder(folder):
        return None
    checkpoints = _checkpoints_or_none(folder)
    if not checkpoints:
        return None
    names = [c.name for c in checkpoints]
    listed = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, ..., {', '.join(names[-2:])}"
    return (
        f"{folder}: a training run's folder with {len(names)} checkpoint(s) ({listed}), not a model folder; give one "
        f"checkpoint's folder ({folder / names[-1]}), or score them all with `tatblimp sweep {folder}`"
    )


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(child for child in folder.iterdir() if child.is_dir())
    except OSError:
        return []


def _checkpoints_or_none(folder: Path) -> list[Checkpoint]:
    try:
        return find_checkpoints(folder)
    except (OSError, SweepError):
        return []


def _folders_with_checkpoints(run_dir: Path, depth: int = 2) -> list[Path]:
    """Sub-folders of ``run_dir``, up to ``depth`` levels down, that hold checkpoints (a run folder of runs)."""
    found = []
    for child in _subfolders(run_dir):
        if _checkpoints_or_none(child):
            found.append(child)
        elif depth > 1:
            found += _folders_with_checkpoints(child, depth - 1)
    return found
