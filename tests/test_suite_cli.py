"""``tatblimp score/sweep --suite`` and ``compare`` per suite, end to end on a saved tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DATA, SHARED, tiny_llama
from tatblimp_callback.cli import main

IDENTICAL_LINE = 25  # passive_1.jsonl line 325 of BLiMP, an identical pair, is line 25 of the copy


@pytest.fixture(scope="module")
def suite_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("blimp")
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")
    (folder / "passive_1.jsonl").write_text("\n".join(lines[300:330]) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def own_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("own") / "mine.csv"
    path.write_text("ID;OK;BAD\n1;Мин барам.;Мин барасың.\n2;Алар килде.;Алар килдем.\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, bpe_tokenizer) -> list[Path]:
    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"model{seed}")
        tiny_llama(len(bpe_tokenizer), seed=seed).save_pretrained(folder)
        bpe_tokenizer.save_pretrained(folder)
        folders.append(folder)
    return folders


def test_score_with_suites_writes_them_beside_tatblimp_and_compare_compares_each(
    model_dirs, small_data, suite_folder, own_csv, tmp_path, capsys
):
    outputs = []
    for i, folder in enumerate(model_dirs):
        out = tmp_path / f"run{i}.json"
        args = ["score", str(folder), "--data", str(small_data), "--allow-modified", "--device", "cpu", "--output", str(out)]
        args += ["--suite", f"blimp={suite_folder}", "--suite", f"mine={own_csv}", "--columns", "mine:good=OK,bad=BAD"]
        assert main(args) == 0
        outputs.append(out)
    printed = capsys.readouterr().out
    assert f"suite blimp: {suite_folder}" in printed and f"suite mine: {own_csv}" in printed
    assert "1 pairs left out of the metrics (the good and bad sentences are identical)" in printed

    record = json.loads(outputs[0].read_text())
    assert record["n"] == 48 and "left_out" not in record  # TatBLiMP's results at the top level, as before
    assert list(record["suites"]) == ["blimp", "mine"]
    blimp = record["suites"]["blimp"]
    assert blimp["n"] == 29 and len(blimp["pairs"]) == 29 and len(blimp["outcomes"]["acc_norm"]) == 29
    assert blimp["left_out"] == [
        {
            "file": str(suite_folder / "passive_1.jsonl"),
            "line": IDENTICAL_LINE,
            "reason": "the good and bad sentences are identical",
        }
    ]
    assert record["suites"]["mine"]["n"] == 2 and record["suites"]["mine"]["phenomena"].keys() == {"mine"}

    assert (
        main(["compare", *map(str, outputs), "--json", str(tmp_path / "cmp.json"), "--markdown", str(tmp_path / "cmp.md")]) == 0
    )
    printed = capsys.readouterr().out
    assert "suite blimp" in printed and "suite mine" in printed
    comparison = json.loads((tmp_path / "cmp.json").read_text())
    assert set(comparison["suites"]) == {"blimp", "mine"}
    # Paired tests per suite, over that suite's pairs.
    overall = next(t for t in comparison["suites"]["blimp"]["paired"] if t["group"] == "overall" and t["metric"] == "acc_norm")
    assert overall["n"] == 29
    assert "## Suite blimp" in (tmp_path / "cmp.md").read_text()


def test_a_suite_scored_alone(model_dirs, suite_folder, tmp_path, capsys):
    out = tmp_path / "alone.json"
    assert (
        main(
            [
                "score",
                str(model_dirs[0]),
                "--device",
                "cpu",
                "--suites-only",
                "--suite",
                f"blimp={suite_folder}",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert record["n"] == 29 and record["left_out"][0]["line"] == IDENTICAL_LINE and "suites" not in record
    assert record["benchmark"]["release"].startswith("blimp (md5 ")
    assert main(["score", str(model_dirs[0]), "--suites-only"]) == 1
    assert "--suites-only needs at least one --suite" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_with_suites_scores_them_as_score_does_and_refuses_other_suites(
    model_dirs, small_data, suite_folder, own_csv, tmp_path, capsys
):
    import os
    import shutil
    import subprocess
    import sys

    from trainer_utils import wandb_records

    run = tmp_path / "run"
    for step, folder in zip((10, 20), model_dirs):
        shutil.copytree(folder, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    suites = ["--suite", f"blimp={suite_folder}", "--suite", f"mine={own_csv}", "--columns", "mine:good=OK,bad=BAD"]
    common = ["--data", str(small_data), "--allow-modified", "--device", "cpu"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "tatblimp_callback", "sweep", str(run), *common, *suites]
    command += ["--interval", "0.1", "--no-progress", "--wandb-project", "p"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "tatblimp.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in lines] == [10, 20]

    for line, folder in zip(lines, model_dirs):  # the same numbers as `tatblimp score --suite` on that checkpoint
        out = tmp_path / f"{folder.name}.json"
        assert main(["score", str(folder), *common, *suites, "--output", str(out)]) == 0
        scored = json.loads(out.read_text(encoding="utf-8"))
        assert line["acc_norm"] == scored["acc_norm"] and "pairs" not in line and line["n"] == 48
        assert list(line["suites"]) == ["blimp", "mine"]
        for name, suite in line["suites"].items():
            expected = {k: v for k, v in scored["suites"][name].items() if k not in ("pairs", "tokenizer")}
            assert {k: v for k, v in suite.items() if k != "tokenizer"} == expected, name  # tokenizer: the checkpoint's copy
        assert line["suites"]["blimp"]["n"] == 29 and line["suites"]["blimp"]["left_out"][0]["line"] == IDENTICAL_LINE
    assert lines[0]["suites"]["blimp"]["outcomes"] != lines[1]["suites"]["blimp"]["outcomes"]  # two different models

    # Each suite its own wandb section over the checkpoint's step.
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    history = [r["history"]["item"] for r in wandb_records(str(wandb_run)) if r["type"] == "history"]
    assert [item["train/global_step"] for item in history if "blimp/acc_norm" in item] == [10, 20]
    assert [item["mine/acc"] for item in history] == [line["suites"]["mine"]["acc"] for line in lines]

    # compare reads the sweep's suites at two of its steps.
    capsys.readouterr()
    assert main(["compare", f"{run}/tatblimp.jsonl@10", f"{run}/tatblimp.jsonl@20", "--json", str(tmp_path / "cmp.json")]) == 0
    comparison = json.loads((tmp_path / "cmp.json").read_text())
    assert set(comparison["suites"]) == {"blimp", "mine"}
    overall = next(t for t in comparison["suites"]["blimp"]["paired"] if t["group"] == "overall" and t["metric"] == "acc_norm")
    assert overall["n"] == 29

    # A rerun with other suites would mix records of different suites in one file: refused, naming both.
    shutil.copytree(model_dirs[0], run / "checkpoint-30")
    assert main(["sweep", str(run), *common, "--suite", f"blimp={suite_folder}", "--interval", "0.1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    blimp_id, mine_id = (
        "md5 {md5}, fingerprint {fingerprint}".format(**lines[0]["suites"][name]["benchmark"]) for name in ("blimp", "mine")
    )
    assert f"checkpoint-10 was scored with blimp ({blimp_id}), mine ({mine_id}), this sweep asks for blimp ({blimp_id})" in err
    # The same names on an edited file are other suites too: known by md5, not by name.
    edited = tmp_path / "edited.csv"
    edited.write_bytes(own_csv.read_bytes() + "3;Мин килдем.;Мин килдең.\n".encode())
    edited_suites = [*suites[:3], f"mine={edited}", *suites[4:]]
    assert main(["sweep", str(run), *common, *edited_suites, "--interval", "0.1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"mine ({mine_id}), this sweep asks for blimp ({blimp_id}), mine (md5 " in err
    # And so are the same files read with another column mapping (#30: the md5 alone let it through).
    swapped = [*suites[:5], "mine:good=BAD,bad=OK"]
    assert main(["sweep", str(run), *common, *swapped, "--interval", "0.1", "--no-progress"]) == 1
    assert f"mine ({mine_id}), this sweep asks for blimp ({blimp_id}), mine (md5 {mine_id[4:36]}, fingerprint " in (
        capsys.readouterr().err
    )
    # And so is another TatBLiMP file.
    other_data = tmp_path / "other.jsonl"
    other_data.write_bytes(small_data.read_bytes().splitlines(keepends=True)[0] * 2)
    other = ["--data", str(other_data), *common[2:]]
    assert main(["sweep", str(run), *other, *suites, "--interval", "0.1", "--no-progress"]) == 1
    assert f"checkpoint-10 was scored on md5 {lines[0]['benchmark']['md5']}, fingerprint" in capsys.readouterr().err
    assert len((run / "tatblimp.jsonl").read_text().splitlines()) == 2


def test_suites_only_takes_limit_and_phenomena_and_is_marked_partial(model_dirs, tmp_path):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("passive_1", "adjunct_island"):
        lines = (SHARED / "blimp" / "data" / f"{name}.jsonl").read_text(encoding="utf-8").split("\n")[:20]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "limited.json"
    common = ["score", str(model_dirs[0]), "--device", "cpu", "--suites-only", "--suite", f"blimp={folder}"]
    assert main([*common, "--limit", "3", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    # Before: all 40 pairs scored, not marked partial.
    assert record["n"] == 6 and record["partial"] and record["selection"].startswith("first 3 pairs of each phenomenon")
    assert {name: group["n"] for name, group in record["phenomena"].items()} == {"island_effects": 3, "argument_structure": 3}
    assert main([*common, "--phenomena", "island_effects", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["n"] == 20 and list(record["phenomena"]) == ["island_effects"] and record["partial"]
    # Its release says partial too (it named the suite and md5 only), and --data, TatBLiMP's file, is refused.
    assert record["benchmark"]["release"].endswith(", partial: phenomena island_effects (20 of 40 pairs)")
    assert main([*common, "--data", str(tmp_path / "x.jsonl"), "--output", str(out)]) == 1

    # Beside TatBLiMP, a suite takes --limit too (it was scored whole: 67,000 pairs for BLiMP in "a quick run").
    tatblimp = ["score", str(model_dirs[0]), "--device", "cpu", "--data", str(DATA), "--suite", f"blimp={folder}"]
    assert main([*tatblimp, "--limit", "2", "--output", str(out)]) == 0
    suite = json.loads(out.read_text())["suites"]["blimp"]
    assert suite["n"] == 4 and suite["selection"] == "first 2 pairs of each phenomenon (4 of 40 pairs)"
