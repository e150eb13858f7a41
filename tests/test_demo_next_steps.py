"""The demo ends with the commands to try next, with the path to ``tatblimp`` that works without an activated
environment and the ``export TATBLIMP_DATA=...`` the guides' commands need: run, as printed, they work."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import CORPUS, DATA, REPO, load_module


@pytest.mark.slow
def test_the_demos_last_lines_run_as_printed(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "TATBLIMP_DATA"}
    environment |= {"PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}  # tatblimp on no PATH
    demo = [sys.executable, str(REPO / "examples" / "train_tiny_tatar.py"), "--corpus", str(CORPUS), "--data", str(DATA)]
    demo += ["--steps", "4", "--eval-steps", "2", "--save-steps", "0", "--vocab-size", "600", "--report-to", "none"]
    done = subprocess.run(demo, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.rstrip("\n").split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    printed = lines[start:]
    tatblimp = os.path.join(os.path.dirname(sys.executable), "tatblimp")
    assert printed[0].startswith(f"next: the guides' commands start with tatblimp, which is in {os.path.dirname(tatblimp)}")
    assert printed[2] == f"  export TATBLIMP_DATA={DATA.resolve()}"
    commands = [line.strip() for line in printed if line.startswith(("  export ", f"  {tatblimp} "))]
    assert len(commands) == 3
    # As a user pastes them, one after another in one shell, without --data: the export is what points them at it.
    script = " && ".join(commands)
    ran = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("margin per byte") == 2  # explain: the two worst quantifiers pairs
    assert (tmp_path / "runs" / "tiny-tatar" / "report.html").stat().st_size > 10_000
    assert "bash: tatblimp: command not found" not in ran.stderr
    failing = subprocess.run(["bash", "-c", "tatblimp --version"], cwd=tmp_path, env=environment, capture_output=True, text=True)
    assert failing.returncode == 127  # what the user would have met with the bare name


def load_demo():
    return load_module(REPO / "examples" / "train_tiny_tatar.py")


def test_an_alert_during_training_is_a_line_of_its_own_above_the_progress_bar(capsys):
    from tqdm.auto import tqdm

    package = logging.getLogger("tatblimp_callback")
    handlers, propagate = list(package.handlers), package.propagate
    try:
        demo = load_demo()
        demo.log_above_progress_bars()
        demo.log_above_progress_bars()  # once, however often
        bar = tqdm(total=100, desc="training", file=sys.stderr, ascii=True, mininterval=0)
        bar.update(40)
        logging.getLogger("tatblimp_callback.training.alerts").warning("tatblimp: REGRESSION: %s", "binding fell")
        bar.update(10)
        bar.close()
    finally:
        package.handlers[:], package.propagate = handlers, propagate
    err = capsys.readouterr().err
    # Before: the alert went straight to stderr after the bar's "40/100 [...]", on the bar's line.
    assert err.count("tatblimp: REGRESSION: binding fell") == 1
    before, after = err.split("tatblimp: REGRESSION: binding fell")
    assert re.search(r"\r *\r?$", before) and "40/100" in before  # the bar cleared to the line's start first
    assert after.startswith("\n") and "50/100" in after  # then the bar drawn again below it


@pytest.mark.slow
def test_the_next_steps_are_the_last_lines_on_screen_after_wandb(tmp_path):
    """wandb's closing lines ("wandb: Synced ...", "View run ...") came after the demo's hints: the run is finished
    before they are printed. stderr and stdout in one pipe, as on a terminal."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    environment["WANDB_SILENT"] = "false"  # as a user sees it (conftest quiets wandb)
    demo = [sys.executable, str(REPO / "examples" / "train_tiny_tatar.py"), "--corpus", str(CORPUS), "--data", str(DATA)]
    demo += ["--steps", "4", "--eval-steps", "2", "--save-steps", "0", "--vocab-size", "600", "--report-to", "wandb"]
    done = subprocess.run(
        demo, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.rstrip("\n").split("\n")
    assert any(line.startswith("wandb:") for line in lines)  # it did report to wandb, offline
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    assert not any("wandb" in line for line in lines[start:])
    assert lines[-1].strip().endswith("--output runs/tiny-tatar/report.html --model runs/tiny-tatar/model")
