"""How sure a TatBLiMP accuracy, or a difference between two, is: intervals and paired tests.

- ``wilson_interval``: the 95% Wilson score interval of a share of passed pairs.
- ``mcnemar_p``: the exact two-sided McNemar p-value of two models on the same pairs, from the pairs
  only one of them passes (a binomial test of those two counts at 0.5).
- ``bh_adjust``: Benjamini-Hochberg adjusted p-values, for the 16 phenomena tested at once.

All three are ``scipy.stats`` (``binomtest``, its ``proportion_ci(method="wilson")``,
``false_discovery_control``). Per-pair outcomes travel as strings, one character per pair in
benchmark file order (``OUTCOME_PASS``, ``OUTCOME_FAIL``, ``OUTCOME_NOT_FINITE``), so that any two
results can be compared pair by pair.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

CONFIDENCE = 0.95
ALPHA = 0.05
OUTCOME_PASS, OUTCOME_FAIL, OUTCOME_NOT_FINITE = "1", "0", "-"


@lru_cache(maxsize=4096)  # a result has ~100 intervals, about 1 ms each, and successive evaluations repeat most
def wilson_interval(passed: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of ``passed`` / ``n``; (nan, nan) when ``n`` is 0."""
    from scipy.stats import binomtest

    if n == 0:
        return (math.nan, math.nan)
    interval = binomtest(int(passed), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(interval.low), float(interval.high))


