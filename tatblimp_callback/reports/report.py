"""``tatblimp report RESULTS... --output report.html``: one self-contained HTML page to look at and share.

From sweep files, history files (``tatblimp_history.jsonl``) or ``score --output`` JSONs: the overall
acc and acc_norm curves with 95% bands, a phenomenon x step heatmap of acc_norm (acquisition steps
outlined), the acquisition steps, the paired tests with the lost and learned pairs (and their
sentences) between the first and last evaluations of each run (or ``--steps A B``), the pairs failed
at every step and the unstable ones; with ``--model``, each of those pairs token by token with its
surprisal at the edit. Several runs are shown side by side and tested pair by pair against the
baseline (the first). Charts are inline SVG drawn here; the page loads nothing from anywhere. A revision
series placed by tokens or words (``sweep --x tokens``) is shown on that axis, with its revisions' names.
The command itself (its options, ``--model``) is ``report_command.py``.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any, NamedTuple

from ..commands.explain import normalised_margin
from ..reading.identity import record_fingerprint
from ..results.comparison import compare_runs, comparison_rows, paired_header, paired_rows
from ..results.curves import DEFAULT_THRESHOLD, acquisition_steps
from ..results.flips import NUMBERS_UNKNOWN, Flips, flips, pair_number, pair_sentences, sweep_flips
from ..results.positions import axis_of, point, readable
from ..results.runs import CompareError, Run, read_outcomes, shared_suites, suite_run
from ..results.scored_pairs import file_indices
from ..results.stats import format_interval, paired_tests
from .report_charts import PALETTE, Series, heatmap, line_chart
from .report_learning import learning_sections
from .report_tokenization import tokenization_sections

__all__ = ["build_report", "write_report"]


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto; max-width: 1280px;
       padding: 12px 20px 40px; color: #222; font-size: 14px; line-height: 1.4; }
h1 { font-size: 22px; margin: 8px 0 2px; } h2 { font-size: 18px; margin: 26px 0 6px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 16px 0 4px; } .meta { color: #666; font-size: 12px; }
.row { display: flex; flex-wrap: wrap; gap: 12px; } .scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0; }
th, td { border: 1px solid #ddd; padding: 2px 7px; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child, .overview td, .overview th { text-align: left; }
.overview td:nth-child(-n+4) { white-space: nowrap; } .sig { color: #b00; font-weight: bold; }
details { margin: 4px 0; } summary { cursor: pointer; } .pairs { font-size: 13px; margin: 2px 0 6px 18px; padding: 0; }
.pairs li { margin: 3px 0; list-style: none; } .good { color: #17612a; } .bad { color: #a11; } .idx { color: #888; }
.chart-title { font-size: 13px; font-weight: bold; } .tick, .legend { font-size: 11px; fill: #444; }
.grid { stroke: #eee; } .chance { stroke: #aaa; stroke-dasharray: 2 3; } .threshold { stroke: #888; stroke-dasharray: 6 4; }
.curve { fill: none; stroke-width: 1.8; } .band { opacity: 0.18; } .cell-text { font-size: 10px; text-anchor: middle; }
.tokens { display: flex; flex-wrap: wrap; gap: 2px; margin: 2px 0; align-items: flex-end; }
.k { display: inline-flex; flex-direction: column; align-items: center; padding: 1px 3px; border-radius: 3px;
     font-style: normal; white-space: pre; font-family: ui-monospace, monospace; font-size: 13px; }
.k b { font: 10px system-ui, sans-serif; color: #333; } .k.e { outline: 2px solid #333; }
.label { width: 34px; font-size: 11px; color: #666; align-self: center; }
"""
# The shades of the token view: 2 bits of surprisal a step, 16 bits and more the darkest.
STYLE += " ".join(f".s{level} {{ background: rgba(214, 39, 40, {level / 8:.3f}); }}" for level in range(9))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><tr>{head}</tr>{body}</table></div>'


def _series(run: Run, key: str, color: str) -> Series:
    history = run.history
    return Series(
        run.label,
        [(e["step"], e[key]) for e in history if key in e],
        [(e["step"], e[f"{key}_ci_low"], e[f"{key}_ci_high"]) for e in history if f"{key}_ci_low" in e],
        color,
        {r["step"]: r["revision"] for r in run.records_up_to_step if r.get("revision")},
    )


