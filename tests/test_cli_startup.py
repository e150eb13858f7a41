"""The command starts at once and fails at once: ``--version`` and ``--help`` import no torch or transformers, the
package imports its public names when first used, a wrong option gets the subcommand's usage, and without network a
Hub id or the Hub's benchmark fails in seconds with one line (the network made unreachable by a proxy on a closed port)."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

import tatblimp_callback
from conftest import DATA, REPO
from tatblimp_callback.cli import main

HEAVY = ("torch", "transformers", "peft", "huggingface_hub", "numpy", "scipy")

STARTUP_SCRIPT = r"""
import argparse, contextlib, io, json, sys
from tatblimp_callback.cli import build_parser, main

commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
answers = {}
for argv in (["--version"], ["--help"], *([name, "--help"] for name in commands)):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exit:
            answers[" ".join(argv)] = [exit.code, out.getvalue()]
print(json.dumps({"answers": answers, "loaded": sorted(m for m in HEAVY if m in sys.modules)}))
"""


def child_env(**extra: str) -> dict[str, str]:
    """This checkout's package in a child process, with ``extra`` set."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    return env


def run_child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_version_and_every_help_import_no_heavy_module():
    completed = run_child(f"HEAVY = {HEAVY!r}\n" + STARTUP_SCRIPT, child_env())
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["loaded"] == []
    answers = report["answers"]
    assert answers["--version"] == [0, f"tatblimp {tatblimp_callback.__version__}\n"]
    assert set(answers) == {
        "--version",
        "--help",
        *(
            f"{name} --help"
            for name in ("score", "sweep", "compare", "explain", "report", "tokenizers", "lm-eval-path", "lm-eval")
        ),
    }
    for argv, (code, text) in answers.items():
        if argv != "--version":
            assert code == 0 and text.startswith(f"usage: tatblimp {argv.removesuffix('--help')}".rstrip()), argv


def test_the_package_imports_its_public_names_when_first_used():
    code = (
        "import sys, tatblimp_callback\n"
        "before = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "from tatblimp_callback import TatBLiMPCallback\n"
        "from transformers import TrainerCallback\n"
        "print(before, issubclass(TatBLiMPCallback, TrainerCallback), TatBLiMPCallback.__module__)\n"
    )
    completed = run_child(code, child_env())
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["[]", "True", "tatblimp_callback.training.callback"]


def test_every_public_name_is_the_object_of_its_module():
    for name in tatblimp_callback.__all__:
        module = importlib.import_module(tatblimp_callback._WHERE[name], "tatblimp_callback")
        assert getattr(tatblimp_callback, name) is getattr(module, name), name
    assert set(tatblimp_callback.__all__) == set(tatblimp_callback._WHERE)
    assert set(tatblimp_callback.__all__) <= set(dir(tatblimp_callback))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        tatblimp_callback.nope  # noqa: B018


@pytest.mark.parametrize("command", [["score", "some/model"], ["sweep", "runs/x"], ["compare", "a.json"]])
def test_a_wrong_option_gets_the_subcommands_usage_and_status_2(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--no-such-option", "7"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tatblimp {command[0]} ")
    assert err.splitlines()[-1] == f"tatblimp {command[0]}: error: unrecognized arguments: --no-such-option 7"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the socket is closed: connections are refused


def offline_env(tmp_path) -> dict[str, str]:
    """No network (every proxy a closed local port), HF_HUB_OFFLINE unset, an empty Hub cache."""
    proxy = f"http://127.0.0.1:{closed_port()}"
    env = child_env(HF_HOME=str(tmp_path / "hf-home"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TATBLIMP_DATA", "NO_PROXY", "no_proxy", "HF_HUB_CACHE"):
        env.pop(name, None)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env[name] = proxy
    return env


def run_offline(arguments: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "tatblimp_callback", *arguments],
        capture_output=True,
        text=True,
        env=offline_env(tmp_path),
        timeout=300,
        cwd=tmp_path,
    )
    return completed, time.perf_counter() - start


def test_a_hub_id_without_network_fails_in_seconds(tmp_path):
    """``runs/nope`` with no ``runs/`` folder is a Hub id: without network, one line at once (huggingface_hub's
    retries took about a minute), saying what is missing and what offline machines set."""
    completed, seconds = run_offline(["score", "runs/nope", "--data", str(DATA)], tmp_path)
    assert completed.returncode == 1
    assert completed.stdout == "" and len(completed.stderr.splitlines()) == 1, completed.stderr
    line = completed.stderr
    assert line.startswith("tatblimp score: error: runs/nope: no such local folder, and the Hugging Face Hub")
    assert "could not be reached" in line and "set HF_HUB_OFFLINE=1" in line
    assert seconds < 15


def test_no_data_without_network_is_one_line_at_once(tmp_path):
    """No --data, no $TATBLIMP_DATA, no network: the command names its option first, in one line."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # what the command checks before it reads the benchmark
    completed, seconds = run_offline(["score", str(model)], tmp_path)
    assert completed.returncode == 1
    assert completed.stdout == "" and len(completed.stderr.splitlines()) == 1, completed.stderr
    line = completed.stderr
    assert line.startswith("tatblimp score: error: no benchmark file given and TATBLIMP_DATA unset")
    assert "could not be reached" in line and line.rstrip().endswith("pass --data PATH or set TATBLIMP_DATA")
    assert seconds < 15
