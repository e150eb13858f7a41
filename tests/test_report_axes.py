"""A revision series placed by tokens or words (``tatblimp sweep HUB_ID --revisions ... --x tokens``) is shown on that
axis everywhere its steps are: the report's curves, heatmap, acquisition table, "A against B" headings, alerts and fits
and ``--steps``; ``tatblimp compare``'s tables and plot; numbers written as the names write them (4B, 10M).

The series are the demo run's history file rewritten as a sweep of Hub revisions writes its lines (``x``,
``revision``, ``revisions``, ``commit``, ``position``), so the outcomes are real and the axis is all that changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.reports.report import build_report
from tatblimp_callback.results.curves import acquisition_steps, history_from_records
from tatblimp_callback.results.positions import parse_readable, readable
from tatblimp_callback.results.runs import load_runs

DEMO = Path(__file__).parent / "data" / "demo_history.jsonl"  # steps 0, 200, ..., 2000
TOKENS = {step: step * 2_000_000 for step in range(0, 2001, 200)}  # 0, 400M, ..., 4B: OLMo's step1000-tokens2B
WORDS = {step: (step // 200 + 1) * 10**6 if step < 2000 else 20 * 10**6 for step in range(0, 2001, 200)}  # chck_1M ...


def demo_records() -> list[dict]:
    return [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()]


def series(tmp_path: Path, axis: str, suite: bool = False) -> tuple[Path, dict[int, str]]:
    """The demo run as a Hub sweep's results file on ``axis`` (``suite``: its results again as a suite's, "again");
    its path and each demo step's revision name."""
    lines, names = [], {}
    for k, record in enumerate(demo_records()):
        if suite:
            record["suites"] = {"again": dict(record)}
        step = record["step"]
        if axis == "tokens":
            value, name = TOKENS[step], f"step{step}-tokens{readable(TOKENS[step], 'tokens')}"
            position = {"step": step, "tokens": value}
        else:
            value, name = WORDS[step], f"chck_{WORDS[step] // 10**6}M"
            position = {"words": value}
        names[step] = name
        where = {"checkpoint": name, "revision": name, "revisions": [name], "commit": f"{k:040x}", "position": position}
        lines.append(json.dumps({**record, **where, "step": value, "x": axis}))
    path = tmp_path / f"org--tiny-{axis}.tatblimp.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, names


def chart(html: str, chart_id: str) -> str:
    return re.search(rf'<svg class="\w+" id="{chart_id}".*?</svg>', html, re.S).group(0)


def acquisition_row(html: str, phenomenon: str) -> list[str]:
    table = re.search(r"<th>acquisition (\w+) \(acc_norm.*?</table>", html, re.S).group(0)
    row = re.search(rf"<tr><td>{re.escape(phenomenon)}</td>(.*?)</tr>", table).group(1)
    return re.findall(r"<td>(.*?)</td>", row)


def test_readable_counts_and_back():
    assert [readable(n, "tokens") for n in (0, 999, 1500, 4 * 10**9, 2_500_000_000_000, 10**7)] == [
        "0",
        "999",
        "1.5K",
        "4B",
        "2.5T",
        "10M",
    ]
    assert readable(3_712_345_678.9, "tokens") == "3.71B" and readable(1234.6, "step") == "1235"
    assert readable(4 * 10**9, "step") == "4000000000"  # a step stays a number
    assert [parse_readable(t) for t in ("4B", "400m", "2.5T", "1200", "1.5", "step1000")] == [
        4 * 10**9,
        4 * 10**8,
        2_500_000_000_000,
        1200,
        None,
        None,
    ]


