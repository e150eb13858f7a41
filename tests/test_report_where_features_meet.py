"""``tatblimp report`` where features meet: suites, selections, ``--model`` with ``--steps``, ``--output`` checked
first, ``--no-paired``, the legends of three runs (#30)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import DATA, SHARED, tiny_llama
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.reading.data import load_benchmark
from tatblimp_callback.reading.suites import load_suite
from tatblimp_callback.reports.report import build_report
from tatblimp_callback.results.runs import load_runs

DEMO = Path(__file__).parent / "data" / "demo_history.jsonl"
CHROMIUM = os.environ.get("TATBLIMP_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def blimp(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("blimp")
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")[:12]
    (folder / "passive_1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def history(path: Path, model_seeds, bpe_tokenizer, data, **options) -> Path:
    """A history file: one line per model (step 10, 20, ...), as the callback writes it (no per-pair list)."""
    lines = []
    for k, seed in enumerate(model_seeds):
        record = evaluate(tiny_llama(len(bpe_tokenizer), seed=seed), bpe_tokenizer, data, **options).to_dict()
        record.pop("pairs")
        for suite in record.get("suites", {}).values():
            suite.pop("pairs")
        lines.append(json.dumps({"step": 10 * (k + 1), **record}, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_report_shows_every_suite_the_runs_have(bpe_tokenizer, small_data, blimp, tmp_path):
    suites = {"blimp": load_suite("blimp", blimp)}
    one = history(tmp_path / "one.jsonl", (0, 1, 2), bpe_tokenizer, small_data, allow_modified=True, suites=suites)
    two = history(tmp_path / "two.jsonl", (3, 4), bpe_tokenizer, small_data, allow_modified=True, suites=suites)
    html = build_report(load_runs([one, two]))
    # Before: no suite on the page at all.
    section = html.split('<h2 class="suite" data-suite="blimp">Suite blimp</h2>', 1)[1]
    assert 'id="blimp-curve-acc_norm"' in section and 'id="blimp-heatmap-0"' in section
    records = [json.loads(line) for line in one.read_text(encoding="utf-8").splitlines()]
    first, last = (r["suites"]["blimp"]["outcomes"]["acc_norm"] for r in (records[0], records[-1]))
    lost = sum(a == "1" and b == "0" for a, b in zip(first, last))
    block = re.search(
        r'<div class="flips" data-run="one" data-from="10" data-to="30" data-metric="acc_norm">(.*?)</div>', section
    )
    assert re.search(r'data-kind="lost">(\d+)</b>', block.group(1)).group(1) == str(lost)
    # Its pairs' sentences come from the suite's folder (a folder, and the suite's md5: never before).
    pair = suites["blimp"].pairs[int(re.search(r'<li data-pair="(\d+)">', section).group(1))]
    assert pair.good.replace("'", "&#x27;") in section
    # Run against run: the columns are named for the runs, in both sections.
    assert (
        "<th>only one</th><th>only two</th>" in section and "<th>only one</th><th>only two</th>" in html.split("Suite blimp")[0]
    )
    assert "<th>only step 10</th><th>only step 30</th>" in section


def test_report_model_scores_the_selections_own_pairs(model_dir, bpe_tokenizer, tmp_path):
    from tatblimp_callback.commands.loading import load_model

    chosen = load_benchmark(DATA).select(limit=2, phenomena="binding,passives,quantifiers")
    runs = history(tmp_path / "tatblimp_history.jsonl", (5, 6, 7), bpe_tokenizer, chosen)
    report = tmp_path / "report.html"
    assert main(["report", str(runs), "--output", str(report), "--model", str(model_dir), "--device", "cpu"]) == 0
    html = report.read_text(encoding="utf-8")
    scored = dict(zip(chosen.file_indices, evaluate(load_model(model_dir, "cpu"), bpe_tokenizer, chosen).pairs))
    shown = re.findall(r'<li data-pair="(\d+)">(.*?)</li>', html, re.S)
    assert shown
    for index, item in shown:  # named by its index in the file, as explain --pair takes it
        pair = scored[int(index)]
        assert f"good: {pair.good}" in item  # before: the whole file's pair at that index
        margin = re.search(r"margin ([-+]\d+\.\d+) nats", item)
        if margin:  # the token view: the selection's pair scored, not the file's pair at that index
            assert margin.group(1) == f"{pair.good_logprob - pair.bad_logprob:+.2f}"
    assert re.search(r"margin [-+]\d+\.\d+ nats", html)


def test_report_steps_and_output_are_checked_before_the_model_loads(tmp_path, capsys):
    missing_model = str(tmp_path / "no-such-model")
    common = ["report", str(DEMO), "--data", str(DATA), "--model", missing_model, "--device", "cpu"]
    assert main([*common, "--output", str(tmp_path / "r.html"), "--steps", "0", "7"]) == 1
    err = capsys.readouterr().err
    assert f"{DEMO}: no step 7 (steps: 0, 200, " in err  # before: a bare "7", after loading the model
    (tmp_path / "file").write_text("")
    assert main([*common, "--output", str(tmp_path / "file" / "r.html")]) == 1
    err = capsys.readouterr().err
    assert "--output" in err and "is a file, not a folder" in err and "no-such-model" not in err


def test_report_of_other_files_advises_an_option_it_has(small_data, tmp_path, capsys):
    other = tmp_path / "other.json"
    record = json.loads(DEMO.read_text(encoding="utf-8").splitlines()[-1])
    record["benchmark"] = {**record["benchmark"], "md5": "0" * 32}
    other.write_text(json.dumps(record), encoding="utf-8")
    out = tmp_path / "r.html"
    assert main(["report", str(DEMO), str(other), "--output", str(out), "--data", str(DATA)]) == 1
    assert "--no-paired" in capsys.readouterr().err
    assert (
        main(["report", str(DEMO), str(other), "--output", str(out), "--data", str(DATA), "--no-paired"]) == 0
    )  # before: unknown
    assert "Side by side" in out.read_text(encoding="utf-8") and "pair by pair</h2>" not in out.read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_legend_of_three_runs_stays_inside_its_chart(tmp_path):
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI installs Debian's chromium (.ci/run)")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    report = tmp_path / "report.html"
    runs = [f"{DEMO}@800", f"{DEMO}@1400", str(DEMO)]
    assert main(["report", *runs, "--output", str(report), "--data", str(DATA)]) == 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1366, "height": 900}, offline=True).new_page()
        page.goto(report.as_uri())
        for chart in ("#curve-acc_norm", "#curve-acc"):
            box = page.locator(chart).bounding_box()
            legends = page.locator(f"{chart} text.legend")
            assert legends.count() == 3
            for k in range(3):  # before: the third label began at x=537 of 540 and was cut off
                label = legends.nth(k).bounding_box()
                assert label["x"] + label["width"] <= box["x"] + box["width"], (chart, k)
            curve = page.locator(f"{chart} polyline.curve").first.bounding_box()
            last_legend = legends.nth(2).bounding_box()
            assert last_legend["y"] + last_legend["height"] <= curve["y"] or last_legend["x"] > curve["x"] + curve["width"]
        browser.close()


def test_a_suite_of_other_files_in_two_runs_is_shown_side_by_side(bpe_tokenizer, small_data, blimp, tmp_path):
    edited = tmp_path / "edited"
    edited.mkdir()
    lines = (blimp / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")
    (edited / "passive_1.jsonl").write_text("\n".join(lines[1:]), encoding="utf-8")
    one = history(tmp_path / "one.jsonl", (0, 1), bpe_tokenizer, small_data, allow_modified=True, suites={"blimp": blimp})
    two = history(tmp_path / "two.jsonl", (2,), bpe_tokenizer, small_data, allow_modified=True, suites={"blimp": edited})
    html = build_report(load_runs([one, two]))  # TatBLiMP's sections as ever, and the suite's without paired tests
    section = html.split('data-suite="blimp">Suite blimp</h2>', 1)[1]
    assert "Not compared pair by pair: the results were scored on different benchmark files" in section
    assert "two against one (baseline), pair by pair" in html.split("Suite blimp")[0]
    assert "pair by pair</h2>" not in section and "Side by side" in section
