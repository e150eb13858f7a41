"""``tatblimp compare`` tables and the acquisition step."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest

from conftest import tiny_llama
from tatblimp_callback.cli import main
from tatblimp_callback.commands.compare import (
    CompareError,
    compare_runs,
    format_markdown,
    format_text,
    load_run,
    load_runs,
    to_json,
)
from tatblimp_callback.results.curves import acquisition_step, acquisition_steps
from test_stats import wilson


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
        {
            "step": 0,
            "tatblimp/acc_norm": 0.9,
            "tatblimp/a/acc_norm": 0.2,
            "tatblimp/a/acc": 0.99,
            "tatblimp/b/acc_norm": 0.5,
            "tatblimp/eval_seconds": 1.0,
        },
        {"step": 100, "tatblimp/acc_norm": 0.9, "tatblimp/a/acc_norm": 0.8, "tatblimp/a/acc": 0.1, "tatblimp/b/acc_norm": 0.7},
        {"step": 200, "tatblimp/acc_norm": 0.9, "tatblimp/a/acc_norm": 0.9, "tatblimp/a/acc": 0.1, "tatblimp/b/acc_norm": 0.74},
    ]
    assert acquisition_steps(history) == {"a": 100, "b": None}
    assert acquisition_steps(history, threshold=0.5) == {"a": 100, "b": 0}
    assert acquisition_steps(history, metric="acc", threshold=0.5) == {"a": None}


def test_acquisition_by_the_lower_bound():
    history = [
        {
            "step": 0,
            "tatblimp/a/acc_norm": 0.8,
            "tatblimp/a/acc_norm_ci_low": 0.70,
            "tatblimp/b/acc_norm": 0.9,
            "tatblimp/b/acc_norm_ci_low": 0.8,
        },
        {
            "step": 100,
            "tatblimp/a/acc_norm": 0.9,
            "tatblimp/a/acc_norm_ci_low": 0.76,
            "tatblimp/b/acc_norm": 0.8,
            "tatblimp/b/acc_norm_ci_low": 0.7,
        },
        {
            "step": 200,
            "tatblimp/a/acc_norm": 0.9,
            "tatblimp/a/acc_norm_ci_low": 0.80,
            "tatblimp/b/acc_norm": 0.9,
            "tatblimp/b/acc_norm_ci_low": 0.8,
        },
    ]
    assert acquisition_steps(history) == {"a": 0, "b": 0}
    assert acquisition_steps(history, use_lower_bound=True) == {"a": 100, "b": 200}
    with pytest.raises(ValueError, match=r"no interval \(tatblimp/a/acc_norm_ci_low\) at step\(s\) \[300\]"):
        acquisition_steps([*history, {"step": 300, "tatblimp/a/acc_norm": 0.9}], use_lower_bound=True)


def result(acc, phenomena, step=None, md5="m", outcomes=True):
    """A record of 10 pairs per phenomenon: phenomenon acc_norm v passes its first 10 v pairs; acc passes the first 20 acc overall."""
    n = 10 * len(phenomena)
    acc_norm_outcomes = "".join("1" * round(10 * v) + "0" * (10 - round(10 * v)) for v in phenomena.values())
    acc_outcomes = "1" * round(n * acc) + "0" * (n - round(n * acc))
    record = {
        "acc": acc,
        "acc_norm": acc_norm_outcomes.count("1") / n if n else math.nan,
        "n": n,
        "bits_per_byte_good": 3.25,
        "tokens_per_byte": 0.3125,
        "benchmark": {"md5": md5},
        "phenomena": {name: {"n": 10, "acc": value, "acc_norm": value} for name, value in phenomena.items()},
    }
    record["acc_ci"], record["acc_norm_ci"] = list(wilson(round(n * acc), n)), list(wilson(acc_norm_outcomes.count("1"), n))
    for name, value in phenomena.items():
        record["phenomena"][name]["acc_norm_ci"] = list(wilson(round(10 * value), 10))
    if outcomes:
        record["outcomes"] = {
            "acc": acc_outcomes,
            "acc_norm": acc_norm_outcomes,
            "phenomenon_runs": [[name, 10] for name in phenomena],
        }
    if step is not None:
        record = {"step": step, "checkpoint": f"checkpoint-{step}", **record}
    return record


@pytest.fixture
def two_runs(tmp_path):
    sweep_dir = tmp_path / "small-vocab"
    sweep_dir.mkdir()
    lines = [
        result(0.5, {"agreement": 0.4, "binding": 0.6}, step=200),
        result(0.6, {"agreement": 0.8, "binding": 0.6}, step=100),
        result(0.7, {"agreement": 0.9, "binding": 0.7}, step=300),
    ]
    (sweep_dir / "tatblimp.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    score = tmp_path / "big-vocab.json"
    score.write_text(json.dumps(result(0.55, {"agreement": 0.0, "binding": 0.7})))
    return sweep_dir / "tatblimp.jsonl", score


def cells(text: str) -> dict[str, list[str]]:
    """The rows of a text table before the acquisition section: name -> cells split at two spaces."""
    rows = {}
    for line in text.split("acquired (")[0].split("\n\n")[0].splitlines():
        if line and not line.startswith("-"):
            parts = [part.strip() for part in re.split(r"\s{2,}", line.strip())]
            rows[parts[0]] = parts[1:]
    return rows


def test_text_and_markdown_tables_for_two_runs(two_runs):
    runs = load_runs(list(two_runs))
    assert [run.label for run in runs] == ["small-vocab", "big-vocab"]
    assert [r["step"] for r in runs[0].records] == [100, 200, 300]  # sorted by step
    text = format_text(runs)
    rows = cells(text)
    assert rows["step"] == ["300", "-"]
    acc_low, acc_high = wilson(14, 20)
    assert rows["acc"] == [f"0.7000 [{acc_low:.3f}, {acc_high:.3f}]", "0.5500 [0.342, 0.742]"]
    assert rows["acc_norm"][0] == "0.8000 [0.584, 0.919]"
    assert rows["bits/byte (good)"] == ["3.250", "3.250"]
    assert rows["tokens/byte"] == ["0.3125", "0.3125"]
    # agreement: 9/10 against 0/10, nine pairs one way: p = 2/2**9, BH over two phenomena: 2 * p / 1 -> significant.
    assert rows["agreement"] == ["0.9000 [0.596, 0.982]", "0.0000 [0.000, 0.278] *"]
    assert rows["binding"] == ["0.7000 [0.397, 0.892]", "0.7000 [0.397, 0.892]"]
    # agreement: 0.8 at step 100, 0.4 at 200, 0.9 at 300 -> acquired at 300; binding never reaches 0.75.
    acquisition = text.split("acquired (>= 0.75)")[1].split("\n\n")[0]
    assert [line.split() for line in acquisition.splitlines() if line.strip() and not line.startswith("-")] == [
        ["agreement", "300", "n/a"],
        ["binding", "never", "n/a"],
    ]
    paired = text.split("paired, acc_norm: big-vocab against small-vocab (baseline)")[1].split("\n\n")[0]
    rows = {line.split()[0]: line.split()[1:] for line in paired.splitlines()[3:]}
    assert rows["overall"] == ["20", "9", "0", "-0.4500", "3.9e-03", "3.9e-03", "*"]
    assert rows["agreement"] == ["10", "9", "0", "-0.9000", "3.9e-03", "7.8e-03", "*"]
    assert rows["binding"] == ["10", "0", "0", "+0.0000", "1.000", "1.000"]

    markdown = format_markdown(runs)
    assert "| metric | small-vocab | big-vocab |" in markdown
    assert "| acc_norm | 0.8000 [0.584, 0.919] | 0.3500 [0.181, 0.567] * |" in markdown
    assert "| agreement | 300 | n/a |" in markdown
    assert "### Paired, acc_norm: big-vocab against small-vocab (baseline)" in markdown
    assert "| agreement | 10 | 9 | 0 | -0.9000 | 3.9e-03 | 7.8e-03 | * |" in markdown
    assert "not comparable" not in markdown


def test_different_benchmarks_or_missing_outcomes_are_refused_unless_side_by_side(tmp_path, capsys):
    for folder, md5 in (("a", "x"), ("b", "y")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "r.json").write_text(json.dumps(result(0.5, {"p": 0.5}, md5=md5)))
    paths = [tmp_path / "a" / "r.json", tmp_path / "b" / "r.json"]
    runs = load_runs(paths)
    assert [run.label for run in runs] == ["a/r", "b/r"] and runs[0].path == paths[0]
    with pytest.raises(CompareError, match=r"different benchmark files \(md5 .*a/r.json: x, .*b/r.json: y\)"):
        compare_runs(runs)
    side_by_side = format_text(compare_runs(runs, paired=False))
    assert "not comparable" in side_by_side and "paired" not in side_by_side
    assert "acquired" not in side_by_side  # no sweep: no acquisition section
    assert main(["compare", *map(str, paths)]) == 1
    assert "different benchmark files" in capsys.readouterr().err
    assert main(["compare", *map(str, paths), "--no-paired"]) == 0

    (tmp_path / "old.json").write_text(json.dumps(result(0.5, {"p": 0.5}, outcomes=False)))
    (tmp_path / "new.json").write_text(json.dumps(result(0.5, {"p": 0.5})))
    with pytest.raises(CompareError, match=r"old.json: no per-pair outcomes .*--no-paired"):
        compare_runs(load_runs([tmp_path / "new.json", tmp_path / "old.json"]))
    bad = result(0.5, {"p": 0.5})
    bad["outcomes"]["acc_norm"] = "1" * 10  # says 0.5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(CompareError, match=r"bad.json: its outcomes give acc_norm 1.000000 but it says 0.500000"):
        compare_runs(load_runs([tmp_path / "new.json", tmp_path / "bad.json"]))
    with pytest.raises(CompareError, match=r"--baseline nope: no such run \(labels: new, bad\)"):
        compare_runs(load_runs([tmp_path / "new.json", tmp_path / "bad.json"]), baseline="nope")


def test_steps_of_one_sweep_and_baseline_choice(two_runs, tmp_path):
    sweep_file, score = two_runs
    runs = load_runs([f"{sweep_file}@100", f"{sweep_file}@300", score])
    assert [run.label for run in runs] == ["small-vocab@100", "small-vocab@300", "big-vocab"]
    assert [run.record["step"] for run in runs[:2]] == [100, 300]
    comparison = compare_runs(runs, baseline="small-vocab@300")
    as_json = to_json(comparison)
    # step 100 -> 300: agreement 8/10 -> 9/10 (one pair), binding 6 -> 7 (one pair).
    overall = [
        p for p in as_json["paired"] if p["run"] == "small-vocab@100" and p["metric"] == "acc_norm" and p["group"] == "overall"
    ]
    assert overall == [
        {
            "baseline": "small-vocab@300",
            "run": "small-vocab@100",
            "metric": "acc_norm",
            "group": "overall",
            "n": 20,
            "baseline_only": 2,
            "run_only": 0,
            "p_value": 0.5,
            "p_adjusted": 0.5,
            "baseline_only_pairs": [8, 16],  # agreement passes 9 -> 8 of 10 (pair 8), binding 7 -> 6 (pair 16)
            "run_only_pairs": [],
        }
    ]
    assert {p["run"] for p in as_json["paired"]} == {"small-vocab@100", "big-vocab"} and len(as_json["paired"]) == 2 * 2 * 3
    assert [r["label"] for r in as_json["runs"]] == ["small-vocab@100", "small-vocab@300", "big-vocab"]
    assert as_json["runs"][0]["acc_norm"] == 0.7 and as_json["runs"][0]["phenomena"]["agreement"]["n"] == 10

    assert [run.record["step"] for run in load_runs([sweep_file], step=200)] == [200]
    with pytest.raises(CompareError, match=r"no step 250 \(steps: 100, 200, 300\)"):
        load_runs([sweep_file], step=250)
    with pytest.raises(CompareError, match="not from a single result"):
        load_runs([f"{score}@5"])
    with pytest.raises(CompareError, match="none of the results is one"):
        load_runs([score], step=5)


def test_a_one_line_sweep_and_the_callback_history_file(tmp_path):
    folder = tmp_path / "my-run"
    folder.mkdir()
    history = folder / "tatblimp_history.jsonl"
    lines = [{"step": s, **{k: v for k, v in result(0.5, {"p": v}).items()}} for s, v in ((0, 0.3), (50, 0.9))]
    history.write_text(json.dumps(lines[0]) + "\n")
    run = load_run(history)
    assert run.is_sweep and run.label == "my-run" and run.record["step"] == 0
    history.write_text("".join(json.dumps(line) + "\n" for line in lines))
    runs = load_runs([f"{history}@0", history])
    assert [run.label for run in runs] == ["my-run@0", "my-run"]
    (test,) = [t for t in compare_runs(runs).tests["my-run"] if t.metric == "acc_norm" and t.group == "p"]
    assert (test.n, test.baseline_only, test.run_only) == (10, 0, 6)


def test_bad_files_are_named(tmp_path):
    (tmp_path / "x.json").write_text('{"acc": 1}')
    with pytest.raises(CompareError, match=r"x.json: not TatBLiMP results"):
        load_run(tmp_path / "x.json")
    (tmp_path / "y.jsonl").write_text(json.dumps(result(0.5, {"p": 0.5}, step=1)) + "\n{oops\n")
    with pytest.raises(CompareError, match=r"y.jsonl:2: neither a results JSON"):
        load_run(tmp_path / "y.jsonl")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(acc="abc"), 'acc is "abc", not a number'),
        (lambda r: r.update(acc_norm=None), "acc_norm is null, not a number"),
        (lambda r: r.update(n=-5), "n is -5, not a count"),
        (lambda r: r["phenomena"]["p"].update(acc=True), "phenomena.p.acc is true, not a number"),
        (lambda r: r.update(phenomena=[1, 2]), "malformed phenomena"),
        (lambda r: r["phenomena"].update(p="x"), "malformed phenomena"),
        (lambda r: r.update(benchmark="x"), "malformed benchmark"),
    ],
)
def test_a_hand_edited_results_file_is_named_with_its_field(tmp_path, edit, message):
    """compare and report stopped with Python's own words, naming no file or field (``must be real number, not str``,
    ``'list' object has no attribute 'get'``, ``Unknown format code 'f'``), or took a negative count."""
    record = result(0.5, {"p": 0.5})
    edit(record)
    (tmp_path / "x.json").write_text(json.dumps(record))
    with pytest.raises(CompareError, match=f"^{re.escape(str(tmp_path / 'x.json'))}: {re.escape(message)}"):
        load_run(tmp_path / "x.json")


def test_a_sweep_being_written_is_read_up_to_its_last_complete_line(tmp_path, caplog):
    path = tmp_path / "tatblimp.jsonl"
    complete = "".join(json.dumps(result(0.5, {"p": v}, step=s)) + "\n" for s, v in ((100, 0.3), (200, 0.6)))
    partial = json.dumps(result(0.5, {"p": 0.9}, step=300))[:40]
    path.write_text(complete + partial)
    with caplog.at_level(logging.WARNING):
        run = load_run(path)
    assert [r["step"] for r in run.records] == [100, 200] and run.record["step"] == 200
    assert "tatblimp.jsonl:3 is a partial line" in caplog.text
    assert path.read_text() == complete + partial  # another process is writing it: not cut


def test_cli_compare_writes_markdown_json_and_plot(two_runs, tmp_path, capsys):
    code = main(
        [
            "compare",
            *map(str, two_runs),
            "--markdown",
            str(tmp_path / "t.md"),
            "--plot",
            str(tmp_path / "c.png"),
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "small-vocab" in out and "big-vocab" in out and "paired, acc: big-vocab against small-vocab" in out
    assert (tmp_path / "t.md").read_text().startswith("## TatBLiMP comparison")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    as_json = json.loads((tmp_path / "c.json").read_text())
    assert set(as_json) == {"runs", "paired", "learning", "learning_order", "by_edit"}  # learning*: a sweep's fits
    assert as_json["learning"]["small-vocab"]["acquisition_fits"]["agreement"]["status"] == "not enough evaluations"
    # Only single scores: nothing to draw over steps.
    code = main(["compare", str(two_runs[1]), "--plot", str(tmp_path / "d.png")])
    assert code == 1 and "at least one sweep file" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json")]) == 1
    assert "missing.json: cannot read" in capsys.readouterr().err


def test_cli_compare_on_two_real_score_files(tmp_path, bpe_tokenizer, small_data, capsys):
    from test_stats import benjamini_hochberg, exact_mcnemar

    scores = []
    for seed in (1, 2):
        folder = tmp_path / f"seed{seed}"
        tiny_llama(len(bpe_tokenizer), seed=seed).save_pretrained(folder)
        bpe_tokenizer.save_pretrained(folder)
        scores.append(tmp_path / f"seed{seed}.json")
        assert (
            main(
                [
                    "score",
                    str(folder),
                    "--data",
                    str(small_data),
                    "--allow-modified",
                    "--device",
                    "cpu",
                    "--output",
                    str(scores[-1]),
                ]
            )
            == 0
        )
    capsys.readouterr()
    assert main(["compare", *map(str, scores), "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "paired, acc_norm: seed2 against seed1 (baseline)" in out and "paired, acc: seed2 against seed1 (baseline)" in out
    written = json.loads((tmp_path / "c.json").read_text())
    assert [set(run) for run in written["runs"]] == [
        {"label", "path", "acc", "acc_ci", "acc_norm", "acc_norm_ci", "phenomena"}
    ] * 2
    assert all(
        set(g) == {"acc", "acc_ci", "acc_norm", "acc_norm_ci", "n"} for run in written["runs"] for g in run["phenomena"].values()
    )
    assert len(written["paired"]) == 2 * 17

    # Independently, from the per-pair log-probs in the two score files.
    pairs = [json.loads(path.read_text())["pairs"] for path in scores]
    for run, path in zip(written["runs"], scores):
        record = json.loads(path.read_text())
        k = sum(p["good_logprob"] / p["good_bytes"] > p["bad_logprob"] / p["bad_bytes"] for p in record["pairs"])
        assert run["acc_norm"] == k / 48 and run["acc_norm_ci"] == pytest.approx(list(wilson(k, 48)), abs=1e-12)
    for metric, passes in (
        ("acc", lambda p: p["good_logprob"] > p["bad_logprob"]),
        ("acc_norm", lambda p: p["good_logprob"] / p["good_bytes"] > p["bad_logprob"] / p["bad_bytes"]),
    ):
        groups = {"overall": range(48)}
        for i, pair in enumerate(pairs[0]):
            groups.setdefault(pair["phenomenon"], []).append(i)
        expected = {}
        for group, indices in groups.items():
            b = sum(passes(pairs[0][i]) and not passes(pairs[1][i]) for i in indices)
            c = sum(passes(pairs[1][i]) and not passes(pairs[0][i]) for i in indices)
            expected[group] = (len(indices), b, c, exact_mcnemar(b, c))
        adjusted = dict(zip(list(groups)[1:], benjamini_hochberg([expected[g][3] for g in list(groups)[1:]])))
        adjusted["overall"] = expected["overall"][3]
        got = [p for p in written["paired"] if p["metric"] == metric]
        assert [p["group"] for p in got] == list(groups)
        for p in got:
            assert (p["baseline"], p["run"]) == ("seed1", "seed2")
            assert (p["n"], p["baseline_only"], p["run_only"]) == expected[p["group"]][:3]
            assert p["p_value"] == pytest.approx(expected[p["group"]][3]) and p["p_adjusted"] == pytest.approx(
                adjusted[p["group"]]
            )
        assert sum(p["baseline_only"] + p["run_only"] for p in got[1:]) > 0  # two seeds disagree somewhere

    # Results written before outcomes were recorded, with their per-pair list: the outcomes are read from it.
    record = json.loads(scores[1].read_text())
    del record["outcomes"]
    scores[1].write_text(json.dumps(record))
    assert main(["compare", *map(str, scores), "--json", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text()) == written
