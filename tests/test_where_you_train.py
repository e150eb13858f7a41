"""The examples of docs/guides/where-you-train.md run as written, one per training stack.

Each runs with the names the page says it binds: ``model`` (a tiny random Llama), ``tokenizer`` (a small BPE
tokenizer), ``blocks`` (a [rows, 32] tensor of corpus token ids), ``train_dataset`` (the same as dicts),
``texts`` (Tatar lines), ``gpt`` (a nanoGPT-style model, for ``CallableLM``), and the benchmark at ./test.jsonl.
"""

from __future__ import annotations

import csv

import pytest
import torch

from conftest import CORPUS, DATA, REPO, tiny_llama
from tatblimp_callback import evaluate
from test_callable_model import NanoGPT
from test_docs_snippets import snippets
from trainer_utils import corpus_blocks

PAGE = REPO / "docs" / "guides" / "where-you-train.md"
STACKS = ["hf-trainer", "trl", "lightning", "lightning-best", "fabric", "accelerate", "plain-loop", "callable"]
NEEDS = {"trl": "trl", "lightning": "lightning", "lightning-best": "lightning", "fabric": "lightning"}


def test_the_page_has_one_example_per_stack():
    assert [(name, language) for name, language, _ in snippets(PAGE)] == [(name, "python") for name in STACKS]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "test.jsonl").symlink_to(DATA)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def printed_curve(out: str) -> list[tuple[int, float]]:
    return [(int(line.split()[0]), float(line.split()[1])) for line in out.splitlines() if line[:1].isdigit()]


@pytest.mark.slow
@pytest.mark.parametrize("name", STACKS)
def test_the_example_runs(name, workdir, bpe_tokenizer, capsys):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    code = {n: c for n, _, c in snippets(PAGE)}[name]
    model = tiny_llama(len(bpe_tokenizer)).train()
    train_dataset = corpus_blocks(bpe_tokenizer, lines=200)
    names = dict(
        model=model,
        tokenizer=bpe_tokenizer,
        blocks=torch.tensor([b["input_ids"] for b in train_dataset]),
        train_dataset=train_dataset,
        texts=[line for line in CORPUS.read_text(encoding="utf-8").splitlines()[:200] if line.strip()],
        gpt=NanoGPT(len(bpe_tokenizer)),
    )
    try:
        exec(compile(code, f"{PAGE.name} snippet {name}", "exec"), names)
    finally:
        if name == "accelerate":  # accelerate's process state is global: the next Trainer makes its own
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(True)
    out = capsys.readouterr().out
    if name in ("hf-trainer", "lightning"):
        assert out.strip().splitlines()[-1] == "[0, 2, 4]"
        assert names["callback"].last_results.overall.n == 1248
    if name == "lightning":
        with (workdir / "runs" / "lightning" / "version_0" / "metrics.csv").open() as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("tatblimp/acc_norm")]
        assert [int(row["step"]) for row in rows] == [0, 2, 4]
        assert [float(row["tatblimp/acc_norm"]) for row in rows] == [e["tatblimp/acc_norm"] for e in names["callback"].history]
    if name == "lightning-best":
        check_best_and_stop(workdir, names["callback"], names["best"], names["stop"], names["trainer"])
    if name == "trl":
        assert [e["step"] for e in names["callback"].history] == [0, 2, 4]  # and the snippet's own assert held
    if name in ("fabric", "accelerate", "plain-loop"):
        curve = printed_curve(out)
        assert [step for step, _ in curve] == [2, 4]
        final = tiny_llama(len(bpe_tokenizer))
        final.load_state_dict(model.state_dict())  # the same weights: the prepared model wraps this module
        assert curve[-1][1] == evaluate(final, bpe_tokenizer, "test.jsonl").acc_norm
    if name == "callable":
        method, acc_norm = out.strip().rsplit(" ", 1)
        assert method == "packed rows, full logits"
        assert 0 <= float(acc_norm) <= 1


def check_best_and_stop(workdir, callback, best, stop, trainer) -> None:
    """The checkpoint kept is the step that scored best in the history file; the run stopped where EarlyStopping's
    rule, applied to the scores at each epoch end, says."""
    import json
    from pathlib import Path

    lines = [
        json.loads(line) for line in (workdir / "runs" / "lightning-best" / "tatblimp_history.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in lines] == [e["step"] for e in callback.history] == list(range(0, trainer.global_step + 1, 2))
    top = max(lines[1:], key=lambda line: line["acc_norm"])  # step 0 is before training: never a checkpoint
    assert Path(best.best_model_path).name == f"epoch={top['step'] // 2 - 1}-step={top['step']}.ckpt"
    assert best.best_model_score.item() == top["acc_norm"]
    score, wait, stopped_at = float("-inf"), 0, 16  # max_epochs=8, two steps an epoch
    for line in lines[1:]:
        score, wait = (line["acc_norm"], 0) if line["acc_norm"] > score else (score, wait + 1)
        if wait >= stop.patience:
            stopped_at = line["step"]
            break
    assert trainer.global_step == stopped_at
