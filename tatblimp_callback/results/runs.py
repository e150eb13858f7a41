"""Results files for ``tatblimp compare``: a ``score --output`` JSON, a sweep's ``tatblimp.jsonl`` or the
callback's ``tatblimp_history.jsonl`` (JSON lines with a ``step``), each read as a ``Run`` compared at
one step (a sweep's last, or the one picked with ``PATH@STEP`` / ``--step``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..reading.jsonl import split_lines
from .curves import DEFAULT_THRESHOLD, acquisition_steps, history_from_records
from .positions import axis_of, find_step, readable
from .stats import Outcomes

logger = logging.getLogger(__name__)

JSONL_NAMES = ("tatblimp.jsonl", "tatblimp_history.jsonl")  # labelled by their folder
HUB_SWEEP_SUFFIX = ".tatblimp.jsonl"  # a sweep of a Hub repository's revisions, labelled by the name before it


class CompareError(ValueError):
    """A results file cannot be read or compared."""


@dataclass
class Run:
    """One results file: a single score, or a sweep's records in step order, compared at ``step``."""

    label: str
    path: Path
    records: list[dict[str, Any]]
    is_sweep: bool
    step: int | None = None  # the sweep step compared; None: the last

    @property
    def record(self) -> dict[str, Any]:
        """The record compared: the chosen step's (the last written, if the step was scored twice), else the last."""
        if self.step is None:
            return self.records[-1]
        return [r for r in self.records if r["step"] == self.step][-1]

    def pick(self, step: int) -> None:
        """Compare this sweep at ``step``."""
        if not self.is_sweep:
            raise CompareError(f"{self.path}@{step}: a step can be picked from a sweep (JSON lines), not from a single result")
        if all(r["step"] != step for r in self.records):
            axis = axis_of(self.records)
            steps = ", ".join(readable(s, axis) for s in sorted({r["step"] for r in self.records}))
            raise CompareError(f"{self.path}: no {axis} {readable(step, axis)} ({'steps' if axis == 'step' else axis}: {steps})")
        self.step = step
        self.__dict__.pop("outcomes", None)
        self.__dict__.pop("history", None)

    @property
    def records_up_to_step(self) -> list[dict[str, Any]]:
        """The sweep's records through the compared step (all of them when it is the last)."""
        return [r for r in self.records if self.step is None or r["step"] <= self.step]

    @cached_property
    def history(self) -> list[dict[str, Any]]:
        """The curves through the compared step: what was known when those weights were scored."""
        return history_from_records(self.records_up_to_step) if self.is_sweep else []

    def acquisition(self, threshold: float = DEFAULT_THRESHOLD, use_lower_bound: bool = False) -> dict[str, int | None]:
        if not self.is_sweep:
            return {}
        try:
            return acquisition_steps(self.history, threshold, use_lower_bound=use_lower_bound)
        except ValueError as err:
            raise CompareError(f"{self.path}: {err}") from None

    @cached_property
    def outcomes(self) -> Outcomes:
        """Per-pair outcomes of the compared record (from ``outcomes``, else from ``pairs``)."""
        where = f"{self.path}" + (f" at step {self.record['step']}" if self.is_sweep else "")
        return read_outcomes(self.record, where)


def read_outcomes(record: dict[str, Any], where: str) -> Outcomes:
    """``Outcomes.from_record``, its errors named by ``where``."""
    try:
        return Outcomes.from_record(record)
    except ValueError as err:
        raise CompareError(f"{where}: {err}") from None


