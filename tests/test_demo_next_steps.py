"""The demo ends with the commands to try next, with the path to ``tatblimp`` that works without an activated
environment and the ``export TATBLIMP_DATA=...`` the guides' commands need: run, as printed, they work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import CORPUS, DATA, REPO


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
