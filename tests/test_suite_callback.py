"""A real Trainer run with ``suites=``: each suite's keys at TatBLiMP's steps, its own wandb section and history file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHARED
from trainer_utils import run_wandb_script, wandb_records

SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import wandb
from conftest import tiny_llama, train_bpe
from trainer_utils import make_trainer
from tatblimp_callback import TatBLiMPCallback

tokenizer = train_bpe(lines=1500)
trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r}, [], report_to=["wandb"], max_steps=4)
cb = TatBLiMPCallback.attach(
    trainer, data={data!r}, allow_modified=True, eval_steps=2,
    suites={{"blimp": {blimp!r}, "own": {own!r}}}, suite_every={{"own": 2}},
)
trainer.train()
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


@pytest.mark.slow
def test_a_trainer_run_logs_each_suite_at_tatblimps_steps_in_its_own_wandb_section(small_data, tmp_path):
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    source = SHARED / "blimp" / "data" / "passive_1.jsonl"
    (blimp / "passive_1.jsonl").write_text("\n".join(source.read_text(encoding="utf-8").split("\n")[300:340]) + "\n")
    own = tmp_path / "agreement.csv"
    # Two Tatar pairs (person agreement), written as escapes: the linter flags Cyrillic letters that look Latin.
    own.write_text(
        "good;bad;phenomenon\n\u041c\u0438\u043d \u0431\u0430\u0440\u0430\u043c.;\u041c\u0438\u043d \u0431\u0430\u0440\u0430\u0441\u044b\u04a3.;person\n"
        "\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435.;\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435\u043c.;person\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    script = SCRIPT.format(tests=str(Path(__file__).parent), data=str(small_data), out=str(out), blimp=str(blimp), own=str(own))
    (run_dir,) = run_wandb_script(script, tmp_path)

    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]

    def steps(key: str) -> list[int]:
        return [item["train/global_step"] for item in history if key in item]

    assert steps("tatblimp/acc") == steps("blimp/acc") == steps("blimp/acc_norm") == [0, 2, 4]
    assert steps("blimp/argument_structure/acc_norm") == [0, 2, 4]
    assert steps("own/acc_norm") == steps("own/person/acc") == [0, 4]  # suite_every={"own": 2}: every 2nd evaluation
    # Each suite is a wandb section of its own over train/global_step, with its end-of-training table.
    defined = {r["metric"].get("glob_name"): r["metric"] for r in records if r["type"] == "metric"}
    for section in ("tatblimp/*", "blimp/*", "own/*"):
        assert defined[section]["step_metric"] == "train/global_step"
    tables = {a["path"] for r in records if r["type"] == "artifact" for a in r["artifact"]["manifest"]["contents"]}
    assert {"tatblimp/results.table.json", "blimp/results.table.json", "own/results.table.json"} <= tables

    # Each suite's own history file: one line per evaluation that scored it, with its left-out pair named.
    lines = [json.loads(line) for line in (out / "tatblimp_history.blimp.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert lines[0]["n"] == 39 and lines[0]["left_out"] == [
        {"file": str(blimp / "passive_1.jsonl"), "line": 25, "reason": "the good and bad sentences are identical"}
    ]
    own_lines = (out / "tatblimp_history.own.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in own_lines] == [0, 4]
    tatblimp_lines = [json.loads(line) for line in (out / "tatblimp_history.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in tatblimp_lines] == [0, 2, 4] and "suites" not in tatblimp_lines[0]
