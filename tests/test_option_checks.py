"""Bad option values and unwritable output paths are refused before any work: a value out of range by the parser
(status 2, naming the option), an output folder that cannot be made or written in before the model loads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.commands.outputs import check_output_file, write_text

TATBLIMP = str(Path(sys.executable).parent / "tatblimp")


def usage_error(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["score", "m", "--limit", "0"], "argument --limit: must be a whole number of at least 1, got 0"),
        (["score", "m", "--limit", "-3"], "argument --limit: must be a whole number of at least 1, got -3"),
        (["score", "m", "--limit", "abc"], "argument --limit: must be a whole number of at least 1, got 'abc'"),
        (["score", "m", "--concurrency", "0"], "argument --concurrency: must be a whole number of at least 1, got 0"),
        (["score", "m", "--max-retries", "-1"], "argument --max-retries: must be a whole number of at least 0, got -1"),
        (["score", "m", "--timeout", "0"], "argument --timeout: must be a number above 0, got 0"),
        (["score", "m", "--timeout", "nan"], "argument --timeout: must be a number above 0, got 'nan'"),
        (["score", "m", "--memory-budget-mb", "0"], "argument --memory-budget-mb: must be a whole number of at least 1, got 0"),
        (["score", "m", "--prefix-token-id", "-1"], "argument --prefix-token-id: must be a whole number of at least 0, got -1"),
        (
            ["score", "m", "--gpu-memory-utilization", "1.5"],
            "argument --gpu-memory-utilization: must be a number above 0 and at most 1, got 1.5",
        ),
        (["score", "m", "--max-model-len", "1"], "argument --max-model-len: must be a whole number of at least 2, got 1"),
        (["score", "m", "--row-length", "0"], "argument --row-length: must be a whole number of at least 1, got 0"),
        (["sweep", "r", "--row-length", "-3"], "argument --row-length: must be a whole number of at least 1, got -3"),
        (
            ["score", "m", "--head-method", "chunks:0"],
            "argument --head-method: unknown head method 'chunks:0': expected 'tiles' or 'chunks:N' (N contexts a chunk, "
            "e.g. 'chunks:1024')",
        ),
        (
            ["score", "m", "--extra-body", "{bad"],
            "argument --extra-body: must be a JSON object, e.g. '{\"top_k\": 1}'; '{bad' is not JSON "
            "(Expecting property name enclosed in double quotes)",
        ),
        (["score", "m", "--extra-body", "[1]"], "argument --extra-body: must be a JSON object, e.g. '{\"top_k\": 1}', got [1]"),
        (["sweep", "r", "--threshold", "75"], "argument --threshold: must be a number from 0 to 1, got 75"),
        (["sweep", "r", "--interval", "-5"], "argument --interval: must be a number of at least 0, got -5"),
        (["sweep", "r", "--watch", "--max-wait", "-1"], "argument --max-wait: must be a number of at least 0, got -1"),
        (["compare", "a.json", "--step", "-1"], "argument --step: must be a whole number of at least 0, got -1"),
        (["explain", "m", "--pair", "-2"], "argument --pair: must be a whole number of at least 0, got -2"),
        (
            ["explain", "m", "--phenomenon", "binding", "--worst", "0"],
            "argument --worst: must be a whole number of at least 1, got 0",
        ),
        (
            ["report", "a.json", "--output", "r.html", "--steps", "0", "-1"],
            "argument --steps: must be a whole number of at least 0, got -1",
        ),
    ],
)
def test_a_value_out_of_range_is_a_usage_error_naming_the_option(args, message, capsys):
    assert usage_error(args, capsys) == f"tatblimp {args[0]}: error: {message}"


def test_limit_zero_costs_no_model_load_in_a_real_process(model_dir):
    start = time.monotonic()
    done = subprocess.run(
        [TATBLIMP, "score", str(model_dir), "--data", str(DATA), "--limit", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("usage: tatblimp score")
    assert done.stderr.splitlines()[-1] == "tatblimp score: error: argument --limit: must be a whole number of at least 1, got 0"
    assert time.monotonic() - start < 10  # the parser alone; loading torch and the model is what it spared


def error_of(args, capsys) -> str:
    assert main(args) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.split(": error: ", 1)[1].rstrip("\n")


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch, capsys):
    import tatblimp_callback.commands.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    score = ["score", str(model_dir), "--data", str(DATA)]
    assert error_of([*score, "--output", "/proc/nope/out.json"], capsys) == (
        "--output /proc/nope/out.json: cannot write in /proc/nope (No such file or directory)"
    )
    assert error_of([*score, "--protocol", "forced-choice", "--results", "/proc/nope/answers.jsonl"], capsys) == (
        "--results /proc/nope/answers.jsonl: cannot write in /proc/nope (No such file or directory)"
    )
    assert error_of(["tokenizers", str(model_dir), "--data", str(DATA), "--output", "/proc/1/x.json"], capsys).startswith(
        "--output /proc/1/x.json: cannot write in /proc/1 ("
    )


def test_the_check_tries_the_folder_and_leaves_nothing_behind(tmp_path):
    check_output_file(tmp_path / "a" / "b" / "r.json", "--output")  # missing folders: made, written in, removed
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_output_file(tmp_path / "kept" / "r.json", "--output")
    assert [p.name for p in tmp_path.rglob("*")] == ["kept"]


def test_compare_and_report_refuse_an_unwritable_output_before_reading_the_runs(tmp_path, capsys):
    missing = str(tmp_path / "no-such-results.json")  # read after the outputs are checked: its error would come second
    for option in ("--json", "--markdown", "--plot"):
        assert error_of(["compare", missing, option, "/proc/nope/x"], capsys) == (
            f"{option} /proc/nope/x: cannot write in /proc/nope (No such file or directory)"
        )
    assert error_of(["report", missing, "--output", "/proc/nope/r.html"], capsys) == (
        "--output /proc/nope/r.html: cannot write in /proc/nope (No such file or directory)"
    )


def test_an_output_that_is_one_of_the_commands_inputs_is_refused_and_the_input_kept(tmp_path, capsys):
    """``score --output`` on the benchmark file, ``report --output`` or ``compare --json`` on a results file it reads
    replaced that input and exited 0."""
    data = tmp_path / "copy.jsonl"
    data.write_bytes(DATA.read_bytes())
    run = tmp_path / "run.json"
    run.write_text('{"not": "read"}\n', encoding="utf-8")
    same = str(tmp_path / "." / "run.json")  # the same file by another name
    for args, given, option in (
        (["score", "no-model", "--data", str(data), "--output", str(data)], data, "--output"),
        (["report", str(run), "--output", same], run, "--output"),
        (["compare", str(tmp_path / "other.json"), f"base={run}@4", "--json", same], f"base={run}@4", "--json"),
        (["compare", str(run), str(run), "--markdown", same], run, "--markdown"),
    ):
        destination = args[-1]
        assert (
            error_of(args, capsys)
            == f"{option} {destination}: the same file as the input {given}, which writing it would destroy"
        )
    assert data.read_bytes() == DATA.read_bytes() and run.read_text(encoding="utf-8") == '{"not": "read"}\n'


def test_an_output_on_a_runs_evaluations_is_refused(tmp_path, capsys):
    """``score --output runs/x/tatblimp.jsonl`` replaced a sweep's lines with one JSON document: the records were
    lost and the next sweep could not read the file."""
    sweep_lines = tmp_path / "tatblimp.jsonl"
    lines = '{"step": 10, "checkpoint": "checkpoint-10", "acc": 0.5, "acc_norm": 0.5}\n{"step": 20, "acc_norm": 0.6}\n'
    sweep_lines.write_text(lines, encoding="utf-8")
    for args, option in (
        (["score", "no-model", "--data", str(DATA), "--output", str(sweep_lines)], "--output"),
        (["compare", str(tmp_path / "a.json"), "--json", str(sweep_lines)], "--json"),
    ):
        assert error_of(args, capsys) == (
            f"{option} {sweep_lines}: holds the evaluations of a run (a sweep's or a history file's JSON lines, with "
            "steps), which writing it would replace; give another file name"
        )
    assert sweep_lines.read_text(encoding="utf-8") == lines


def test_files_an_option_names_are_named_when_they_cannot_be_read_or_written(tmp_path, capsys):
    """``--prompt-file nosuch.txt`` was ``[Errno 2] No such file or directory: 'nosuch.txt'``, a full disk
    ``[Errno 28] No space left on device``, neither naming the option or the file; a prompt given to the log-prob
    protocol, which uses none, was ignored."""
    missing = tmp_path / "nosuch.txt"
    args = ["score", "no-model", "--data", str(DATA), "--prompt-file", str(missing)]
    assert error_of([*args, "--protocol", "forced-choice"], capsys) == (
        f"--prompt-file {missing}: cannot read (No such file or directory)"
    )
    assert error_of(args, capsys) == (
        "--prompt-file: the forced-choice protocol's; give --protocol forced-choice (log-probs use no prompt)"
    )
    with pytest.raises(OSError, match=r"^/dev/full: cannot write \(No space left on device\)$"):
        write_text("/dev/full", "results\n")


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--results", "answers.jsonl"], "--results"),
        (["--extra-body", '{"top_k": 1}'], "--extra-body"),
        (["--model-name", "m"], "--model-name"),
    ],
)
def test_an_endpoints_option_without_an_endpoint_is_refused(monkeypatch, capsys, extra, option):
    """They were ignored: the local model was scored as if they had not been given."""
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert error_of(["score", "no-model", "--data", str(DATA), *extra], capsys) == (
        f"{option}: an option of --endpoint (a served model's answers); no --endpoint is given"
    )


def test_a_device_torch_does_not_know_or_this_machine_lacks_is_a_usage_error(capsys):
    """``--device gpu`` stopped with torch's "Expected one of cpu, cuda, ipu, ... device type at start of device
    string: gpu", and ``--device cuda`` on a CPU-only torch with "Torch not compiled with CUDA enabled": neither named
    the option."""
    assert usage_error(["score", "m", "--device", "gpu"], capsys) == (
        "tatblimp score: error: argument --device: 'gpu' is no device: cpu, cuda, cuda:N or mps"
    )
    if not torch.cuda.is_available():
        assert usage_error(["sweep", "r", "--device", "cuda:1"], capsys) == (
            f"tatblimp sweep: error: argument --device: 'cuda:1': no CUDA device here (torch {torch.__version__}); "
            "--device cpu runs on the CPU"
        )


def test_sweep_refuses_a_results_file_it_cannot_write_before_any_checkpoint_loads(capsys):
    # /proc/1 is a folder no file can be made in (even by root): the check, not the sweep's "no checkpoints", answers.
    assert error_of(["sweep", "/proc/1", "--data", str(DATA)], capsys).startswith(
        "the results file /proc/1/tatblimp.jsonl: cannot write in /proc/1 ("
    )
    assert error_of(["sweep", "org/model", "--revisions", "main", "--results", "/proc/nope/s.jsonl"], capsys) == (
        "--results /proc/nope/s.jsonl: cannot write in /proc/nope (No such file or directory)"
    )
