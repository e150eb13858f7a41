"""The tokenizer ablation example, run small: it writes how each vocabulary cuts the edits and each run's outcomes
split by edit alignment and by the length confound's sign, with intervals, and the acquisition step of both groups."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import CORPUS, DATA, REPO


@pytest.mark.slow
def test_the_example_writes_the_outcomes_split_by_alignment(tmp_path):
    out = tmp_path / "ablation"
    command = [sys.executable, str(REPO / "examples" / "tokenizer_ablation.py"), "--corpus", str(CORPUS), "--data", str(DATA)]
    command += ["--output-dir", str(out), "--vocab-sizes", "300,600", "--lines", "800", "--steps", "2", "--save-steps", "1"]
    command += ["--hidden", "32", "--batch-size", "4", "--block-size", "64", "--threads", "1"]
    completed = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    by_edit = (out / "by_edit.md").read_text(encoding="utf-8")
    assert "How each vocabulary cuts the edit" in by_edit and by_edit.count("overall ") >= 2
    for vocab in (300, 600):
        record = json.loads((out / f"vocab-{vocab}" / "tatblimp.jsonl").read_text(encoding="utf-8").splitlines()[-1])
        aligned = record["edit_tokens"]["aligned"]
        outcomes = record["outcomes"]["acc_norm"]
        inside = [o for o, a in zip(outcomes, aligned) if a == "1"]
        cell = f"{inside.count('1') / len(inside):.3f} ["
        row = next(
            line for line in by_edit.splitlines() if line.startswith("| overall | acc_norm |") and f"({len(inside)})" in line
        )
        assert cell in row and re.search(r"\[0\.\d{3}, 0\.\d{3}\]", row)
        assert f"vocab-{vocab}: acc_norm acquisition step" in by_edit
    assert "By how the tokenizer cut the edit" in (out / "ablation.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--data", "nope.jsonl"], "nope.jsonl: cannot read the benchmark file (No such file or directory)"),
        (["--data", str(DATA), "--corpus", "nope.txt"], "--corpus nope.txt: cannot read it (No such file or directory)"),
        (["--data", str(DATA), "--output-dir", "/proc/nope"], "--output-dir /proc/nope/ablation.md: cannot write in /proc/nope"),
    ],
)
def test_a_bad_input_fails_in_one_line_before_any_training(tmp_path, options, error):
    """Before, a bad --data trained the first model (16-19 s) and then died in a traceback ending in BenchmarkError."""
    out = tmp_path / "ablation"
    command = [sys.executable, str(REPO / "examples" / "tokenizer_ablation.py"), "--corpus", str(CORPUS)]
    command += ["--output-dir", str(out), "--vocab-sizes", "300", "--lines", "200", "--steps", "2", *options]
    start = time.monotonic()
    completed = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    seconds = time.monotonic() - start
    assert completed.returncode == 1
    assert completed.stdout == "" and len(completed.stderr.splitlines()) == 1, completed.stderr
    assert completed.stderr.startswith(f"tokenizer_ablation.py: error: {error}")
    assert not out.exists()  # no tokenizer, no model, no checkpoint
    assert seconds < 15  # no torch import, no training: about 2 s on the 2-core machine, loaded
