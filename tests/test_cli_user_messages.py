"""A new user's mistakes from issue #53, each answered by one line that names what was given and what to do."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import DATA
from tatblimp_callback.cli import main

DEMO = Path(__file__).parent / "data" / "demo_history.jsonl"
PHENOMENA = list(dict.fromkeys(json.loads(line)["phenomenon"] for line in DATA.read_text(encoding="utf-8").splitlines()))
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


def error_of(args, capsys, status: int = 1) -> str:
    assert main(args) == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.split(": error: ", 1)[1].rstrip("\n")


def test_a_file_that_is_not_text_is_named_with_what_was_expected(tmp_path, capsys):
    image = tmp_path / "acc_norm.png"
    image.write_bytes(PNG)
    expected = (
        f"{image}:1: not UTF-8 text (byte 0x89 at 0); expected TatBLiMP results: a score --output JSON file, "
        "or JSON lines of a sweep or a callback history"
    )
    assert error_of(["compare", str(DEMO), str(image)], capsys) == expected
    assert error_of(["report", str(DEMO), str(image), "--output", str(tmp_path / "r.html")], capsys) == expected


def test_a_byte_order_mark_is_read_past_in_results_and_named_in_a_benchmark(tmp_path, capsys):
    marked = tmp_path / "run" / "tatblimp_history.jsonl"
    marked.parent.mkdir()
    marked.write_bytes(b"\xef\xbb\xbf" + DEMO.read_bytes())  # as Notepad saves "UTF-8 with BOM"
    out = tmp_path / "c.json"
    assert main(["compare", str(DEMO), str(marked), "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [run["label"] for run in runs] == ["demo_history", "run"]
    # A benchmark file (md5-pinned) is not read past one: the error says how to save it, on whichever line it is.
    from tatblimp_callback.reading.data import BenchmarkError, parse_pairs

    first, rest = DATA.read_bytes().split(b"\n", 1)
    fix = "invalid JSON (a byte-order mark starts the line; save the file as UTF-8 without a byte-order mark)"
    for raw, line in ((b"\xef\xbb\xbf" + first + b"\n" + rest, 1), (first + b"\n\xef\xbb\xbf" + rest, 2)):
        with pytest.raises(BenchmarkError) as error:
            parse_pairs(raw, "b.jsonl")
        assert str(error.value) == f"b.jsonl:{line}: {fix}"  # was: "Unexpected UTF-8 BOM (decode using utf-8-sig)"
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + DATA.read_bytes())
    assert error_of(["tokenizers", "gpt2", "--data", str(bom), "--allow-modified"], capsys) == f"{bom}:1: {fix}"


def test_a_run_folder_given_for_a_model_names_its_checkpoints(model_dir, tmp_path, capsys):
    run = tmp_path / "runs" / "tiny-tatar"
    for step in (200, 400, 1000):
        shutil.copytree(model_dir, run / f"checkpoint-{step}")
    expected = (
        f"{run}: a training run's folder with 3 checkpoint(s) (checkpoint-200, checkpoint-400, checkpoint-1000), not a "
        f"model folder; give one checkpoint's folder ({run / 'checkpoint-1000'}), or score them all with "
        f"`tatblimp sweep {run}`"
    )
    data = ["--data", str(DATA)]
    assert error_of(["score", str(run), *data], capsys) == expected  # was: "has no tokenizer ... pass --tokenizer"
    assert error_of(["score", str(run), "--tokenizer", str(model_dir), *data], capsys) == expected  # was: "no config.json"
    assert error_of(["explain", str(run), "--pair", "0", *data], capsys) == expected
    report = ["report", str(DEMO), "--model", str(run), "--output", str(tmp_path / "r.html"), *data]
    assert error_of(report, capsys) == expected


def test_sweep_names_a_missing_folder_and_an_empty_revision_list(tmp_path, capsys):
    assert error_of(["sweep", str(tmp_path / "runs" / "nope"), "--data", str(DATA)], capsys) == (
        f"{tmp_path / 'runs' / 'nope'}: no such folder"
    )
    (tmp_path / "a-file").write_text("x")
    assert error_of(["sweep", str(tmp_path / "a-file"), "--data", str(DATA)], capsys) == (
        f"{tmp_path / 'a-file'}: a file, not a run folder"
    )
    assert error_of(["sweep", "EleutherAI/pythia-160m", "--revisions", "", "--data", str(DATA)], capsys) == (
        "--revisions '' names no revision: give names or globs, e.g. --revisions 'step*'"
    )
    assert error_of(["sweep", "EleutherAI/pythia-160m", "--revisions", " , ", "--data", str(DATA)], capsys) == (
        "--revisions ' , ' names no revision: give names or globs, e.g. --revisions 'step*'"
    )
    assert error_of(["sweep", "EleutherAI/pythia-160m", "--revisions", "main,step[", "--data", str(DATA)], capsys) == (
        "--revisions 'main,step[': the pattern 'step[' is malformed, a [ without its ] (a set of characters is [0-9]; "
        "the globs are * and ?)"
    )


def test_report_with_a_model_shows_its_progress(model_dir, tmp_path, capsys):
    from tatblimp_callback.reports.report import report_pairs
    from tatblimp_callback.results.runs import load_runs

    listed = len(set(report_pairs(load_runs([DEMO]))))
    assert listed > 500  # minutes with a real model: worth a bar
    command = ["report", str(DEMO), "--model", str(model_dir), "--data", str(DATA), "--device", "cpu"]
    assert main([*command, "--output", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"tatblimp report: loading {model_dir} to score the {listed} pairs listed\n")
    updates = re.findall(r"tatblimp scoring pairs: +(\d+)%\|[^|]*\| (\d+)/(\d+)", err)
    assert updates[-1] == ("100", str(listed), str(listed))
    assert len({done for _, done, _ in updates}) >= 10  # it moves while it scores, not only at the end
    assert main([*command, "--output", str(tmp_path / "quiet.html"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    # The page lists the same tokens, their surprisals shown to the tenth of a bit: scored in parts, a sum may differ
    # in its last float32 digits (as scoring a subset of the benchmark already does), so a shown value by 0.1 at most.
    pages = [(tmp_path / name).read_text(encoding="utf-8") for name in ("r.html", "quiet.html")]
    shown = [[float(v) for v in re.findall(r"<b>(-?[\d.]+)</b>", page)] for page in pages]
    assert len(shown[0]) == len(shown[1]) > 10 * listed
    assert max(abs(a - b) for a, b in zip(*shown)) <= 0.1 + 1e-9


def test_tokenizers_include_pairs_without_output_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tokenizers", str(tmp_path / "no-such-tokenizer"), "--data", str(DATA), "--include-pairs"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tatblimp tokenizers ")  # the subcommand's usage, found before any tokenizer is read
    assert err.splitlines()[-1] == (
        "tatblimp tokenizers: error: --include-pairs goes with --output (the per-pair figures are written to that JSON file only)"
    )


def test_a_watching_sweep_says_once_what_it_waits_for(tmp_path, capsys):
    run = tmp_path / "runs" / "tiny-tatar"
    run.mkdir(parents=True)  # training has not saved its first checkpoint yet
    assert main(["sweep", str(run), "--data", str(DATA), "--watch", "--interval", "0.1", "--max-wait", "1"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"tatblimp sweep: watching {run} for new checkpoints (every 0.1 s; stops after 1 s without one)"
    assert len(err) == 2 and err[1].startswith(f"tatblimp sweep: error: {run}: no checkpoints found")  # ~10 polls, said once
    assert (
        main(["sweep", str(run), "--data", str(DATA), "--watch", "--interval", "0.1", "--max-wait", "0.3", "--no-progress"]) == 1
    )
    assert len(capsys.readouterr().err.splitlines()) == 1  # --no-progress: quiet


def test_a_mistyped_phenomenon_gets_a_did_you_mean(model_dir, capsys):
    data = ["--data", str(DATA)]
    assert error_of(["score", str(model_dir), "--phenomena", "bindng,passives", *data], capsys) == (
        f"{DATA}: no phenomenon bindng (did you mean binding?) (phenomena: {', '.join(PHENOMENA)})"
    )
    assert error_of(["explain", str(model_dir), "--phenomenon", "quantifers", "--worst", "2", *data], capsys) == (
        f"--phenomenon quantifers: no such phenomenon (did you mean quantifiers?) ({', '.join(PHENOMENA)})"
    )
    assert error_of(["score", str(model_dir), "--phenomena", "xyz", *data], capsys) == (
        f"{DATA}: no phenomenon xyz (phenomena: {', '.join(PHENOMENA)})"  # nothing close: no guess
    )
