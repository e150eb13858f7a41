"""The pairs a results record was scored on, found again from its files: for the sentences of flipped pairs
(``compare --flips``, the report) and for scoring those pairs again (``report --model``).

A record names its benchmark's source, md5 and fingerprint (``identity.fingerprint``: the bytes, the column
mapping and the selection). The source (or the file or folder the user names) is read the way the record
was: a suite with its column mapping, TatBLiMP as a benchmark; a record of a selection (``--limit``,
``--phenomena``, ``Benchmark.select``) gets the same selection, found from its per-phenomenon pair counts.
What is read counts only if its fingerprint is the record's: pairs that merely come from the same bytes
are never taken for the scored ones. A record without a fingerprint (written by an older version) counts
when its md5 matches and it holds all of the file's pairs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..reading.data import Benchmark, BenchmarkError, load_benchmark
from ..reading.identity import record_fingerprint
from ..reading.suites import load_suite

__all__ = ["file_indices", "scored_benchmark"]


def scored_benchmark(record: Mapping[str, Any], data: str | os.PathLike | None = None) -> Benchmark | None:
    """The pairs ``record`` was scored on, read from ``data`` (default: the record's ``benchmark.source``);
    None when they cannot be found there (another file, another mapping, a subset built by hand)."""
    identity = record.get("benchmark") or {}
    source = data or identity.get("source")
    if not source or not os.path.exists(source):
        return None
    for candidate in _readings(source, identity.get("columns"), suite="left_out" in record or "columns" in identity):
        for benchmark in (candidate, _same_selection(candidate, record)):
            if benchmark is not None and _is_the_scored(benchmark, record):
                return benchmark
    return None


def file_indices(record: Mapping[str, Any], data: str | os.PathLike | None = None) -> Sequence[int] | None:
    """Each scored pair's index among its benchmark file's pairs (what ``explain --pair`` takes), by position: the
    position itself where ``record`` scored the whole file; for a selection (``--limit``, ``--phenomena``), read from
    the file (``scored_benchmark``); None where that file is not found."""
    if not record.get("selection"):
        outcomes = (record.get("outcomes") or {}).get("acc_norm")
        return range(len(outcomes) if outcomes is not None else len(record.get("pairs") or ()))
    benchmark = scored_benchmark(record, data)
    return None if benchmark is None else benchmark.file_indices


def _readings(source: str | os.PathLike, columns: dict[str, str] | None, suite: bool):
    """The ways ``source`` may have been read, the record's first: a suite (a folder, a column mapping,
    a suite's record), else a TatBLiMP file; each read lazily, and skipped when it cannot be read."""
    readers = [lambda: load_suite("suite", source, columns)]
    if os.path.isfile(source) and columns is None:
        as_benchmark = lambda: _benchmark_file(os.fspath(source), os.stat(source).st_mtime_ns)  # noqa: E731
        readers = [*readers, as_benchmark] if suite else [as_benchmark, *readers]
    for read in readers:
        try:
            yield read()
        except (BenchmarkError, ValueError, OSError):
            continue


def _same_selection(benchmark: Benchmark, record: Mapping[str, Any]) -> Benchmark | None:
    """``benchmark.select(limit, phenomena)`` with the limit and phenomena the record's pair counts imply; None: all pairs."""
    if not record.get("selection"):
        return None
    counts: dict[str, int] = {}
    for name, count in (record.get("outcomes") or {}).get("phenomenon_runs") or []:
        counts[name] = counts.get(name, 0) + int(count)
    if not counts:
        return None
    full = {name: sum(p.phenomenon == name for p in benchmark.pairs) for name in benchmark.phenomena}
    phenomena = list(counts) if set(counts) != set(full) else None
    limit = max(counts.values()) if any(counts[n] < full.get(n, 0) for n in counts) else None
    try:
        return benchmark.select(limit=limit, phenomena=phenomena)
    except BenchmarkError:  # a phenomenon the file does not have: not this file
        return None


def _is_the_scored(benchmark: Benchmark, record: Mapping[str, Any]) -> bool:
    fingerprint = record_fingerprint(dict(record))
    if fingerprint is not None:
        return benchmark.fingerprint == fingerprint
    return benchmark.md5 == (record.get("benchmark") or {}).get("md5") and not record.get("selection") and not benchmark.selection


@functools.lru_cache(maxsize=4)
def _benchmark_file(path: str, mtime_ns: int) -> Benchmark:
    """The benchmark file at ``path`` as it was at ``mtime_ns``, read once: a command finds the pairs of each run,
    their sentences and their numbers (``pair_sentences``, ``file_indices``) in the same file."""
    return load_benchmark(path, allow_modified=True)
