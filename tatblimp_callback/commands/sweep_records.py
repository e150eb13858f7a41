"""What a sweep's results file holds: its records read (a broken line named by file and line), appended
(on the disk before the next checkpoint), and refused when they were scored on other pairs than this
sweep's (``check_same_files``, by the fingerprints of ``reading/identity.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..reading.jsonl import read_complete_lines
from ..results.records_file import append_record
from .checkpoints import SweepError


def read_records(path: Path) -> list[dict[str, Any]]:
    """The lines of a sweep results file (empty if it does not exist)."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(read_complete_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SweepError(f"{path}:{number}: not a JSON line ({err.msg}); fix or remove the line") from None
        if not isinstance(record, dict) or "checkpoint" not in record or "step" not in record:
            raise SweepError(f"{path}:{number}: not a sweep record (needs 'checkpoint' and 'step')")
        records.append(record)
    return records


def append_sweep_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to a sweep's results or failures file, on the disk before the next checkpoint starts."""
    append_record(path, record, sync=True)


def check_same_files(records: list[dict[str, Any]], benchmark: Any, suites: dict[str, Any], path: Path) -> None:
    """Refuse to append records scored on other pairs than ``benchmark``'s and ``suites``' to ``path``'s records.

    A results file holds one benchmark and one set of suites, each known by its fingerprint
    (``identity.fingerprint``: the bytes, the column mapping and the selection): a suite of the same name
    read from edited files, or the same files read with another ``--columns``, would otherwise mix two
    suites in one curve. Records written before fingerprints are compared by md5.

    Raises:
        SweepError: a record of ``path`` was scored on other TatBLiMP pairs, or on other suites (by name or fingerprint).
    """
    asked = {name: _identity(suite) for name, suite in suites.items()}
    ours = _identity(benchmark)
    for record in records:
        theirs = {name: _identity(suite.get("benchmark", {})) for name, suite in record.get("suites", {}).items()}
        if not _same(_identity(record.get("benchmark", {})), ours):
            raise SweepError(
                f"{path}: {record['checkpoint']} was scored on {_describe(_identity(record['benchmark']))}, "
                f"this sweep reads {benchmark.source} ({_describe(ours)}); one results file holds one benchmark: "
                "pass the same --data, or move the file away to start anew"
            )
        if theirs.keys() != asked.keys() or not all(_same(theirs[name], asked[name]) for name in asked):
            had = ", ".join(f"{name} ({_describe(identity)})" for name, identity in sorted(theirs.items())) or "no suites"
            wanted = ", ".join(f"{name} ({_describe(identity)})" for name, identity in sorted(asked.items())) or "no suites"
            raise SweepError(
                f"{path}: {record['checkpoint']} was scored with {had}, this sweep asks for {wanted}; "
                "one results file holds one set of suites: pass the same --suite and --columns options and files, "
                "or move the file away to start anew"
            )


def _identity(what: Any) -> tuple[str | None, str | None]:
    """(md5, fingerprint) of a ``Benchmark`` or of a record's ``benchmark`` dict (fingerprint None in older records)."""
    if isinstance(what, dict):
        return what.get("md5"), what.get("fingerprint")
    return what.md5, what.fingerprint


def _same(theirs: tuple[str | None, str | None], ours: tuple[str | None, str | None]) -> bool:
    return theirs == ours if theirs[1] is not None else theirs[0] in (None, ours[0])


def _describe(identity: tuple[str | None, str | None]) -> str:
    md5, fingerprint = identity
    return f"md5 {md5}, fingerprint {fingerprint}" if fingerprint else f"md5 {md5}"


def other_settings(records: list[dict[str, Any]], record: dict[str, Any], path: Path) -> str | None:
    """Why ``record`` does not belong on ``path``'s curve, or None: the scoring precision its lines' log-probs were
    computed in (one results file holds one curve; a change of precision would read as the model's). The prefix
    token is recorded (``prefix_token_id``) but may differ: a revision uploaded with other tokenizer files has its own."""
    had = {line["precision"] for line in records if line.get("precision") is not None}
    if had and record.get("precision") not in had:
        return (
            f"{path}: {record['checkpoint']} was scored in {record.get('precision')}, its lines in "
            f"{', '.join(sorted(had))}; one results file holds one curve: pass the same --dtype and --precision, or "
            "sweep into another file"
        )
    return None
