"""The report's sections on tokenizer ablations: how each run's tokenizer cuts the edit, and the outcomes split by it.

- **How each tokenizer cuts the edit**: ``tatblimp tokenizers``' table, for every run whose results name a
  tokenizer that can be read here (a folder or a ``.model`` file that exists; one built in memory cannot),
  on the pairs the run was scored on.
- **Outcomes by how the tokenizer cut the edit**: each run's acc and acc_norm over aligned and unaligned
  pairs and over pairs whose bad sentence has more tokens or not, with 95% Wilson intervals, the difference
  and Fisher's exact p (``results/edit_outcomes.py``); for a sweep, the acquisition step of both groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ..commands.tokenizers import COLUMNS, load_light_tokenizer, tokenizer_figures
from ..results.curves import DEFAULT_THRESHOLD
from ..results.edit_outcomes import runs_by_edit, split_rows
from ..results.runs import Run
from ..results.scored_pairs import scored_benchmark

logger = logging.getLogger(__name__)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><tr>{head}</tr>{body}</table></div>'


def run_tokenizer_figures(runs: Sequence[Run], data: str | os.PathLike | None = None) -> dict[str, dict[str, Any]]:
    """Tokenizer name -> its ``tokenizer_figures`` on the scored pairs, for the runs' tokenizers that can be read."""
    figures: dict[str, dict[str, Any]] = {}
    for run in runs:
        name = run.record.get("tokenizer")
        if not name or name in figures or not Path(name).exists():
            continue
        benchmark = scored_benchmark(run.record, data)
        if benchmark is None:
            continue
        try:
            figures[name] = tokenizer_figures(load_light_tokenizer(name), list(benchmark.pairs))
        except Exception as err:  # the section is left out, the report is still written
            logger.warning("tatblimp report: %s: no tokenizer figures (%s)", name, err)
    return figures


def _figure_rows(figures: Mapping[str, Any]) -> list[list[str]]:
    rows = [*figures["phenomena"].items(), ("overall", figures)]
    return [[name, str(row["n"]), *(f.format(row[k]) for _, k, f in COLUMNS)] for name, row in rows]


def tokenization_sections(
    runs: Sequence[Run], data: str | os.PathLike | None = None, threshold: float = DEFAULT_THRESHOLD
) -> list[str]:
    """The two sections' HTML (nothing for runs without tokenizer facts); acquired at ``threshold``."""
    body = []
    figures = run_tokenizer_figures(runs, data)
    if figures:
        body.append("<h2>How each tokenizer cuts the edit</h2>")
        body.append(
            '<div class="meta">Per phenomenon: tokens per byte, mean tokens inside the edit (good, bad), pairs whose edit '
            "starts and ends on token boundaries in both sentences, whose critical region is one token, the mean token "
            "count of bad minus good and the share where bad is longer, pairs with identical ids, pairs with unknown or "
            "byte-fallback tokens at the edit (tatblimp tokenizers).</div>"
        )
        for name, one in figures.items():
            body.append(f"<h3>{escape(name)} ({one['vocabulary']:,} tokens)</h3>")
            body.append(_table(["phenomenon", "n", *(h for h, _, _ in COLUMNS)], _figure_rows(one), "tokenizer-figures"))
    try:
        by_edit = runs_by_edit(runs, threshold)
    except ValueError as err:  # a record whose edit marks do not match its outcomes: said, and the report written
        return [*body, f'<p class="meta">Outcomes not split by the edit: {escape(str(err))}</p>']
    if by_edit:
        body.append("<h2>Outcomes by how the tokenizer cut the edit</h2>")
        body.append(
            '<div class="meta">Accuracy [95% Wilson interval] (pairs) of each group, the difference and Fisher\'s exact '
            "two-sided p; a phenomenon is tested where both groups have at least 5 pairs.</div>"
        )
        for label, data_of_run in by_edit.items():
            for split, split_data in data_of_run["splits"].items():
                inside, outside = split_data["groups"]
                rows = split_rows(split_data)
                body.append(f"<h3>{escape(label)}: by {escape(split)}</h3>")
                body.append(_table(["group", "metric", inside, outside, "difference", "p (Fisher)"], rows, f"by-{split}"))
            acquisition = data_of_run["acquisition"]
            if acquisition is not None:
                steps = [
                    f"{name} pairs: {'not acquired' if acquisition[f'{name}_step'] is None else acquisition[f'{name}_step']}"
                    for name in ("aligned", "unaligned")
                ]
                body.append(
                    f'<p class="meta">{escape(label)}: acc_norm acquisition step (&gt;= {acquisition["threshold"]} '
                    f"to the end): {escape('; '.join(steps))}</p>"
                )
    return body
