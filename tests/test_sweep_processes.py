"""``tatblimp sweep`` over several processes (real torchrun and accelerate launch, gloo, CPU), and a
checkpoint that cannot be loaded among good ones, on one process and on two.

Before the sweep shared checkpoints out, both processes of ``torchrun --nproc-per-node 2`` scored
every checkpoint and appended it: the file held each step twice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_llama
from tatblimp_callback.commands.sweep import SweepOptions, sweep
from trainer_utils import wandb_records

BIN = Path(sys.executable).parent
STEPS = (10, 20, 30, 40)
CORRUPT = "checkpoint-20"
LAUNCH_TIMEOUT = 300  # seconds; a hang fails the test instead of the suite
# Wall-clock facts that differ between any two runs, and paths of the run's two copies ("tokenizer" names the
# first checkpoint whose identical tokenizer files the process loaded).
VOLATILE = {"seconds", "created", "model", "tokenizer"}


def save_checkpoint(folder: Path, tokenizer, step: int) -> None:
    tiny_llama(len(tokenizer), seed=step).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))  # written last, as the Trainer does


def corrupt(folder: Path) -> None:
    """A damaged weights file: the header of a safetensors file that ends early."""
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.fixture(scope="module")
def one_pair_each(records, tmp_path_factory) -> Path:
    from conftest import write_pairs

    seen, subset = set(), []
    for record in records:
        if record["phenomenon"] not in seen:
            seen.add(record["phenomenon"])
            subset.append(record)
    return write_pairs(tmp_path_factory.mktemp("data") / "sixteen.jsonl", subset)


@pytest.fixture(scope="module")
def run_template(tmp_path_factory, bpe_tokenizer) -> Path:
    run = tmp_path_factory.mktemp("template") / "run"
    for step in STEPS:
        save_checkpoint(run / f"checkpoint-{step}", bpe_tokenizer, step)
    corrupt(run / CORRUPT)
    return run


def launch(command: list[str], cwd: Path, data: Path) -> subprocess.CompletedProcess:
    arguments = ["sweep", "run", "--data", str(data), "--allow-modified", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(Path(__file__).parents[1])}
    try:
        return subprocess.run([*command, *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{command}: hung for {LAUNCH_TIMEOUT} s\n{(timeout.stderr or '')[-3000:]}")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def comparable(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in VOLATILE}


TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def one_process_sweep(run_template, one_pair_each, tmp_path_factory):
    """The same run swept by this process: the report and the folder."""
    run = shutil.copytree(run_template, tmp_path_factory.mktemp("one") / "run")
    return sweep(run, SweepOptions(data=str(one_pair_each), allow_modified=True, progress=False)), run


@pytest.mark.slow
def test_two_torchrun_processes_write_each_checkpoint_once_as_one_process_does(
    run_template, one_process_sweep, one_pair_each, tmp_path, bpe_tokenizer
):
    two = tmp_path / "two"
    shutil.copytree(run_template, two / "run")
    done = launch([*TORCHRUN, "-m", "tatblimp_callback"], two, one_pair_each)  # runs __main__.py
    # The damaged checkpoint is named, the others are scored, and the exit status says something failed.
    assert done.returncode != 0, done.stderr[-3000:]
    assert f"could not be scored: {CORRUPT}" in done.stderr, done.stderr[-3000:]
    assert "3 checkpoint(s) scored, 0 already in run/tatblimp.jsonl, 1 failed" in done.stdout
    assert done.stdout.count("checkpoint(s) scored") == 1  # process 0 reports for both

    expected, written = lines(one_process_sweep[1] / "tatblimp.jsonl"), lines(two / "run" / "tatblimp.jsonl")
    assert [r["step"] for r in written] == [10, 30, 40]  # each once, in step order
    assert [comparable(r) for r in written] == [comparable(r) for r in expected]
    (failure,) = lines(two / "run" / "tatblimp-failures.jsonl")
    assert failure["checkpoint"] == CORRUPT and failure["step"] == 20 and "model.safetensors: cannot be read" in failure["error"]
    assert failure["process"] == 1  # the round's other checkpoint, on process 0, was kept

    # Repaired, then a rerun under `--no-python tatblimp` scores only what is missing, and `--watch`
    # hands out a checkpoint saved while it runs.
    save_checkpoint(two / "run" / CORRUPT, bpe_tokenizer, 20)
    command = [*TORCHRUN, "--no-python", str(BIN / "tatblimp")]
    watch = ["--watch", "--interval", "0.5", "--max-wait", "4", "--wandb-project", "sweep-test"]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(two), "WANDB_SILENT": "true"}
    rerun = subprocess.Popen(
        [*command, "sweep", "run", "--data", str(one_pair_each), "--allow-modified", "--no-progress", *watch],
        cwd=two,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(Path(__file__).parents[1]),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = two / "run" / "tatblimp.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while len(lines(results)) < 4 and rerun.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    save_checkpoint(two / "run" / "checkpoint-50", bpe_tokenizer, 50)
    try:
        out, err = rerun.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        rerun.kill()
        pytest.fail("the watching sweep hung")
    assert rerun.returncode == 0, err[-3000:]
    steps = [r["step"] for r in lines(results)]
    assert steps == [10, 30, 40, 20, 50]  # old lines kept, each checkpoint once
    assert out.count("acc_norm") >= 2 and "checkpoint-50" in out
    # One wandb run, written by process 0, with each new checkpoint once at its step.
    (wandb_run,) = (two / "wandb").glob("offline-run-*")
    history = [r["history"]["item"] for r in wandb_records(str(wandb_run)) if r["type"] == "history"]
    assert [item["train/global_step"] for item in history if "tatblimp/acc_norm" in item] == [20, 50]


def test_one_process_goes_on_past_a_corrupt_checkpoint(one_process_sweep, one_pair_each, capsys):
    from tatblimp_callback.cli import main

    report, run = one_process_sweep
    assert report.scored == ["checkpoint-10", "checkpoint-30", "checkpoint-40"]
    assert list(report.failed) == [CORRUPT] and "checkpoint-20/model.safetensors: cannot be read" in report.failed[CORRUPT]
    assert [r["checkpoint"] for r in lines(run / "tatblimp-failures.jsonl")] == [CORRUPT]
    # Again, from the command: nothing new is scored, the failure is tried again and named, the exit status is 1.
    assert main(["sweep", str(run), "--data", str(one_pair_each), "--allow-modified", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "0 checkpoint(s) scored, 3 already in" in captured.out and ", 1 failed" in captured.out
    assert f"1 checkpoint(s) could not be scored: {CORRUPT}" in captured.err
    assert len(lines(run / "tatblimp-failures.jsonl")) == 2 and len(lines(run / "tatblimp.jsonl")) == 3


def test_a_failure_scored_later_leaves_the_failures_file(run_template, one_pair_each, bpe_tokenizer, tmp_path):
    """The failures file kept a checkpoint that a later run scored, and a script reading it saw a failure."""
    run = shutil.copytree(run_template, tmp_path / "run")
    options = SweepOptions(data=str(one_pair_each), allow_modified=True, progress=False)
    assert list(sweep(run, options).failed) == [CORRUPT]
    shutil.rmtree(run / CORRUPT)
    save_checkpoint(run / CORRUPT, bpe_tokenizer, 20)  # saved again, whole
    assert sweep(run, options).scored == [CORRUPT]
    assert (run / "tatblimp-failures.jsonl").read_text(encoding="utf-8") == ""
    assert [r["checkpoint"] for r in lines(run / "tatblimp.jsonl")] == [f"checkpoint-{s}" for s in (10, 30, 40, 20)]


def test_a_device_map_is_refused_on_several_processes(run_template, one_pair_each, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; refused before any process group is joined
    with pytest.raises(ValueError, match="device_map spreads one model over every device: sweep on one process"):
        sweep(run_template, SweepOptions(data=str(one_pair_each), allow_modified=True, device_map="auto"))


def test_a_watching_sweep_calls_a_failed_checkpoint_failed_not_already_scored(run_template, one_pair_each, tmp_path, capsys):
    from tatblimp_callback.cli import main

    run = shutil.copytree(run_template, tmp_path / "run")
    command = ["sweep", str(run), "--data", str(one_pair_each), "--allow-modified", "--no-progress"]
    assert main([*command, "--watch", "--max-wait", "1", "--interval", "0.1"]) == 1
    captured = capsys.readouterr()
    # Before: "3 checkpoint(s) scored, 1 already in ...": the failed one counted among those in tatblimp.jsonl.
    assert f"3 checkpoint(s) scored, 0 already in {run / 'tatblimp.jsonl'}, 1 failed" in captured.out
    assert len(lines(run / "tatblimp.jsonl")) == 3


@pytest.mark.slow
def test_a_process_that_stops_the_sweep_leaves_the_rounds_other_checkpoints_written(tmp_path, bpe_tokenizer, one_pair_each):
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint-10", bpe_tokenizer, 10)
    tiny_llama(len(bpe_tokenizer), seed=20).save_pretrained(run / "checkpoint-20")  # no tokenizer here, nor in the run
    (run / "checkpoint-20" / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    arguments = ["sweep", "run", "--data", str(one_pair_each), "--allow-modified", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(Path(__file__).parents[1])}
    try:  # before: process 0 waited for process 1's outcome, which never came (a 24-hour round timeout)
        done = subprocess.run(
            [*TORCHRUN, "-m", "tatblimp_callback", *arguments], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the sweep hung when one process stopped it")
    assert done.returncode != 0 and "no tokenizer files" in done.stderr, done.stderr[-3000:]
    # The round's other checkpoint, scored by process 0, is written before the sweep stops.
    assert [r["checkpoint"] for r in lines(run / "tatblimp.jsonl")] == ["checkpoint-10"]