def mcnemar_p(baseline_only: int, run_only: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts; 1.0 when there are none."""
    from scipy.stats import binomtest

    discordant = baseline_only + run_only
    if discordant == 0:
        return 1.0
    return float(binomtest(min(baseline_only, run_only), discordant, 0.5).pvalue)


def bh_adjust(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, in the order given."""
    from scipy.stats import false_discovery_control

    if not len(p_values):
        return []
    return [float(p) for p in false_discovery_control(list(p_values), method="bh")]


# -- per-pair outcomes ----------------------------------------------------------------------------


def encode_outcomes(passed: Iterable[bool | None]) -> str:
    """One character per pair: True passed, False failed (a tie fails), None not finite (left out)."""
    return "".join(OUTCOME_NOT_FINITE if p is None else OUTCOME_PASS if p else OUTCOME_FAIL for p in passed)


def run_lengths(names: Iterable[str]) -> list[list]:
    """``[[name, count], ...]``: consecutive equal names merged (the phenomenon of each pair, compactly)."""
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return runs


def expand_run_lengths(runs: Iterable[Sequence]) -> list[str]:
    """The inverse of ``run_lengths``."""
    return [name for name, count in runs for _ in range(int(count))]


@dataclass(frozen=True)
class PairedCounts:
    """Two results on the same pairs: pairs finite in both, and those that only one of them passes."""

    n: int
    baseline_only: int
    run_only: int

    @property
    def p_value(self) -> float:
        return mcnemar_p(self.baseline_only, self.run_only)


def paired_counts(baseline: str, run: str, indices: Iterable[int] | None = None) -> PairedCounts:
    """Discordant counts of two outcome strings, over ``indices`` (default: every pair).

    A pair not finite in either result is left out, as the metrics leave it out.
    """
    if len(baseline) != len(run):
        raise ValueError(f"outcome strings of different lengths ({len(baseline)} and {len(run)} pairs)")
    n = baseline_only = run_only = 0
    for i in range(len(baseline)) if indices is None else indices:
        a, b = baseline[i], run[i]
        if a == OUTCOME_NOT_FINITE or b == OUTCOME_NOT_FINITE:
            continue
        n += 1
        baseline_only += a == OUTCOME_PASS and b == OUTCOME_FAIL
        run_only += a == OUTCOME_FAIL and b == OUTCOME_PASS
    return PairedCounts(n, baseline_only, run_only)


def outcome_share(outcomes: str) -> tuple[int, int]:
    """(passed, finite) of an outcome string."""
    return outcomes.count(OUTCOME_PASS), len(outcomes) - outcomes.count(OUTCOME_NOT_FINITE)


METRICS = ("acc_norm", "acc")


@dataclass(frozen=True)
class Outcomes:
    """Per-pair outcomes of one result: both metrics' outcome strings and each pair's phenomenon."""

    acc: str
    acc_norm: str
    phenomena: tuple[str, ...]

    @classmethod
    def from_dict(cls, outcomes: Mapping[str, Any]) -> Outcomes:
        """From ``Results.to_dict()["outcomes"]``; ValueError if it is malformed."""
        try:
            acc, acc_norm, runs = outcomes["acc"], outcomes["acc_norm"], outcomes["phenomenon_runs"]
            phenomena = tuple(expand_run_lengths(runs))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed outcomes ({type(err).__name__}: {err})") from None
        for name, text in (("acc", acc), ("acc_norm", acc_norm)):
            if not isinstance(text, str) or set(text) - {OUTCOME_PASS, OUTCOME_FAIL, OUTCOME_NOT_FINITE}:
                raise ValueError(f"outcomes.{name} must be a string of '1', '0' and '-'")
            if len(text) != len(phenomena):
                raise ValueError(f"outcomes.{name} has {len(text)} pairs but phenomenon_runs {len(phenomena)}")
        return cls(acc, acc_norm, phenomena)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Outcomes:
        """From a results record (``Results.to_dict()``): its ``outcomes``, else its per-pair list ``pairs``
        (results written before outcomes were recorded). Checked against the record's acc and acc_norm;
        ValueError if it has neither or they disagree."""
        if "outcomes" in record:
            outcomes = cls.from_dict(record["outcomes"])
        elif record.get("pairs"):
            pairs = record["pairs"]
            # a non-finite log-prob is null (or NaN, as older versions wrote it)
            finite = [
                all(isinstance(p[k], (int, float)) and math.isfinite(p[k]) for k in ("good_logprob", "bad_logprob"))
                for p in pairs
            ]
            outcomes = cls(
                acc=encode_outcomes(p["good_logprob"] > p["bad_logprob"] if f else None for p, f in zip(pairs, finite)),
                acc_norm=encode_outcomes(
                    p["good_logprob"] / p["good_bytes"] > p["bad_logprob"] / p["bad_bytes"] if f else None
                    for p, f in zip(pairs, finite)
                ),
                phenomena=tuple(p["phenomenon"] for p in pairs),
            )
        else:
            raise ValueError(
                "no per-pair outcomes (written by an older tatblimp-callback); score it again to compare it "
                "pair by pair, or pass --no-paired to show it side by side only"
            )
        for metric in METRICS:
            passed, finite_pairs = outcome_share(getattr(outcomes, metric))
            share = passed / finite_pairs if finite_pairs else math.nan
            stated = record[metric]
            if not (math.isnan(share) and math.isnan(stated)) and not math.isclose(share, stated, abs_tol=1e-9):
                raise ValueError(f"its outcomes give {metric} {share:.6f} but it says {stated:.6f}")
        return outcomes

    def groups(self) -> dict[str, list[int]]:
        """Pair indices of each phenomenon, in first-seen order."""
        groups: dict[str, list[int]] = {}
        for index, name in enumerate(self.phenomena):
            groups.setdefault(name, []).append(index)
        return groups


@dataclass(frozen=True)
class PairedTest:
    """One paired comparison: a metric over a group of pairs (``overall`` or a phenomenon)."""

    metric: str
    group: str
    n: int  # pairs finite in both results
    baseline_only: int  # pairs only the baseline passes
    run_only: int  # pairs only the other run passes
    p_value: float  # exact two-sided McNemar
    p_adjusted: float  # Benjamini-Hochberg over the phenomena of this metric; overall: p_value (one test)

    @property
    def difference(self) -> float:
        """run's accuracy minus the baseline's on these n pairs."""
        return (self.run_only - self.baseline_only) / self.n if self.n else math.nan

    @property
    def significant(self) -> bool:
        return self.p_adjusted < ALPHA


def paired_tests(baseline: Outcomes, run: Outcomes) -> list[PairedTest]:
    """For acc_norm then acc: overall, then each phenomenon (BH-adjusted over the phenomena)."""
    if baseline.phenomena != run.phenomena:
        raise ValueError("the two results hold different pairs (their phenomena differ pair by pair)")
    tests = []
    for metric in METRICS:
        a, b = getattr(baseline, metric), getattr(run, metric)
        overall = paired_counts(a, b)
        tests.append(
            PairedTest(metric, "overall", overall.n, overall.baseline_only, overall.run_only, overall.p_value, overall.p_value)
        )
        groups = {name: paired_counts(a, b, indices) for name, indices in baseline.groups().items()}
        adjusted = bh_adjust([counts.p_value for counts in groups.values()])
        for (name, counts), p_adjusted in zip(groups.items(), adjusted):
            tests.append(PairedTest(metric, name, counts.n, counts.baseline_only, counts.run_only, counts.p_value, p_adjusted))
    return tests


def format_interval(interval: Sequence[float] | None, digits: int = 3) -> str:
    """``[low, high]`` with ``digits`` decimals; "-" for no interval."""
    if interval is None or any(v is None or math.isnan(v) for v in interval):
        return "-"
    low, high = interval
    return f"[{low:.{digits}f}, {high:.{digits}f}]"
