"""``tatblimp compare`` tables and the acquisition step."""

from __future__ import annotations

import json
import math

import pytest

from tatblimp_callback.cli import main
from tatblimp_callback.compare import CompareError, format_markdown, format_text, load_run, load_runs
from tatblimp_callback.curves import acquisition_step, acquisition_steps


@pytest.mark.parametrize(
    "points, expected",
    [
        ([(10, 0.5), (20, 0.8), (30, 0.9)], 20),
        ([(30, 0.9), (10, 0.5), (20, 0.8)], 20),  # any order: sorted by step
        ([(10, 0.8), (20, 0.7), (30, 0.8), (40, 0.9)], 30),  # a dip restarts the count
        ([(10, 0.8), (20, 0.9), (30, 0.6)], None),  # below at the last evaluation: not acquired
        ([(10, 0.75)], 10),  # reaching the threshold exactly counts
        ([(10, 0.7499)], None),
        ([(10, 0.8), (20, math.nan), (30, 0.8)], 30),  # NaN counts as below
        ([(0, 0.9), (5, 0.95)], 0),  # acquired from the untrained baseline on
        ([], None),
    ],
)
def test_acquisition_step(points, expected):
    assert acquisition_step(points, threshold=0.75) == expected


def test_acquisition_steps_reads_the_phenomenon_curves_of_a_history():
    history = [
        {"step": 0, "tatblimp/acc_norm": 0.9, "tatblimp/a/acc_norm": 0.2, "tatblimp/a/acc": 0.99, "tatblimp/b/acc_norm": 0.5, "tatblimp/eval_seconds": 1.0},
        {"step": 100, "tatblimp/acc_norm": 0.9, "tatblimp/a/acc_norm": 0.8, "tatblimp/a/acc": 0.1, "tatblimp/b/acc_norm": 0.7},
        {"step": 200, "tatblimp/acc_norm": 0.9, "tatblimp/a/acc_norm": 0.9, "tatblimp/a/acc": 0.1, "tatblimp/b/acc_norm": 0.74},
    ]
    assert acquisition_steps(history) == {"a": 100, "b": None}
    assert acquisition_steps(history, threshold=0.5) == {"a": 100, "b": 0}
    assert acquisition_steps(history, metric="acc", threshold=0.5) == {"a": None}


def result(acc, acc_norm, phenomena, step=None, md5="m"):
    record = {
        "acc": acc,
        "acc_norm": acc_norm,
        "n": 10,
        "bits_per_byte_good": 3.25,
        "tokens_per_byte": 0.3125,
        "benchmark": {"md5": md5},
        "phenomena": {name: {"n": 5, "acc": value, "acc_norm": value} for name, value in phenomena.items()},
    }
    if step is not None:
        record = {"step": step, "checkpoint": f"checkpoint-{step}", **record}
    return record


@pytest.fixture
def two_runs(tmp_path):
    sweep_dir = tmp_path / "small-vocab"
    sweep_dir.mkdir()
    lines = [
        result(0.5, 0.5, {"agreement": 0.4, "binding": 0.6}, step=200),
        result(0.6, 0.7, {"agreement": 0.8, "binding": 0.6}, step=100),
        result(0.7, 0.8, {"agreement": 0.9, "binding": 0.7}, step=300),
    ]
    (sweep_dir / "tatblimp.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    score = tmp_path / "big-vocab.json"
    score.write_text(json.dumps(result(0.55, 0.65, {"agreement": 0.6, "binding": 0.75})))
    return sweep_dir / "tatblimp.jsonl", score


def test_text_and_markdown_tables_for_two_runs(two_runs):
    runs = load_runs(list(two_runs))
    assert [run.label for run in runs] == ["small-vocab", "big-vocab"]
    assert [r["step"] for r in runs[0].records] == [100, 200, 300]  # sorted by step
    text = format_text(runs)
    metric_lines = text.split("acquired (>= 0.75)")[0].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in metric_lines if line and not line.startswith("-")}
    assert rows["step"] == ["300", "-"]
    assert rows["acc"] == ["0.7000", "0.5500"]
    assert rows["acc_norm"] == ["0.8000", "0.6500"]
    assert rows["bits/byte"] == ["(good)", "3.250", "3.250"]
    assert rows["tokens/byte"] == ["0.3125", "0.3125"]
    assert rows["agreement"][:2] == ["0.9000", "0.6000"]
    # agreement: 0.8 at step 100, 0.4 at 200, 0.9 at 300 -> acquired at 300; binding never reaches 0.75.
    acquisition = text.split("acquired (>= 0.75)")[1]
    assert [line.split() for line in acquisition.splitlines() if line.strip()] == [["agreement", "300", "n/a"], ["binding", "never", "n/a"]]

    markdown = format_markdown(runs)
    assert "| metric | small-vocab | big-vocab |" in markdown
    assert "| acc_norm | 0.8000 | 0.6500 |" in markdown
    assert "| binding | 0.7000 | 0.7500 |" in markdown
    assert "| agreement | 300 | n/a |" in markdown
    assert "not comparable" not in markdown


def test_different_benchmarks_are_flagged_and_labels_disambiguated(tmp_path):
    for folder, md5 in (("a", "x"), ("b", "y")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "r.json").write_text(json.dumps(result(0.5, 0.5, {"p": 0.5}, md5=md5)))
    runs = load_runs([tmp_path / "a" / "r.json", tmp_path / "b" / "r.json"])
    assert [run.label for run in runs] == [str(tmp_path / "a" / "r.json"), str(tmp_path / "b" / "r.json")]
    assert "not comparable" in format_text(runs)
    assert "acquired" not in format_text(runs)  # no sweep: no acquisition section


def test_bad_files_are_named(tmp_path):
    (tmp_path / "x.json").write_text('{"acc": 1}')
    with pytest.raises(CompareError, match=r"x.json: not TatBLiMP results"):
        load_run(tmp_path / "x.json")
    (tmp_path / "y.jsonl").write_text(json.dumps(result(0.5, 0.5, {}, step=1)) + "\n{oops\n")
    with pytest.raises(CompareError, match=r"y.jsonl:2: neither a results JSON"):
        load_run(tmp_path / "y.jsonl")


def test_cli_compare_writes_markdown_and_plot(two_runs, tmp_path, capsys):
    code = main(["compare", *map(str, two_runs), "--markdown", str(tmp_path / "t.md"), "--plot", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert code == 0 and "small-vocab" in out and "big-vocab" in out
    assert (tmp_path / "t.md").read_text().startswith("## TatBLiMP comparison")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # Only single scores: nothing to draw over steps.
    code = main(["compare", str(two_runs[1]), "--plot", str(tmp_path / "d.png")])
    assert code == 1 and "at least one sweep file" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json")]) == 1
    assert "missing.json: cannot read" in capsys.readouterr().err
