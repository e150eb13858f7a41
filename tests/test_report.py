"""``tatblimp report``: one self-contained HTML page, opened in headless Chromium with the network blocked;
``tatblimp explain``: pairs token by token in the terminal; ``score --include-tokens`` from the command line."""

from __future__ import annotations

import html as html_module
import io
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.reports.report import build_report
from tatblimp_callback.results.runs import load_runs
from tatblimp_callback.results.stats import Outcomes

DEMO = Path(__file__).parent / "data" / "demo_history.jsonl"  # the demo run's history file (examples/train_tiny_tatar.py)
CHROMIUM = os.environ.get("TATBLIMP_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def demo_records() -> list[dict]:
    return [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()]


def flip_counts(a: str, b: str) -> tuple[int, int]:
    x, y = (np.frombuffer(s.encode(), dtype=np.uint8) for s in (a, b))
    one, zero = ord("1"), ord("0")
    return int(((x == one) & (y == zero)).sum()), int(((x == zero) & (y == one)).sum())


def never_learned(demo_records: list[dict]) -> int:
    matrix = np.stack([np.frombuffer(r["outcomes"]["acc_norm"].encode(), dtype=np.uint8) for r in demo_records])
    return int((matrix == ord("0")).all(0).sum())


def page_counts(html: str, run: str, metric: str) -> tuple[int, int]:
    block = re.search(rf'<div class="flips" data-run="{re.escape(run)}"[^>]*data-metric="{metric}">(.*?)</div>', html, re.S)
    counts = dict(re.findall(r'<b class="flip-count" data-kind="(\w+)">(\d+)</b>', block.group(1)))
    return int(counts["lost"]), int(counts["learned"])


def test_report_is_self_contained_and_lists_the_flips(demo_records):
    html = build_report(load_runs([DEMO]), data=DATA)
    assert not re.search(r"<script|<link|@import|url\(|<img|<iframe", html, re.I)
    assert set(re.findall(r"https?://[^\"' )]+", html)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace only
    for metric in ("acc_norm", "acc"):
        expected = flip_counts(demo_records[0]["outcomes"][metric], demo_records[-1]["outcomes"][metric])
        assert page_counts(html, "demo_history", metric) == expected
    assert int(re.search(r'<b class="never-count">(\d+)</b>', html).group(1)) == never_learned(demo_records)
    pairs = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    lost = re.search(r'data-kind="lost">\d+</b>.*?<li data-pair="(\d+)">(.*?)</li>', html, re.S)
    assert pairs[int(lost.group(1))]["good"] in lost.group(2)


def test_report_of_several_runs_tests_each_against_the_baseline(demo_records):
    middle = demo_records[len(demo_records) // 2]["step"]
    html = build_report(load_runs([f"{DEMO}@{middle}", str(DEMO)]), data=DATA)
    before = next(r for r in demo_records if r["step"] == middle)
    assert page_counts(html, "demo_history", "acc_norm") == flip_counts(
        before["outcomes"]["acc_norm"], demo_records[-1]["outcomes"]["acc_norm"]
    )
    assert "demo_history against demo_history@" in html
    # The run picked at a step is followed up to that step only: its flips run from the first step to it.
    picked = re.search(rf'<div class="flips" data-run="demo_history@{middle}" data-from="(\d+)" data-to="(\d+)"', html)
    assert picked.groups() == (str(demo_records[0]["step"]), str(middle))
    assert page_counts(html, f"demo_history@{middle}", "acc_norm") == flip_counts(
        demo_records[0]["outcomes"]["acc_norm"], before["outcomes"]["acc_norm"]
    )
    assert html.count('class="heatmap"') == 2


def test_report_steps_must_exist(demo_records, tmp_path, capsys):
    assert main(["report", str(DEMO), "--output", str(tmp_path / "r.html"), "--steps", "0", "7"]) == 1
    assert "no step 7" in capsys.readouterr().err


def test_a_sweep_with_older_lines_without_outcomes_is_reported_with_no_paired(demo_records, tmp_path, capsys):
    """Lines written before per-pair outcomes were recorded: refused with advice to pass --no-paired, which then
    refused them again (it did not reach a single sweep's pairs learned and lost between its steps)."""
    older = [{k: v for k, v in r.items() if k != "outcomes"} if k < 3 else r for k, r in enumerate(demo_records)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in older), encoding="utf-8")
    page = tmp_path / "r.html"
    assert main(["report", str(mixed), "--output", str(page), "--data", str(DATA)]) == 1
    assert "pass --no-paired" in capsys.readouterr().err
    assert main(["report", str(mixed), "--output", str(page), "--data", str(DATA), "--no-paired"]) == 0
    html = page.read_text(encoding="utf-8")
    assert "No pairs learned or lost listed for mixed: an evaluation has no per-pair outcomes." in html
    assert 'class="never-count"' not in html and html.count('class="heatmap"') == 1


@pytest.mark.slow
def test_report_of_the_demo_run_in_headless_chromium(demo_records, tmp_path):
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI installs Debian's chromium (.ci/run)")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from PIL import Image
    from playwright.sync_api import sync_playwright

    report = tmp_path / "report.html"
    assert main(["report", str(DEMO), "--output", str(report), "--data", str(DATA)]) == 0
    errors, failed, requested = [], [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1366, "height": 900}, offline=True)
        # Any request that is not the file itself is refused, and recorded: the page must make none.
        context.route(re.compile(r"^(?!file://).*"), lambda route: (requested.append(route.request.url), route.abort()))
        page = context.new_page()
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("requestfailed", lambda request: failed.append(request.url))
        page.goto(report.as_uri())
        page.wait_for_load_state("load")
        assert (errors, failed, requested) == ([], [], [])
        # The curves and the heatmap are drawn: one point per evaluation, one cell per phenomenon and step.
        steps, phenomena = len(demo_records), len(demo_records[0]["phenomena"])
        for metric in ("acc_norm", "acc"):
            assert page.locator(f"#curve-{metric} circle.point").count() == steps
            box = page.locator(f"#curve-{metric} polyline.curve").bounding_box()
            assert box["width"] > 300 and box["height"] > 10
        assert page.locator("#heatmap-0 rect.cell").count() == steps * phenomena
        assert page.locator("#heatmap-0").bounding_box()["height"] > 20 * phenomena
        # The flip counts on the page are those of the outcomes.
        for metric in ("acc_norm", "acc"):
            block = page.locator(f'div.flips[data-run="demo_history"][data-metric="{metric}"]')
            shown = [int(block.locator(f'b.flip-count[data-kind="{kind}"]').inner_text()) for kind in ("lost", "learned")]
            assert tuple(shown) == flip_counts(demo_records[0]["outcomes"][metric], demo_records[-1]["outcomes"][metric])
        assert int(page.locator("b.never-count").inner_text()) == never_learned(demo_records)
        # Readable on a laptop screen: nothing wider than the window.
        assert page.evaluate("document.documentElement.scrollWidth") <= 1366
        shot = tmp_path / "shot.png"
        page.screenshot(path=str(shot))
        browser.close()
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
    not_white = (pixels < 240).any(2).mean()
    assert colours > 200 and not_white > 0.05  # text, lines, bands and heatmap cells, not a blank page


def test_score_include_tokens_and_explain(model_dir, tmp_path, capsys):
    output = tmp_path / "results.json"
    assert (
        main(["score", str(model_dir), "--data", str(DATA), "--device", "cpu", "--output", str(output), "--include-tokens"]) == 0
    )
    printed = capsys.readouterr().out
    assert "at edit" in printed and re.search(r"^overall\s+1248\s", printed, re.M)
    record = json.loads(output.read_text(encoding="utf-8"))
    pair = record["pairs"][640]
    assert sum(pair["good_token_logprobs"]) == pair["good_logprob"]
    assert pair["edit"]["good"][0] == pair["edit"]["good"][1]  # an insertion: the good span is empty

    # explain, piped: plain text, the pair's tokens and their surprisal in bits, the edit bracketed.
    assert main(["explain", str(model_dir), "--data", str(DATA), "--pair", "640", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "\033[" not in text and text.startswith("pair 640  npi_licensing")
    (_gs, _), (bs, be) = pair["edit"]["good"], pair["edit"]["bad"]
    lines = text.splitlines()
    chunks = [k for k, line in enumerate(lines) if line.startswith("good ")]  # wrapped: good, bits, bad, bits per chunk
    assert len(chunks) >= 1 and all(lines[k + 2].startswith("bad ") for k in chunks)
    values = [v for k in chunks for v in re.findall(r"-?\d+\.\d", lines[k + 3])]
    assert values == [f"{-lp / math.log(2):.1f}" for lp in pair["bad_token_logprobs"]]
    edit = re.search(r"\[(.*?)\]", " ".join(lines[k + 2] for k in chunks)).group(1).split()
    assert [piece.replace("▁", " ") for piece in edit] == pair["bad_tokens_text"][bs:be]
    # The edit in characters, its critical region, and the region's surprisal as the per-pair record has it.
    region, header = pair["critical_region"], text.replace("\n  ", " ")  # the header lines unwrapped
    assert f"critical region: {region['good_text']!r} / {region['bad_text']!r}" in header
    bits = pair["critical_region_bits"]
    assert f"good {bits['good']:.2f} bits, bad {bits['bad']:.2f} bits" in header and "word-start corrected" in header

    # --worst K: the K pairs of the phenomenon with the lowest per-byte margin, in that order.
    assert main(["explain", str(model_dir), "--data", str(DATA), "--phenomenon", "binding", "--worst", "3"]) == 0
    shown = [int(n) for n in re.findall(r"^pair (\d+) ", capsys.readouterr().out, re.M)]
    binding = [
        (p["good_logprob"] / p["good_bytes"] - p["bad_logprob"] / p["bad_bytes"], i)
        for i, p in enumerate(record["pairs"])
        if p["phenomenon"] == "binding"
    ]
    assert shown == [i for _, i in sorted(binding)[:3]]


def test_explain_colours_a_terminal_and_names_bad_requests(model_dir, capsys):
    from tatblimp_callback.cli import build_parser
    from tatblimp_callback.commands.explain import run_explain

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    run_explain(build_parser().parse_args(["explain", str(model_dir), "--data", str(DATA), "--pair", "0"]), terminal)
    assert "\033[30;43m[" in terminal.getvalue()  # the edit's brackets, highlighted
    for arguments, message in [
        (["--pair", "5000"], "--pair 5000: the benchmark has pairs 0 to 1247"),
        (["--phenomenon", "nope", "--worst", "2"], "--phenomenon nope: no such phenomenon"),
        (["--phenomenon", "binding"], "name the pairs"),
    ]:
        assert main(["explain", str(model_dir), "--data", str(DATA), *arguments]) == 1
        assert message in capsys.readouterr().err


def test_report_with_a_model_shows_the_tokens_of_the_listed_pairs(model_dir, demo_records, tmp_path):
    from tatblimp_callback.commands.explain import score_pairs
    from tatblimp_callback.commands.loading import load_model, load_tokenizer
    from tatblimp_callback.reading.data import load_benchmark
    from tatblimp_callback.reports.report import report_pairs

    report = tmp_path / "report.html"
    assert (
        main(["report", str(DEMO), "--output", str(report), "--data", str(DATA), "--model", str(model_dir), "--device", "cpu"])
        == 0
    )
    html = report.read_text(encoding="utf-8")
    runs = load_runs([DEMO])
    listed = report_pairs(runs)
    before, after = Outcomes.from_record(demo_records[0]), Outcomes.from_record(demo_records[-1])
    assert set(listed) >= {i for i in range(len(before.acc_norm)) if before.acc_norm[i] != after.acc_norm[i]}
    first = listed[0]
    (_result, tokens) = score_pairs(load_model(model_dir, "cpu"), load_tokenizer(model_dir), load_benchmark(DATA), [first])[first]
    item = re.search(rf'<li data-pair="{first}">(.*?)</li>', html, re.S).group(1)
    rows = re.findall(r'<div class="tokens">(.*?)</div>', item, re.S)
    tokens_shown = re.findall(r'<i class="k s\d( e)?">(.*?)<b>(.*?)</b></i>', rows[0])
    texts = [html_module.unescape(text).replace("·", "") for _, text, _ in tokens_shown]
    bits = [value for _, _, value in tokens_shown]
    assert "".join(texts) == load_benchmark(DATA).pairs[first].good
    assert bits == [f"{-lp / math.log(2):.1f}" for lp in tokens.good_token_logprobs]
    (start, end) = tokens.edit["good"]
    assert [k for k, (edit, _, _) in enumerate(tokens_shown) if edit] == list(range(start, end))


REPORT_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import wandb
from conftest import tiny_llama, train_bpe
from trainer_utils import make_trainer
from tatblimp_callback import TatBLiMPCallback

tokenizer = train_bpe(lines=1500)
trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r}, [], report_to=["wandb"], max_steps=4)
TatBLiMPCallback.attach(
    trainer, data={data!r}, allow_modified=True, eval_steps=2, report_file="tatblimp_report.html", acquisition_threshold=0.4
)
trainer.train()
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


@pytest.mark.slow
def test_the_callback_writes_the_report_and_logs_it_to_wandb(small_data, tmp_path):
    from trainer_utils import run_wandb_script, wandb_records

    out = tmp_path / "out"
    script = REPORT_SCRIPT.format(tests=str(Path(__file__).parent), data=str(small_data), out=str(out))
    (run_dir,) = run_wandb_script(script, tmp_path)
    page = (out / "tatblimp_report.html").read_text(encoding="utf-8")
    history = [json.loads(line) for line in (out / "tatblimp_history.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in history] == [0, 2, 4]
    assert page.count('class="cell"') == 3 * 16  # every evaluation of the run, every phenomenon
    # At the run's acquisition_threshold, as its wandb summary: the report used the default 0.75.
    assert "(acc_norm &gt;= 0.4 to the end)" in page and "&gt;= 0.75" not in page
    assert page_counts(page, "out", "acc_norm") == flip_counts(
        history[0]["outcomes"]["acc_norm"], history[-1]["outcomes"]["acc_norm"]
    )
    items = [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
    logged = [item for item in items if "tatblimp/report.path" in item]  # a media value, flattened by the reader
    assert len(logged) == 1 and logged[0]["tatblimp/report._type"] == "html-file" and logged[0]["train/global_step"] == 4
    assert (Path(run_dir) / "files" / logged[0]["tatblimp/report.path"]).read_text(encoding="utf-8") == page


def test_report_file_needs_the_history_file():
    from tatblimp_callback import TatBLiMPCallback

    with pytest.raises(ValueError, match="needs history_file"):
        TatBLiMPCallback(report_file="r.html", history_file=None)
    # Forced choice alone writes no log-prob history: the report was skipped at the end, with no word.
    with pytest.raises(ValueError, match=r"protocol='forced-choice' has none of: use protocol='both', or drop report_file"):
        TatBLiMPCallback(report_file="r.html", protocol="forced-choice")


@pytest.mark.slow
def test_alerts_fits_and_orders_in_headless_chromium(demo_records, tmp_path):
    """The learning sections of a report of two runs (the demo run, and the same run up to step 1600)."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI installs Debian's chromium (.ci/run)")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright
    from scipy.stats import kendalltau

    from tatblimp_callback.results.learning import acquisition_fits, evaluations_from_records
    from tatblimp_callback.results.regressions import replay_alerts

    report = tmp_path / "report.html"
    assert main(["report", str(DEMO), f"{DEMO}@1600", "--output", str(report), "--data", str(DATA)]) == 0
    # What the page must show, computed here from the records: the monitor replayed, the fits, scipy's tau.
    alerts = replay_alerts(demo_records)
    full = acquisition_fits(evaluations_from_records(demo_records))
    part = acquisition_fits(evaluations_from_records([r for r in demo_records if r["step"] <= 1600]))
    both = [name for name in full if full[name].acquired and part[name].acquired]
    tau = kendalltau([full[n].step for n in both], [part[n].step for n in both]).statistic
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1366, "height": 900}, offline=True).new_page()
        page.goto(report.as_uri())
        rows = page.locator('table.alerts[data-run="demo_history"] tr.alert')
        assert rows.count() == len(alerts) >= 1  # the demo's passives fall from 0.83 at step 0 to 0.40 at step 200
        assert [rows.nth(i).get_attribute("data-group") for i in range(rows.count())] == [a.key for a in alerts]
        assert rows.nth(0).get_attribute("data-step") == str(alerts[0].step)
        assert page.locator("b.alert-count").first.inner_text() == str(len(alerts))
        fits = page.locator("table.fits tr")
        assert fits.count() == 1 + len(full)  # the header, one row per phenomenon
        binding = page.locator("table.fits tr", has_text="binding").first.inner_text().split("\t")
        assert binding[1] == full["binding"].describe() and binding[3] == part["binding"].describe()
        assert float(page.locator('b.tau[data-run="demo_history@1600"]').inner_text()) == pytest.approx(tau, abs=5e-4)
        order = page.locator("table.order tr")
        assert order.count() == 1 + max(sum(f.acquired for f in full.values()), sum(f.acquired for f in part.values()))
        assert page.locator("table.order").bounding_box()["height"] > 20 * len(both)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1366
        browser.close()


def test_report_no_paired_on_runs_over_different_selections(small_data, tmp_path, capsys):
    from conftest import tiny_llama, train_bpe
    from tatblimp_callback import Evaluator
    from tatblimp_callback.reading.data import load_benchmark
    from tatblimp_callback.training.reporting import HistoryFile

    tokenizer = train_bpe(vocab_size=300, lines=500)
    benchmark = load_benchmark(small_data, allow_modified=True)
    two = Evaluator(tokenizer, benchmark.pick([0, 1]))
    first = two(tiny_llama(len(tokenizer))).pairs[1].passed_norm
    # Weights at step 10 under which pair 1 (of the second run only) flips: listed among its lost or learned pairs.
    seed = next(s for s in range(1, 50) if two(tiny_llama(len(tokenizer), seed=s)).pairs[1].passed_norm != first)
    histories = []
    for name, picked in (("one", [0]), ("two", [0, 1])):
        history = HistoryFile(tmp_path / f"{name}.jsonl")
        history.start(set())
        evaluator = Evaluator(tokenizer, benchmark.pick(picked))
        for step, weights in ((0, 0), (10, seed)):
            history.append(step, evaluator(tiny_llama(len(tokenizer), seed=weights)))
        histories.append(str(history.path))
    out = tmp_path / "report.html"
    assert main(["report", *histories, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "cover different pairs" in err and "--no-paired" in err
    assert main(["report", *histories, "--no-paired", "--output", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "against one (baseline), pair by pair" not in page  # no pair-by-pair tests between other pairs
    # Each run's flips between its own steps list its own pairs, with their own sentences.
    for run, count in (("one", 1), ("two", 2)):
        block = re.search(rf'<div class="flips" data-run="{run}"[^>]*data-metric="acc_norm">(.*?)</div>', page, re.S).group(1)
        listed = [int(i) for i in re.findall(r'<li data-pair="(\d+)">', block)]
        assert set(listed) <= set(range(count))
        if run == "two":
            assert 1 in listed
    assert html_module.escape(benchmark.pick([0, 1]).pairs[1].good) in page