def load_run(path: str | os.PathLike, label: str | None = None, step: int | None = None) -> Run:
    """Read a ``score --output`` JSON file or a JSONL file of records with ``step`` (sweep, callback history)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CompareError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark (an editor's) is read past
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise CompareError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at {err.start}); expected TatBLiMP results: "
            "a score --output JSON file, or JSON lines of a sweep or a callback history"
        ) from None
    if not label and path.name.endswith(HUB_SWEEP_SUFFIX):  # a sweep of Hub revisions: org--name.tatblimp.jsonl
        label = path.name.removesuffix(HUB_SWEEP_SUFFIX)
    label = label or (path.parent.name if path.name in JSONL_NAMES and path.parent.name else path.stem)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and not (path.suffix == ".jsonl" and "step" in whole):  # not a one-line sweep
        _check_record(whole, str(path))
        run = Run(label, path, [whole], is_sweep=False)
    else:
        run = Run(label, path, _read_lines(path, text), is_sweep=True)
    if step is not None:
        run.pick(step)
    return run


def _read_lines(path: Path, text: str) -> list[dict[str, Any]]:
    """The records of a JSONL file; a last line still being written (no ``"\n"`` yet, not valid JSON) is left
    out with a warning, and the file is not touched: a sweep or a training run may be appending to it."""
    records = []
    lines = split_lines(text)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                logger.warning("tatblimp: %s:%d is a partial line (still being written?); left out", path, number)
                continue
            raise CompareError(f"{path}:{number}: neither a results JSON file nor a JSONL line ({err.msg})") from None
        _check_record(record, f"{path}:{number}")
        if "step" not in record:
            raise CompareError(f"{path}:{number}: a sweep line needs a 'step'")
        records.append(record)
    if not records:
        raise CompareError(f"{path}: holds no results")
    return sorted(without_replaced(records), key=lambda r: r["step"])  # stable: of two lines with one step, the later stays later


def without_replaced(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` (in the order they were written) as the curve holds them: a record belongs to a commit, and its
    names (``revisions``) are those that still point at that commit.

    A Hub revision's record lists, in ``replaces``, each name that pointed at another commit when it was last scored
    (``{name: old commit}``): that name leaves the earlier records of the old commit. A record keeps its place while
    any of its names is left (``main`` moved on from ``step1``'s commit: ``step1``'s line stays, without ``main``),
    and leaves the curve once none is (a re-upload: ``step2`` now names another commit, and nothing names the old
    one). A run folder's sweep lines keep the latest of each checkpoint (one saved again in place is scored again);
    the callback's history is kept as it is. The records returned with fewer names are copies.
    """
    kept: list[dict[str, Any] | None] = list(records)
    written: dict[str, list[int]] = {}  # commit -> the indices of its records written so far
    for index, record in enumerate(records):
        for name, commit in record.get("replaces", {}).items():
            for earlier in written.get(commit, ()):
                names = kept[earlier].get("revisions", ()) if kept[earlier] is not None else ()
                if name in names:
                    left = [n for n in names if n != name]
                    kept[earlier] = {**kept[earlier], "revisions": left} if left else None
        if record.get("commit"):
            written.setdefault(record["commit"], []).append(index)
    # A run folder's checkpoint scored again (saved again in place since, ``weights_files``): its latest line only
    latest = {r["checkpoint"]: k for k, r in enumerate(records) if r.get("checkpoint") and not r.get("commit")}
    return [
        record
        for k, record in enumerate(kept)
        if record is not None and (not record.get("checkpoint") or record.get("commit") or latest[record["checkpoint"]] == k)
    ]


def _check_record(record: Any, where: str) -> None:
    if isinstance(record, dict) and record.get("protocol") == "forced-choice":
        raise CompareError(
            f"{where}: a forced-choice result (score --protocol forced-choice); compare takes log-prob results "
            "(score --output without --protocol, sweep and callback history lines)"
        )
    if not isinstance(record, dict) or not {"acc", "acc_norm", "phenomena"} <= record.keys():
        raise CompareError(f"{where}: not TatBLiMP results (expected the keys acc, acc_norm, phenomena)")
    if not isinstance(record.get("benchmark", {}), dict):
        raise CompareError(f"{where}: malformed benchmark (expected {{md5, release, source, ...}})")
    phenomena = record["phenomena"]
    if not isinstance(phenomena, dict) or not all(isinstance(scores, dict) for scores in phenomena.values()):
        raise CompareError(f"{where}: malformed phenomena (expected {{phenomenon: {{n, acc, acc_norm, ...}}}})")
    fields = [("", record), *((f"phenomena.{name}.", scores) for name, scores in phenomena.items())]
    for prefix, scores in fields:  # a hand-edited file: its numbers are read as numbers
        for key in ("acc", "acc_norm", "n"):
            value = scores.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (key == "n" and value < 0):
                raise CompareError(f"{where}: {prefix}{key} is {json.dumps(value)}, not a {'count' if key == 'n' else 'number'}")


def shared_suites(runs: list[Run]) -> list[str]:
    """Names of the suites (``"suites"`` of the results) that every run has, in the first run's order."""
    names = [set(run.record.get("suites", {})) for run in runs]
    return [name for name in runs[0].record.get("suites", {}) if all(name in n for n in names)]


def suite_run(run: Run, name: str) -> Run:
    """``run``'s results of suite ``name`` as a run of their own (a sweep's lines that scored it, same label and step,
    and a revision series' axis and revision names)."""
    where = ("step", "x", "revision", "revisions")
    records = [{**r["suites"][name], **{k: r[k] for k in where if k in r}} for r in run.records if name in r.get("suites", {})]
    step = run.step if run.step is None or any(r.get("step") == run.step for r in records) else None
    return Run(run.label, run.path, records, run.is_sweep, step)