def _axis(runs: Sequence[Run]) -> str:
    """What the sweeps among ``runs`` place their evaluations by: step, or a revision series' tokens or words."""
    return axis_of(r for run in runs if run.is_sweep for r in run.records_up_to_step)


class Shown(NamedTuple):
    """What the page shows of a run's pairs: their sentences (None: the file was not found) and their numbers in the
    file (``scored_pairs.file_indices``; None: not known, ``flips.pair_number``)."""

    sentences: list[tuple[str, str]] | None
    numbers: Sequence[int] | None


def shown_pairs(record: Mapping[str, Any], data: str | os.PathLike | None = None) -> Shown:
    """The sentences and file numbers of ``record``'s pairs, read from ``data`` or the file the record names."""
    return Shown(pair_sentences(record, data), file_indices(record, data))


def _pair_items(indices: Sequence[int], phenomena: Sequence[str], shown: Shown, details, metric: str = "acc") -> str:
    items = []
    for i in indices:
        number = pair_number(i, shown.numbers)
        text = f'<span class="idx">{number}</span> {escape(phenomena[i])}'
        if shown.sentences is not None:
            good, bad = shown.sentences[i]
            text += f'<br><span class="good">good: {escape(good)}</span><br><span class="bad">bad: {escape(bad)}</span>'
        if details and i in details:
            text += token_view(*details[i], metric)
        items.append(f'<li data-pair="{number[1:]}">{text}</li>')
    return f'<ul class="pairs">{"".join(items)}</ul>'


def token_view(pair, tokens, metric: str = "acc") -> str:
    """Both sentences token by token: surprisal in bits under each token, shaded by it; the edit outlined (class ``e``).

    The margin first is the one ``metric`` decides by: for acc_norm the per-byte margin, as ``tatblimp explain`` gives it.
    """
    rows = []
    for label, texts, logprobs, (start, end) in (
        ("good", tokens.good_tokens_text, tokens.good_token_logprobs, tokens.edit["good"]),
        ("bad", tokens.bad_tokens_text, tokens.bad_token_logprobs, tokens.edit["bad"]),
    ):
        cells = [f'<span class="label">{label}</span>']
        for k, logprob in enumerate(logprobs):
            bits = -logprob / math.log(2)
            level = min(max(round(bits / 2), 0), 8)  # the shade class (see STYLE)
            edit = " e" if start <= k < end else ""
            text = escape(texts[k] if k < len(texts) else str(k)) or "·"
            cells.append(f'<i class="k s{level}{edit}">{text}<b>{bits:.1f}</b></i>')
        rows.append(f'<div class="tokens">{"".join(cells)}</div>')
    before, at, after = tokens.margin_parts()
    margin = f"margin {pair.good_logprob - pair.bad_logprob:+.2f} nats"
    if metric == "acc_norm":  # what decides acc_norm; the sentence margin below it, split at the edit
        margin = f"margin per byte {normalised_margin(pair):+.4f} nats; in all {margin.removeprefix('margin ')}"
    note = (
        f'<div class="meta">{margin}: at the edit {at:+.2f}, '
        f"after it {after:+.2f}, before it {before:+.2f}; surprisal in bits under each token, the edit outlined</div>"
    )
    return note + "".join(rows)


def _flip_block(run_label: str, frm: str, to: str, metric: str, flipped: Flips, phenomena, shown: Shown, details) -> str:
    attrs = f'data-run="{escape(run_label)}" data-from="{escape(frm)}" data-to="{escape(to)}" data-metric="{metric}"'
    parts = [f'<div class="flips" {attrs}>']
    for kind, title, indices in (
        ("lost", f"lost (passed at {frm}, failed at {to})", flipped.lost),
        ("learned", f"learned (failed at {frm}, passed at {to})", flipped.learned),
    ):
        parts.append(
            f'<details><summary>{metric}: <b class="flip-count" data-kind="{kind}">{len(indices)}</b> {escape(title)}</summary>'
            f"{_pair_items(indices, phenomena, shown, details, metric)}</details>"
        )
    return "".join(parts) + "</div>"


def _tests_table(tests, metric: str, before: str, after: str) -> str:
    """The paired tests of ``metric``, their columns named for what is compared (two runs, or two steps)."""
    return _table(paired_header(before, after), paired_rows(tests, metric))


