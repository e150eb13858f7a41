"""Forced-choice results: per item, per phenomenon and overall, for local models and endpoints alike.

Item ``2*i`` shows pair ``i`` as A = good, B = bad (the right answer is A), item ``2*i + 1`` as
A = bad, B = good (the right answer is B). Metrics: ``accuracy`` over items, ``both_orders`` over
pairs (right in both orderings), and ``a_share``, the share of A among the A/B answers (0.5 for a
model without position bias).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..reading.data import Benchmark
from ..results.group_metrics import grouped, overall_metric

LETTERS = ("A", "B")
ORDERS = ("good_first", "bad_first")  # item 2*i + o uses ORDERS[o]; the right answer is LETTERS[o]


@dataclass
class ChoiceGroup:
    """Forced-choice metrics of one group of pairs (a phenomenon, or all)."""

    items: int
    pairs: int
    accuracy: float  # right answers / items
    both_orders: float  # pairs answered right in both orderings / pairs
    a_share: float  # A answers / (A + B answers); NaN when there is none
    answers_a: int
    answers_b: int
    ties: int = 0  # local: logP(A) == logP(B); counted wrong
    non_finite: int = 0  # local: a NaN/inf log-prob; counted wrong
    unparsed: int = 0  # endpoint: a reply that is not exactly A or B; counted wrong


@dataclass
class ChoiceItem:
    """One item: the pair, the ordering, the right letter and the model's answer (None: no answer)."""

    pair: int
    order: str  # "good_first" (right answer A) or "bad_first" (right answer B)
    expected: str
    answer: str | None
    note: str | None = None  # why there is no answer: "tie", "non_finite" or "unparsed"
    logprob_a: float | None = None  # local models
    logprob_b: float | None = None
    text: str | None = None  # endpoint: the raw reply

    @classmethod
    def of_item(cls, item: int, answer: str | None, note: str | None = None, **details) -> ChoiceItem:
        """Item ``item`` (pair ``item // 2``, ordering ``item % 2``) answered ``answer``."""
        return cls(item // 2, ORDERS[item % 2], LETTERS[item % 2], answer, note, **details)

    @property
    def correct(self) -> bool:
        return self.answer == self.expected


@dataclass
class ForcedChoiceResults:
    """One forced-choice evaluation: overall, per phenomenon, and per item (item order)."""

    overall: ChoiceGroup
    phenomena: dict[str, ChoiceGroup]
    items: list[ChoiceItem]
    benchmark_md5: str
    benchmark_release: str
    benchmark_source: str
    model: str
    prompt: str
    system_prompt: str | None = None
    run_info: dict[str, Any] = field(default_factory=dict)  # how it was computed: method, seconds, endpoint counters, ...

    accuracy = overall_metric("accuracy")
    both_orders = overall_metric("both_orders")
    a_share = overall_metric("a_share")

    def to_dict(self) -> dict[str, Any]:
        """The JSON written by ``tatblimp score --protocol forced-choice --output``."""
        return {
            "protocol": "forced-choice",
            **{k: v for k, v in asdict(self.overall).items()},
            "benchmark": {"release": self.benchmark_release, "md5": self.benchmark_md5, "source": self.benchmark_source},
            "model": self.model,
            "prompt": self.prompt,
            "system_prompt": self.system_prompt,
            "phenomena": {name: asdict(group) for name, group in self.phenomena.items()},
            "per_item": [asdict(item) for item in self.items],
            **self.run_info,
        }

    def flat_metrics(self, prefix: str = "tatblimp_fc") -> dict[str, float]:
        """Scalars for a logger: ``{prefix}/accuracy``, ``{prefix}/both_orders``, ``{prefix}/a_share``, per phenomenon."""
        o = self.overall
        metrics = {f"{prefix}/accuracy": o.accuracy, f"{prefix}/both_orders": o.both_orders, f"{prefix}/a_share": o.a_share}
        for name, group in self.phenomena.items():
            metrics[f"{prefix}/{name}/accuracy"] = group.accuracy
            metrics[f"{prefix}/{name}/both_orders"] = group.both_orders
        for counter in ("ties", "non_finite", "unparsed"):
            if getattr(o, counter):
                metrics[f"{prefix}/{counter}"] = float(getattr(o, counter))
        return metrics

    def format_table(self) -> str:
        """A plain-text table like the benchmark card's forced-choice table, per phenomenon."""
        width = max(len(name) for name in [*self.phenomena, "overall"])
        rule = "-" * (width + 42)
        dtype = f"  dtype: {self.run_info['dtype']}" if self.run_info.get("dtype") else ""
        lines = [f"{self.benchmark_release}  forced choice, both orderings{dtype}  model: {self.model}"]
        lines.append(f"{'phenomenon':<{width}}  {'pairs':>5}  {'accuracy':>8}  {'both-orders':>11}  {'A share':>7}")
        lines.append(rule)
        rows = [*self.phenomena.items(), ("overall", self.overall)]
        for name, g in rows:
            if name == "overall":
                lines.append(rule)
            lines.append(f"{name:<{width}}  {g.pairs:>5}  {g.accuracy:>8.4f}  {g.both_orders:>11.4f}  {g.a_share:>7.4f}")
        o = self.overall
        lines.append(f"{o.items} items ({o.pairs} pairs x 2 orderings); A share 0.5 = no position bias")
        for counter, what in (
            ("ties", "log-prob ties"),
            ("non_finite", "non-finite log-probs"),
            ("unparsed", "replies that are not A or B"),
        ):
            if getattr(o, counter):
                lines.append(f"{getattr(o, counter)} items with {what}, counted as wrong")
        return "\n".join(lines)


def compute_choice_results(
    benchmark: Benchmark,
    items: Sequence[ChoiceItem],
    *,
    model: str,
    prompt: str,
    system_prompt: str | None = None,
    run_info: dict[str, Any] | None = None,
) -> ForcedChoiceResults:
    """Metrics from the ``2 * len(benchmark)`` items, in item order."""
    names = benchmark.phenomena
    group_index = np.array([names.index(p.phenomenon) for p in benchmark.pairs])
    identity = (benchmark.md5, benchmark.release, benchmark.source)
    return choice_results(
        items, group_index, names, identity, model=model, prompt=prompt, system_prompt=system_prompt, run_info=run_info
    )


def choice_results(
    items: Sequence[ChoiceItem],
    group_index: np.ndarray,
    names: Sequence[str],
    identity: tuple[str, str, str],
    *,
    model: str,
    prompt: str,
    system_prompt: str | None = None,
    run_info: dict[str, Any] | None = None,
) -> ForcedChoiceResults:
    """Metrics from items in item order; ``group_index[i]``: pair ``i``'s phenomenon in ``names``;
    ``identity``: the benchmark's (md5, release, source)."""
    if len(items) != 2 * len(group_index):
        raise ValueError(f"expected {2 * len(group_index)} items (2 per pair), got {len(items)}")
    correct = np.array([item.correct for item in items], dtype=bool).reshape(-1, 2)
    answers = np.array([item.answer or "" for item in items]).reshape(-1, 2)
    notes = np.array([item.note or "" for item in items]).reshape(-1, 2)

    def group(mask: np.ndarray) -> ChoiceGroup:
        a, b = int((answers[mask] == "A").sum()), int((answers[mask] == "B").sum())
        pairs = int(mask.sum())
        return ChoiceGroup(
            items=2 * pairs,
            pairs=pairs,
            accuracy=float(correct[mask].mean()) if pairs else math.nan,
            both_orders=float(correct[mask].all(axis=1).mean()) if pairs else math.nan,
            a_share=a / (a + b) if a + b else math.nan,
            answers_a=a,
            answers_b=b,
            ties=int((notes[mask] == "tie").sum()),
            non_finite=int((notes[mask] == "non_finite").sum()),
            unparsed=int((notes[mask] == "unparsed").sum()),
        )

    overall, phenomena = grouped(group, np.asarray(group_index), names)
    md5, release, source = identity
    return ForcedChoiceResults(
        overall=overall,
        phenomena=phenomena,
        items=list(items),
        benchmark_md5=md5,
        benchmark_release=release,
        benchmark_source=source,
        model=model,
        prompt=prompt,
        system_prompt=system_prompt,
        run_info=dict(run_info or {}),
    )


def items_from_logprobs(logprobs: torch.Tensor | np.ndarray) -> list[ChoiceItem]:
    """Items decided by log-probs ``[items, 2]`` (columns: A, B): the higher letter, else a tie."""
    values = np.asarray(logprobs.cpu() if hasattr(logprobs, "cpu") else logprobs, dtype=np.float64)
    items = []
    for k, (a, b) in enumerate(values):
        if not (math.isfinite(a) and math.isfinite(b)):
            answer, note = None, "non_finite"
        elif a == b:
            answer, note = None, "tie"
        else:
            answer, note = ("A" if a > b else "B"), None
        items.append(ChoiceItem.of_item(k, answer, note, logprob_a=float(a), logprob_b=float(b)))
    return items
