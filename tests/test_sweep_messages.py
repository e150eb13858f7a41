"""``tatblimp sweep`` on a folder without checkpoints says what it looked for and where they are, and fails."""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.commands.sweep import SweepError, SweepOptions, sweep

LOOKED_FOR = (
    "no checkpoints found (looked for sub-folders named with a step number, e.g. checkpoint-500, "
    "holding a config.json or adapter_config.json)"
)


@pytest.fixture
def runs(tmp_path):
    """runs/x with two checkpoints, runs/y/out with one, and runs/empty: config.json is all the finding reads."""
    for checkpoint in ("x/checkpoint-40", "x/checkpoint-80", "y/out/checkpoint-5"):
        (tmp_path / "runs" / checkpoint).mkdir(parents=True)
        (tmp_path / "runs" / checkpoint / "config.json").write_text(json.dumps({}))
    (tmp_path / "runs" / "empty" / "step-3").mkdir(parents=True)  # named like a checkpoint, no config.json
    return tmp_path / "runs"


def sweep_error(args, capsys) -> str:
    assert main(["sweep", *args, "--data", str(DATA), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    return captured.err.removeprefix("tatblimp sweep: error: ").rstrip("\n")


def test_the_parent_of_the_run_folders_names_those_that_hold_checkpoints(runs, capsys):
    assert sweep_error([str(runs)], capsys) == (
        f"{runs}: {LOOKED_FOR}; these sub-folders hold checkpoints: {runs / 'x'}, {runs / 'y' / 'out'} (sweep one of them)"
    )


def test_a_checkpoint_given_as_the_run_folder_is_recognised(runs, capsys):
    checkpoint = runs / "x" / "checkpoint-40"
    assert sweep_error([str(checkpoint)], capsys) == (
        f"{checkpoint}: {LOOKED_FOR}; {checkpoint} is itself a checkpoint: score it with `tatblimp score {checkpoint}`, "
        f"or sweep its run folder {runs / 'x'}"
    )


def test_a_folder_without_anything_says_what_was_looked_for(runs, capsys):
    assert (
        sweep_error([str(runs / "empty")], capsys)
        == f"{runs / 'empty'}: {LOOKED_FOR}; step-3 is named like one but without either"
    )


def test_max_wait_without_watch_is_refused(runs, capsys):
    assert sweep_error([str(runs / "x"), "--max-wait", "60"], capsys).startswith("max_wait (--max-wait) needs watch (--watch)")
    with pytest.raises(ValueError, match="needs watch"):
        sweep(runs / "x", SweepOptions(data=str(DATA), max_wait=60, progress=False))


def test_watching_an_empty_folder_until_max_wait_fails_too(runs, capsys):
    assert sweep_error([str(runs / "empty"), "--watch", "--max-wait", "0", "--interval", "0"], capsys).startswith(
        f"{runs / 'empty'}: {LOOKED_FOR}"
    )
    with pytest.raises(SweepError, match="no checkpoints found"):
        sweep(runs, SweepOptions(data=str(DATA), progress=False))


def test_a_run_without_checkpoints_names_save_steps_and_the_saved_model(tmp_path, capsys):
    """The demo's folder before it saved checkpoints: its final model in model/, no checkpoint-N beside it."""
    run = tmp_path / "tiny-tatar"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text(json.dumps({}))
    save_steps = (
        "a Trainer saves checkpoints only with save_steps (TrainingArguments(save_strategy='steps', save_steps=N); "
        "the demo: examples/train_tiny_tatar.py --save-steps N)"
    )
    assert sweep_error([str(run)], capsys) == (
        f"{run}: {LOOKED_FOR}; {run / 'model'} holds a saved model: score it with `tatblimp score {run / 'model'}`; {save_steps}"
    )
    (run / "model" / "config.json").unlink()  # no model either: the advice alone
    assert sweep_error([str(run)], capsys) == f"{run}: {LOOKED_FOR}; {save_steps}"