def check_steps(runs: Sequence[Run], steps: tuple[int, int] | None) -> None:
    """``ValueError`` naming the run and its steps (tokens, words) when a sweep among ``runs`` lacks one of ``steps``
    (``--steps``), or when none is a sweep."""
    if steps and not any(run.is_sweep for run in runs):
        raise ValueError("--steps: two steps of a sweep's; none of the results is a sweep (a score file holds one evaluation)")
    for run in runs:
        available = [r["step"] for r in run.records_up_to_step] if run.is_sweep else []
        for step in steps or () if run.is_sweep else ():
            if step not in available:
                axis = _axis([run])
                shown = ", ".join(point(r).removeprefix(f"{axis} ") for r in run.records_up_to_step)
                raise ValueError(f"{run.path}: no {axis} {readable(step, axis)} ({'steps' if axis == 'step' else axis}: {shown})")


def _between_steps(run: Run, steps: tuple[int, int] | None, shown: Shown, details) -> str:
    """Paired tests and flips of one sweep between two of its steps (default: first and last)."""
    check_steps([run], steps)
    available = [r["step"] for r in run.records_up_to_step]
    first, last = steps or (available[0], available[-1])
    at = {r["step"]: r for r in run.records_up_to_step}  # the last record of a step scored twice
    before, after = (read_outcomes(at[s], f"{run.path} at {point(at[s])}") for s in (first, last))
    tests = paired_tests(before, after)
    parts = [f"<h3>{escape(run.label)}: {escape(point(at[first]))} against {escape(point(at[last]))}</h3>"]
    axis = at[first].get("x", "step")
    frm, to = (readable(s, axis) for s in (first, last))
    for metric in ("acc_norm", "acc"):
        flipped = flips(getattr(before, metric), getattr(after, metric))
        parts.append(_flip_block(run.label, frm, to, metric, flipped, before.phenomena, shown, details))
    names = (f"{axis} {frm}", f"{axis} {to}")
    parts.append(f"<b>acc_norm, per phenomenon</b>{_tests_table(tests, 'acc_norm', *names)}")
    parts.append(f"<details><summary>acc, per phenomenon</summary>{_tests_table(tests, 'acc', *names)}</details>")
    return "".join(parts)


def _never_and_unstable(run: Run, shown: Shown, details) -> str:
    outcomes = [read_outcomes(r, f"{run.path} at {point(r)}") for r in run.records_up_to_step]
    found = sweep_flips(outcomes)
    phenomena = outcomes[0].phenomena
    never = sum(len(f.never_learned) for f in found.values())
    unstable = sum(len(f.unstable) for f in found.values())
    parts = [
        f'<h3>{escape(run.label)}: <b class="never-count">{never}</b> pairs never learned, '
        f'<b class="unstable-count">{unstable}</b> unstable (acc_norm, over {len(outcomes)} evaluations)</h3>'
    ]
    for name, f in found.items():
        if f.never_learned or f.unstable:
            parts.append(
                f"<details><summary>{escape(name)}: {len(f.never_learned)} never learned, {len(f.unstable)} unstable</summary>"
                f"<b>never learned</b>{_pair_items(f.never_learned, phenomena, shown, details, 'acc_norm')}"
                f"<b>unstable</b>{_pair_items(f.unstable, phenomena, shown, None)}</details>"
            )
    return "".join(parts)


def report_pairs(runs: Sequence[Run], steps: tuple[int, int] | None = None) -> list[int]:
    """The pairs the report lists for the first run: lost and learned between its two steps, and never learned."""
    run = runs[0]
    if not run.is_sweep:
        return []
    at = {r["step"]: r for r in run.records_up_to_step}
    first, last = steps or (min(at), max(at))
    before, after = (read_outcomes(at[s], str(run.path)) for s in (first, last))
    flipped = flips(before.acc_norm, after.acc_norm)
    never = [
        i
        for f in sweep_flips([read_outcomes(r, str(run.path)) for r in run.records_up_to_step]).values()
        for i in f.never_learned
    ]
    return sorted({*flipped.lost, *flipped.learned, *never})


