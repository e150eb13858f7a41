"""The quick-start snippets of README.md and docs/getting-started.md run as they are written.

A snippet is the code block after a ``<!-- snippet: NAME -->`` line. Each page must hold the three quick
starts. They run with the setup the pages document, and nothing more: ``model`` (a tiny random Llama),
``tokenizer`` (a small BPE tokenizer), ``train_dataset`` (blocks of the Tatar corpus) and ``loader``
(batches of them) bound by the test; the benchmark at ``test.jsonl`` in the working directory and in
``$TATBLIMP_DATA``; for the command line, the model saved at ``path/to/model``. A snippet found identical
on both pages runs once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DATA, REPO, tiny_llama
from trainer_utils import corpus_blocks

PAGES = [REPO / "README.md", REPO / "docs" / "getting-started.md"]
QUICK_STARTS = {"trainer": "python", "custom-loop": "python", "command-line": "bash"}
SNIPPET = re.compile(r"^<!-- snippet: ([\w-]+) -->\n```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets(page: Path) -> list[tuple[str, str, str]]:
    """(name, language, code) of every marked snippet of ``page``, in page order."""
    return SNIPPET.findall(page.read_text(encoding="utf-8"))


def distinct_snippets() -> list:
    seen: dict[str, object] = {}
    for page in PAGES:
        for name, language, code in snippets(page):
            if code not in seen:
                seen[code] = pytest.param(name, language, code, page.name, id=f"{page.name}:{name}")
    return list(seen.values())


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_each_page_has_the_three_quick_starts(page):
    found = {name: language for name, language, _ in snippets(page)}
    assert found == QUICK_STARTS


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """The documented setup: the benchmark at ./test.jsonl and in $TATBLIMP_DATA, a fresh working directory."""
    (tmp_path / "test.jsonl").symlink_to(DATA)
    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_python(code: str, page: str, name: str, **names) -> dict:
    namespace = dict(names)
    exec(compile(code, f"{page} snippet {name}", "exec"), namespace)
    return namespace


@pytest.mark.slow
@pytest.mark.parametrize(("name", "language", "code", "page"), distinct_snippets())
def test_quick_start_snippet_runs(name, language, code, page, workdir, bpe_tokenizer, capsys):
    model = tiny_llama(len(bpe_tokenizer))
    blocks = corpus_blocks(bpe_tokenizer)[:24]  # 3 steps an epoch at the Trainer's default batch of 8
    if name == "trainer":
        namespace = run_python(code, page, name, model=model, tokenizer=bpe_tokenizer, train_dataset=blocks)
        trainer = namespace["trainer"]
        assert trainer.state.global_step == 9  # 3 epochs (the default) of 3 steps
        scored = [entry for entry in trainer.state.log_history if "tatblimp/acc_norm" in entry]
        assert [entry["step"] for entry in scored] == [0, 9]  # before the first step and at the last
        lines = (workdir / "runs/my-run/tatblimp_history.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line)["step"] for line in lines] == [0, 9]
        assert json.loads(lines[-1])["n"] == 1248
    elif name == "custom-loop":
        loader = [
            {
                "input_ids": torch.tensor([b["input_ids"] for b in blocks[i : i + 8]]),
                "labels": torch.tensor([b["labels"] for b in blocks[i : i + 8]]),
            }
            for i in range(0, 24, 8)
        ]
        before = {key: value.clone() for key, value in model.state_dict().items()}
        namespace = run_python(code, page, name, model=model, tokenizer=bpe_tokenizer, loader=loader)
        results, metrics = namespace["results"], namespace["metrics"]
        assert results.overall.n == 1248 and len(results.phenomena) == 16
        assert 0 <= results.acc_norm <= 1 and 0 <= metrics["tatblimp/acc_norm"] <= 1
        printed = capsys.readouterr().out.splitlines()
        assert printed[0] == f"{results.acc} {results.acc_norm} {results.phenomena['binding'].acc_norm}"
        assert printed[1] == f"0 {metrics['tatblimp/acc_norm']}"
        assert model.training  # scoring put the model back in train mode
        assert any(not torch.equal(before[key], value) for key, value in model.state_dict().items())  # it trained
    else:
        assert name == "command-line" and language == "bash"
        model.save_pretrained(workdir / "path/to/model")
        bpe_tokenizer.save_pretrained(workdir / "path/to/model")
        # This interpreter's tatblimp first; one thread, as in conftest (a busy 2-core machine runs two many times slower).
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(["bash", "-e", "-c", code], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads((workdir / "results.json").read_text(encoding="utf-8"))
        assert results["n"] == 1248 and len(results["phenomena"]) == 16
        assert "binding" in done.stdout and "wrote results.json" in done.stdout