@pytest.mark.parametrize("axis", ["tokens", "words"])
def test_a_revision_series_is_reported_on_its_axis(tmp_path, axis):
    path, names = series(tmp_path, axis)
    values = TOKENS if axis == "tokens" else WORDS
    html = build_report(load_runs([path]), data=DATA)
    first, last = values[0], values[2000]
    # The curves: the axis named under them, the ticks as counts (4B, 20M), each point with its revision.
    curve = chart(html, "curve-acc_norm")
    assert re.findall(r'class="tick x-label"[^>]*>(\w+)</text>', curve) == [axis]
    ticks = re.findall(r'class="tick" text-anchor="middle">([^<]+)</text>', curve)
    assert ticks == (["0", "1B", "2B", "3B", "4B"] if axis == "tokens" else ["5M", "10M", "15M", "20M"])
    assert f"{axis} {readable(last, axis)} ({names[2000]}): " in curve
    # The heatmap: one column a revision, labelled by its count; its title; the acquisition marks on the axis.
    heat = chart(html, "heatmap-0")
    columns = re.findall(r'class="tick"\s+text-anchor="middle">([^<]+)</text>', heat)
    assert columns == [readable(values[s], axis) for s in sorted(values)]
    assert re.findall(r'class="tick x-label"[^>]*>(\w+)</text>', heat) == [axis]
    assert f"<h2>acc_norm per phenomenon and {axis}</h2>" in html
    records = demo_records()
    acquired = acquisition_steps(history_from_records(records))
    shown = {name: ("never" if s is None else f"{axis} {readable(values[s], axis)}") for name, s in acquired.items()}
    for name, text in shown.items():
        assert f'class="tick">{text}</text>' in heat, name
    # The acquisition table: named for the axis, each cell the count at which the phenomenon was acquired.
    for name, step in acquired.items():
        assert acquisition_row(html, name) == ["never" if step is None else readable(values[step], axis)]
    assert re.search(r"<th>acquisition (\w+) \(", html).group(1) == axis
    # First against last, by count and revision name; the flips from and to those counts.
    assert f"{axis} {readable(first, axis)} ({names[0]}) against {axis} {readable(last, axis)} ({names[2000]})</h3>" in html
    assert f'data-from="{readable(first, axis)}" data-to="{readable(last, axis)}"' in html
    assert f"<th>only {axis} {readable(last, axis)}</th>" in html
    assert f"(last: {axis} {readable(last, axis)} ({names[2000]}))" in html
    # The fits and the alerts: named for the axis too; nowhere a step.
    assert f"fitted {axis} [95%]" in html
    assert re.search(r"<th>(reference \w+)</th>", html) is None or f"<th>reference {axis}</th>" in html
    assert f"<tr><td>{axis}</td><td>{readable(last, axis)} {axis}</td></tr>" in html  # the side-by-side table's row
    assert not re.search(r">step<|and step<|acquisition step|[fF]itted step|: step \d|1 \+ step", html)


def test_the_step_demo_keeps_its_steps():
    html = build_report(load_runs([DEMO]), data=DATA)
    assert re.findall(r'class="tick x-label"[^>]*>(\w+)</text>', chart(html, "curve-acc_norm")) == ["step"]
    assert "<h2>acc_norm per phenomenon and step</h2>" in html and "step 0 against step 2000</h3>" in html
    assert 'data-from="0" data-to="2000"' in html and "fitted step [95%]" in html


def test_report_steps_take_counts_and_revision_names_and_a_suite_keeps_the_axis(tmp_path, capsys):
    path, names = series(tmp_path, "tokens", suite=True)
    out = tmp_path / "r.html"
    assert main(["report", str(path), "--output", str(out), "--steps", "400M", names[2000]]) == 0
    html = out.read_text(encoding="utf-8")
    assert html.count(f"tokens 400M ({names[200]}) against tokens 4B ({names[2000]})</h3>") == 2  # TatBLiMP, the suite
    for chart_id in ("curve-acc_norm", "heatmap-0", "again-curve-acc_norm", "again-heatmap-0"):
        assert re.findall(r'class="tick x-label"[^>]*>(\w+)</text>', chart(html, chart_id)) == ["tokens"], chart_id
    assert main(["report", str(path), "--output", str(out), "--steps", "5B", "4B"]) == 1
    error = capsys.readouterr().err
    assert f"no tokens 5B (tokens: 0 ({names[0]}), 400M ({names[200]})," in error
    assert main(["report", str(path), "--output", str(out), "--steps", "step999", "4B"]) == 1
    assert f"--steps 'step999': not a step, a count such as 4B, nor the name of a revision ({names[0]}," in (
        capsys.readouterr().err
    )


def test_compare_tables_and_plot_of_a_tokens_series(tmp_path, capsys):
    import matplotlib

    path, names = series(tmp_path, "tokens")
    plot = tmp_path / "curves.svg"
    assert main(["compare", f"{path}@5B"]) == 1
    assert f"{path}: no tokens 5B (tokens: 0, 400M, 800M, 1.2B," in capsys.readouterr().err
    assert main(["compare", f"{path}@step999"]) == 1
    assert f"@step999: not a step, a count such as 4B, nor a revision of it (revisions: {names[0]}," in capsys.readouterr().err
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # the labels as text in the SVG
        assert main(["compare", f"{path}@400M", f"{path}@{names[2000]}", "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert f"org--tiny-tokens@400M  org--tiny-tokens@{names[2000]}" in text  # picked by count and by revision name
    assert re.search(r"^tokens\s+400M tokens\s+4B tokens$", text, re.M)
    acquired = acquisition_steps(history_from_records(demo_records()))
    name, step = next((n, s) for n, s in acquired.items() if s is not None)
    assert re.search(rf"^  {re.escape(name)}\s+\S+\s+{readable(TOKENS[step], 'tokens')}$", text, re.M)
    assert f"org--tiny-tokens@{names[2000]}: fitted tokens [95%]" in text
    svg = plot.read_text(encoding="utf-8")
    labels = re.findall(r">([^<>]+)</text>", svg)
    assert "tokens" in labels and {"1B", "2B", "4B"} <= set(labels)
    assert not any(re.fullmatch(r"1e9|\d{9,}", label) for label in labels)