def build_report(
    runs: Sequence[Run],
    *,
    steps: tuple[int, int] | None = None,
    data: str | os.PathLike | None = None,
    details: Mapping[int, Any] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    title: str = "TatBLiMP report",
    paired: bool = True,
) -> str:
    """The HTML page (a string) for ``runs``; the first is the baseline of the paired tests. Every suite that all
    the runs have (``score --suite``, ``sweep --suite``, the callback's ``suites=``) gets the same sections, as
    ``compare`` compares each suite.

    Args:
        runs: results files read with ``runs.load_runs``.
        steps: the two steps of each sweep to test against each other (default: its first and last).
        data: the benchmark file, for the sentences (default: the one the results name).
        details: pair index -> (``PairResult``, ``PairTokens``) of the first run's model, shown token by token.
        threshold: the acc_norm that counts as acquired.
        title: the page title.
        paired: test the runs against the first pair by pair (``--no-paired``: side by side only).
    """
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    releases = {run.label: run.record.get("benchmark", {}).get("release", "?") for run in runs}
    release = next(iter(releases.values()))
    if len(set(releases.values())) > 1:  # side by side (--no-paired): each run's own, not the first's for all
        release = "the runs' benchmarks differ: " + "; ".join(f"{label}: {each}" for label, each in releases.items())
    body = [f"<h1>{escape(title)}</h1>", f'<div class="meta">{escape(release)} · written {created} by tatblimp report</div>']
    overview = [
        [
            run.label,
            f"{len(run.records_up_to_step)} (last: {point(run.record)})" if run.is_sweep else "1",
            f"{run.record['acc_norm']:.4f} {format_interval(run.record.get('acc_norm_ci'))}",
            f"{run.record['acc']:.4f} {format_interval(run.record.get('acc_ci'))}",
            str(run.path),
            str(run.record.get("tokenizer", "-")),
            str(run.record.get("precision") or run.record.get("dtype") or "-"),  # what the forwards computed in
        ]
        for run in runs
    ]
    header = ["run", "evaluations", "acc_norm [95%]", "acc [95%]", "file", "tokenizer", "precision"]
    body.append(_table(header, overview, "overview"))
    shown = shown_pairs(runs[0].record, data)
    body += _sections(runs, steps, shown, details, threshold, paired and len(runs) > 1, required=paired)
    body += tokenization_sections(runs, data, threshold)  # how each tokenizer cuts the edit, and the outcomes split by it
    for name in shared_suites(list(runs)):
        suite_runs = [suite_run(run, name) for run in runs]
        body.append(f'<h2 class="suite" data-suite="{escape(name)}">Suite {escape(name)}</h2>')
        # A suite scored less often (suite_every) may lack the steps asked for: its own first and last then.
        own_steps = steps if steps and not _lacks_steps(suite_runs, steps) else None
        shown = shown_pairs(suite_runs[0].record)
        try:
            body += _sections(
                suite_runs, own_steps, shown, None, threshold, paired and len(runs) > 1, f"{name}-", required=paired
            )
        except CompareError as err:  # the runs scored other files of this suite: side by side, and why
            body.append(f'<p class="meta">Not compared pair by pair: {escape(str(err))}</p>')
            body += _sections(suite_runs, own_steps, shown, None, threshold, False, f"{name}-", required=False)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _lacks_steps(runs: Sequence[Run], steps: tuple[int, int]) -> bool:
    try:
        check_steps(runs, steps)
    except ValueError:
        return True
    return False


