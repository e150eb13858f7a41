"""Pairs that flip: lost and learned between two results, never learned and unstable across a sweep.

Two results that carry per-pair outcomes (``Results.to_dict()["outcomes"]``: a score JSON, a sweep
line, a history line) are compared pair by pair:

- **lost**: pairs the baseline passes and the other result fails;
- **learned**: pairs the baseline fails and the other result passes.

Pairs not finite in either result are in neither list, as the paired tests leave them out. Across a
sweep (records in step order), per phenomenon: the pairs **never learned** (failed at every step
where they are finite) and the **unstable** ones (their outcome changes more than ``UNSTABLE_CHANGES``
times from one step to the next). Indices are pair indices in benchmark file order.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .scored_pairs import scored_benchmark
from .stats import OUTCOME_FAIL, OUTCOME_NOT_FINITE, OUTCOME_PASS, Outcomes

__all__ = ["UNSTABLE_CHANGES", "Flips", "SweepFlips", "flips", "pair_sentences", "sweep_flips"]

UNSTABLE_CHANGES = 2  # a pair whose outcome changes more often than this across a sweep is unstable


@dataclass(frozen=True)
class Flips:
    """Pairs that differ between a baseline and another result, for one metric."""

    lost: list[int]  # only the baseline passes
    learned: list[int]  # only the other result passes


def flips(baseline: str, run: str, indices: Iterable[int] | None = None) -> Flips:
    """Lost and learned pairs of two outcome strings (``Outcomes.acc_norm`` or ``.acc``), over ``indices`` (default: all).

    Raises:
        ValueError: the strings are of different lengths.
    """
    if len(baseline) != len(run):
        raise ValueError(f"outcome strings of different lengths ({len(baseline)} and {len(run)} pairs)")
    lost, learned = [], []
    for i in range(len(baseline)) if indices is None else indices:
        if baseline[i] == OUTCOME_PASS and run[i] == OUTCOME_FAIL:
            lost.append(i)
        elif baseline[i] == OUTCOME_FAIL and run[i] == OUTCOME_PASS:
            learned.append(i)
    return Flips(lost, learned)


@dataclass(frozen=True)
class SweepFlips:
    """One phenomenon across a sweep: pairs never learned, and pairs whose outcome keeps changing."""

    never_learned: list[int]
    unstable: list[int]
    changes: dict[int, int]  # pair index -> outcome changes between consecutive steps (unstable pairs only)


def sweep_flips(outcomes: Sequence[Outcomes], metric: str = "acc_norm") -> dict[str, SweepFlips]:
    """Per phenomenon (file order), the never-learned and unstable pairs of results in step order.

    A step where a pair is not finite is skipped for that pair; a pair never finite is in neither list.

    Raises:
        ValueError: no results, or results holding different pairs.
    """
    if not outcomes:
        raise ValueError("no results to follow pairs across")
    if any(o.phenomena != outcomes[0].phenomena for o in outcomes):
        raise ValueError("the results hold different pairs (their phenomena differ pair by pair)")
    strings = [getattr(o, metric) for o in outcomes]
    changes = outcome_changes(outcomes, metric)
    by_phenomenon: dict[str, SweepFlips] = {}
    for name, indices in outcomes[0].groups().items():
        never = [i for i in indices if {s[i] for s in strings} - {OUTCOME_NOT_FINITE} == {OUTCOME_FAIL}]
        unstable = [i for i in indices if changes[i] > UNSTABLE_CHANGES]
        by_phenomenon[name] = SweepFlips(never, unstable, {i: changes[i] for i in unstable})
    return by_phenomenon


def pair_sentences(record: Mapping[str, Any], data: str | os.PathLike | None = None) -> list[tuple[str, str]] | None:
    """Each pair's (good, bad) sentences for a results record, or None when they cannot be found.

    From the record's per-pair rows where they hold the sentences; else from the pairs it was scored on,
    read again from ``data`` (default: the record's ``benchmark.source``; see ``scored_pairs``): the same
    fingerprint, so a selection, a suite's column mapping or a suite folder give their own pairs, never
    other pairs at the same indices.
    """
    pairs = record.get("pairs") or []
    if pairs and all(p.get("good") and p.get("bad") for p in pairs):
        return [(p["good"], p["bad"]) for p in pairs]
    benchmark = scored_benchmark(record, data)
    return None if benchmark is None else [(p.good, p.bad) for p in benchmark.pairs]


def pair_number(i: int, numbers: Sequence[int] | None) -> str:
    """How a pair is named, ``#N``: its index among the benchmark file's pairs (``scored_pairs.file_indices``), as
    ``explain --pair`` takes it; where that is not known (a selection whose file is not found), its position among
    the pairs scored, marked ``#@N``."""
    return f"#{numbers[i]}" if numbers is not None else f"#@{i}"


NUMBERS_UNKNOWN = "(#@N: the pair's place among those scored, a selection of the file's; pass --data for the file's #N)"


def format_flips(
    flipped: Flips,
    phenomena: Sequence[str],
    sentences: Sequence[tuple[str, str]] | None,
    baseline: str,
    run: str,
    metric: str,
    numbers: Sequence[int] | None,
) -> list[str]:
    """Text lines: the counts, then each lost and learned pair with its number (``pair_number``), phenomenon and
    sentences."""
    lines = [f"flips, {metric}: {run} against {baseline}: {len(flipped.lost)} lost, {len(flipped.learned)} learned"]
    for title, indices in ((f"lost (only {baseline} passes)", flipped.lost), (f"learned (only {run} passes)", flipped.learned)):
        lines.append(f"  {title}: {len(indices)}")
        for i in indices:
            text = f"    {pair_number(i, numbers)}  {phenomena[i]}"
            if sentences is not None:
                text += f"\n      good: {sentences[i][0]}\n      bad:  {sentences[i][1]}"
            lines.append(text)
    if sentences is None and (flipped.lost or flipped.learned):
        lines.append("  (sentences: the benchmark file was not found; pass --data)")
    if numbers is None and (flipped.lost or flipped.learned):
        lines.append(f"  {NUMBERS_UNKNOWN}")
    return lines


def format_sweep_flips(
    label: str, by_phenomenon: Mapping[str, SweepFlips], metric: str, numbers: Sequence[int] | None
) -> list[str]:
    """Text lines: per phenomenon, the never-learned and unstable pairs of one sweep (``pair_number``)."""
    lines = [f"across {label} ({metric}): never learned (failed at every step), unstable (> {UNSTABLE_CHANGES} changes)"]
    for name, found in by_phenomenon.items():
        never = ", ".join(pair_number(i, numbers) for i in found.never_learned) or "-"
        unstable = ", ".join(f"{pair_number(i, numbers)} ({found.changes[i]}x)" for i in found.unstable) or "-"
        lines.append(f"  {name}: never learned {len(found.never_learned)}: {never}")
        lines.append(f"  {' ' * len(name)}  unstable {len(found.unstable)}: {unstable}")
    if numbers is None:
        lines.append(f"  {NUMBERS_UNKNOWN}")
    return lines


def outcome_changes(outcomes: Sequence[Outcomes], metric: str = "acc_norm") -> list[int]:
    """Per pair, how many times its outcome changes between consecutive results (non-finite steps skipped)."""
    strings = [getattr(o, metric) for o in outcomes]
    counts = []
    for i in range(len(strings[0]) if strings else 0):
        seen = [s[i] for s in strings if s[i] != OUTCOME_NOT_FINITE]
        counts.append(sum(a != b for a, b in itertools.pairwise(seen)))
    return counts