def _named_step(run: Run, text: str) -> int:
    """The step ``PATH@text`` picks: a step, a count (``4B``) or a revision's name (``positions.find_step``)."""
    step = find_step(run.records, text)
    if step is None:
        names = ", ".join(dict.fromkeys(r["revision"] for r in run.records if r.get("revision"))) or "none"
        raise CompareError(f"{run.path}@{text}: not a step, a count such as 4B, nor a revision of it (revisions: {names})")
    return step


def load_runs(specs: list[str | os.PathLike], step: int | None = None) -> list[Run]:
    """``load_run`` for each ``PATH`` or ``PATH@STEP``; ``step``: the step of every sweep given without one.

    ``STEP`` of a revision series may be a count as its names write it (``@4B``) or a revision's name
    (``@step1000-tokens4B``). A run picked by ``@STEP`` is labelled ``<label>@<STEP>``; runs with the same label are
    told apart by the shortest ending of their paths that differs (``v1000/tiny-tatar``, ``v4000/tiny-tatar``), two
    files of one folder by folder and file name (``tiny-tatar/tatblimp.jsonl``, ``tiny-tatar/tatblimp_history.jsonl``),
    the same file at the same step twice by a number (``tiny-tatar#1``, ``tiny-tatar#2``): labels always differ.
    ``Run.path`` keeps the path. A file named twice (``P@0 P``) is read once.
    """
    runs, picks, read = [], [], {}
    for spec in specs:
        path, picked = Path(spec), None
        match = re.fullmatch(r"(.+)@([^@/]+)", str(spec))
        # @1200; of a revision series also @4B or @step1000-tokens4B (then only where the file is there)
        if match and not path.exists() and (match.group(2).isdigit() or Path(match.group(1)).exists()):
            path, picked = Path(match.group(1)), match.group(2)
        key = os.path.abspath(path)
        if key not in read:
            read[key] = load_run(path)
        run = replace(read[key], path=path)  # a Run of its own: its step, label and cached outcomes
        if picked is not None:
            run.pick(_named_step(run, picked))
            run.label = f"{run.label}@{picked}"
        elif step is not None and run.is_sweep:
            run.pick(step)
        runs.append(run)
        picks.append(f"@{picked}" if picked is not None else "")
    if step is not None and not any(run.is_sweep for run in runs):
        raise CompareError("--step picks a step of a sweep (JSON lines); none of the results is one")
    labels = [run.label for run in runs]
    for label in {label for label in labels if labels.count(label) > 1}:
        same = [i for i, run in enumerate(runs) if run.label == label]
        endings = _distinct_endings({i: _label_parts(runs[i].path) for i in same}, picks, same)
        # Two files of one folder (tatblimp.jsonl, the sweep, beside tatblimp_history.jsonl): folder and file name.
        whole = {i: _label_parts(runs[i].path, whole_name=True) for i in same}
        endings = endings or _distinct_endings(whole, picks, same, shortest=2)
        # The same file at the same step twice: numbered, so that no run hides another.
        endings = endings or [f"{label}#{n}" for n in range(1, len(same) + 1)]
        for i, ending in zip(same, endings):
            runs[i].label = ending
    return runs


def _distinct_endings(parts: dict[int, list[str]], picks: list[str], same: list[int], shortest: int = 1) -> list[str] | None:
    """The shortest endings of ``parts`` (``shortest`` names or more, with their ``@STEP``) that differ, or None."""
    for length in range(shortest, max(len(p) for p in parts.values()) + 1):
        endings = ["/".join(parts[i][-length:]) + picks[i] for i in same]
        if len(set(endings)) == len(endings):
            return endings
    return None


def _label_parts(path: Path, whole_name: bool = False) -> list[str]:
    """The names a run's label is made of, outermost first: its folders, then its file name as ``load_run``
    labels it (none for ``tatblimp.jsonl``, whose folder names the run; ``whole_name``: the file's whole name)."""
    path = Path(os.path.abspath(path))
    if whole_name:
        last = [path.name]
    elif path.name in JSONL_NAMES:
        last = []
    elif path.name.endswith(HUB_SWEEP_SUFFIX):
        last = [path.name.removesuffix(HUB_SWEEP_SUFFIX)]
    else:
        last = [path.stem]
    return [*path.parent.parts[1:], *last]