def _sections(
    runs: Sequence[Run], steps, shown: Shown, details, threshold: float, paired: bool, ids: str = "", required: bool = True
) -> list[str]:
    """The curves, heatmap, side-by-side table, paired tests and flips of ``runs`` (TatBLiMP's, or one suite's);
    ``ids``: what the chart ids start with, one page holding several sets of charts. A sweep's pairs learned, lost and
    never learned need its per-pair outcomes: without ``required`` (``--no-paired``), a sweep with an evaluation that
    has none (an older version's lines) is left out of them, and said so, rather than refused."""
    sweeps = [run for run in runs if run.is_sweep]
    comparison = compare_runs(list(runs), threshold=threshold, paired=paired)
    body = []
    axis = _axis(sweeps)
    if sweeps:
        body.append("<h2>Overall accuracy over training</h2>")
        body.append(
            '<div class="meta">Bands: 95% Wilson intervals. Dotted: chance (0.5); dashed: the acquisition threshold.</div>'
        )
        charts = [
            line_chart(
                [_series(r, f"tatblimp/{m}", PALETTE[k % len(PALETTE)]) for k, r in enumerate(sweeps)],
                f"{m} (overall)",
                threshold=threshold if m == "acc_norm" else None,
                chart_id=f"{ids}curve-{m}",
                axis=axis,
            )
            for m in ("acc_norm", "acc")
        ]
        body.append(f'<div class="row">{"".join(charts)}</div>')
        body.append(f"<h2>acc_norm per phenomenon and {escape(axis)}</h2>")
        body.append(
            f'<div class="meta">Outlined: the acquisition {"step" if axis == "step" else "point"} (acc_norm reaches {threshold} '
            f"and stays there).</div>"
        )
        maps = []
        for k, run in enumerate(sweeps):
            history = run.history
            names = list(run.record["phenomena"])
            values = {(n, e["step"]): e.get(f"tatblimp/{n}/acc_norm") for e in history for n in names}
            marks = acquisition_steps(history, threshold)
            steps_shown = [e["step"] for e in history]
            chart = heatmap(names, steps_shown, values, run.label, chart_id=f"{ids}heatmap-{k}", marks=marks, axis=_axis([run]))
            maps.append(f'<div class="scroll">{chart}</div>')
        body.append(f'<div class="row">{"".join(maps)}</div>')
    metrics, acquisition = comparison_rows(comparison)
    body.append("<h2>Side by side</h2>")
    body.append(
        '<div class="meta">Phenomena rows: acc_norm [95% interval]; *: differs from the baseline (paired test, BH-adjusted).</div>'
    )
    tables = [_table(["metric", *[r.label for r in runs]], metrics)]
    if acquisition:
        tables.append(_table([f"acquisition {axis} (acc_norm >= {threshold} to the end)", *[r.label for r in runs]], acquisition))
    body.append(f'<div class="row">{"".join(tables)}</div>')
    for label, tests in comparison.tests.items():
        base = comparison.baseline
        other = next(r for r in runs if r.label == label)
        body.append(f"<h2>{escape(label)} against {escape(base.label)} (baseline), pair by pair</h2>")
        for metric in ("acc_norm", "acc"):
            flipped = flips(getattr(base.outcomes, metric), getattr(other.outcomes, metric))
            body.append(_flip_block(label, base.label, label, metric, flipped, base.outcomes.phenomena, shown, None))
        body.append(_tests_table(tests, "acc_norm", base.label, label))
    body += learning_sections(comparison)  # alerts, fitted acquisition steps and trends, order of acquisition
    listed = [run for run in sweeps if required or all("outcomes" in r for r in run.records_up_to_step)]
    if len(listed) < len(sweeps):
        left_out = ", ".join(run.label for run in sweeps if run not in listed)
        body.append(
            f'<p class="meta">No pairs learned or lost listed for {escape(left_out)}: an evaluation has no per-pair outcomes.</p>'
        )
    if listed:
        body.append("<h2>Pairs learned and lost during training</h2>")
        body.append(
            '<div class="meta">Lost: passed at the first step, failed at the last; learned: the reverse. Click a count for '
            "the pairs. The paired tests are exact McNemar tests on those pairs, BH-adjusted over the phenomena.</div>"
        )
        own = {run.label: _own_pairs(run, runs[0], shown) for run in listed}
        body += [_between_steps(run, steps, own[run.label], details if run is runs[0] else None) for run in listed]
        body.append("<h2>Pairs never learned, and unstable pairs</h2>")
        body.append(
            '<div class="meta">Never learned: failed acc_norm at every evaluation. Unstable: the outcome changed more than twice.</div>'
        )
        body += [_never_and_unstable(run, own[run.label], details if run is runs[0] else None) for run in listed]
    if shown.sentences is None:
        body.append('<p class="meta">Sentences are not shown: the benchmark file was not found (tatblimp report --data).</p>')
    if shown.numbers is None:
        body.append(f'<p class="meta">{escape(NUMBERS_UNKNOWN)}</p>')
    return body


def _own_pairs(run: Run, first: Run, shown: Shown) -> Shown:
    """What is shown of ``run``'s own pairs: the first run's (``shown``) where it scored the same pairs, else read
    again for its own record (``--no-paired`` on runs of other files or selections)."""
    identities = [
        (
            r.record.get("benchmark", {}).get("md5"),
            r.record.get("selection"),
            record_fingerprint(r.record),
            len(r.outcomes.acc_norm),
        )
        for r in (run, first)
    ]
    return shown if run is first or identities[0] == identities[1] else shown_pairs(run.record)


def write_report(path: str | os.PathLike, runs: Sequence[Run], **options) -> Path:
    """``build_report(runs, **options)`` written to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_report(runs, **options), encoding="utf-8")
    return path
