"""Each evaluation reaches every reporter exactly once at its global step: the real TensorBoard writer and
real offline wandb, read back from their files."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback
from trainer_utils import corpus_blocks, make_trainer, run_wandb_script, tatblimp_entries, wandb_records

PHENOMENA = 16


def callback(small_data, **options):
    return TatBLiMPCallback(data=small_data, allow_modified=True, **options)


def tensorboard_scalars(folder: Path) -> tuple[list[Path], dict[str, list[tuple[int, float]]]]:
    """The event files under ``folder`` and every scalar tag's (step, value) points, from all of them."""
    files = sorted(folder.rglob("events.out.tfevents.*"))
    scalars: dict[str, list[tuple[int, float]]] = {}
    for file in files:
        events = EventAccumulator(str(file))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return files, scalars


def test_tensorboard_gets_every_evaluation_once_at_its_step(bpe_tokenizer, small_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path / "run",
        [],
        report_to=["tensorboard"],
        max_steps=5,
        eval_strategy="steps",
        eval_steps=3,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    TatBLiMPCallback.attach(trainer, data=small_data, allow_modified=True, eval_steps=2)
    trainer.train()
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [0, 2, 3, 4, 5]  # every 2 steps, the Trainer's evaluation at 3, the end
    files, scalars = tensorboard_scalars(tmp_path / "tb")
    assert len(files) == 1  # one writer: nothing was logged after it closed (which would open a second one)
    for key in ("tatblimp/acc", "tatblimp/binding/acc_norm"):
        assert [step for step, _ in scalars[f"train/{key}"]] == [0, 2, 3, 4, 5]
        assert [value for _, value in scalars[f"train/{key}"]] == pytest.approx([e[key] for e in entries], rel=1e-6)  # float32
    assert sum(tag.startswith("train/tatblimp/") and tag.endswith("/acc_norm") for tag in scalars) == PHENOMENA + 1
    assert not any(tag.startswith("eval/tatblimp") for tag in scalars)  # the evaluation's copy stays off the reporters
    # The console: one short line per evaluation instead of the printed dict.
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("tatblimp step ")]
    assert [int(line.split()[2].rstrip(":")) for line in lines] == [0, 2, 3, 4, 5]
    assert lines[-1].startswith(f"tatblimp step 5: acc {entries[-1]['tatblimp/acc']:.4f}  acc_norm ")
    assert "'tatblimp/acc'" not in out and "eval_tatblimp" not in out


def test_a_reporter_the_callback_cannot_reach_is_named_once(bpe_tokenizer, small_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cb = callback(small_data, eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], report_to=["tensorboard"], max_steps=2)
    with caplog.at_level(logging.WARNING, logger="tatblimp_callback"):
        trainer.train()
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "will not reach" in r.getMessage()]
    assert len(warnings) == 1 and "tensorboard" in warnings[0] and "TatBLiMPCallback.attach(trainer" in warnings[0]
    _, scalars = tensorboard_scalars(tmp_path / "tb")
    assert "train/loss" in scalars and not any("tatblimp" in tag for tag in scalars)  # what the warning is about
    assert [e["step"] for e in tatblimp_entries(trainer)] == [0, 2]  # log_history has them all the same


WANDB_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import wandb
from transformers.integrations import WandbCallback
from conftest import tiny_llama, train_bpe
from trainer_utils import corpus_blocks, make_trainer
from tatblimp_callback import TatBLiMPCallback


class MyWandbCallback(WandbCallback):
    "A subclass, as TRL's and the wandb docs' are: recognised as wandb's all the same."


tokenizer = train_bpe(lines=1500)
trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r} + "/one", [], report_to=["wandb", "tensorboard"],
                       max_steps=5, eval_strategy="steps", eval_steps=3, eval_dataset=corpus_blocks(tokenizer, lines=8))
trainer.remove_callback(WandbCallback)
trainer.add_callback(MyWandbCallback())
cb = TatBLiMPCallback.attach(trainer, data={data!r}, allow_modified=True, eval_steps=2)
trainer.train()
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
# A second run with the same callback (a hyperparameter search, a notebook cell run again), in the plain form.
second = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r} + "/two", [cb], report_to=["wandb"], max_steps=2)
second.train()
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


@pytest.mark.slow
def test_wandb_and_tensorboard_at_once_get_every_evaluation_once(small_data, tmp_path):
    script = WANDB_SCRIPT.format(tests=str(Path(__file__).parent), data=str(small_data), out=str(tmp_path / "out"))
    first, second = run_wandb_script(script, tmp_path, TENSORBOARD_LOGGING_DIR=str(tmp_path / "tb"))

    records = wandb_records(first)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    ours = [item for item in history if "tatblimp/acc" in item]
    assert [item["train/global_step"] for item in ours] == [0, 2, 3, 4, 5]
    assert sum(k.startswith("tatblimp/") and k.count("/") == 2 for k in ours[-1]) == 2 * PHENOMENA
    assert not any(k.startswith(("train/tatblimp", "eval/tatblimp")) for item in history for k in item)
    assert any("train/loss" in item for item in history) and any("eval/loss" in item for item in history)
    assert any(
        a["path"] == "tatblimp/results.table.json"
        for r in records
        if r["type"] == "artifact"
        for a in r["artifact"]["manifest"]["contents"]
    )
    _, scalars = tensorboard_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["train/tatblimp/acc"]] == [0, 2, 3, 4, 5]
    values = [value for _, value in scalars["train/tatblimp/acc"]]
    assert values == pytest.approx([item["tatblimp/acc"] for item in ours], rel=1e-6)

    # The second wandb run has its own tatblimp/ section over train/global_step, and its own curve from step 0.
    records = wandb_records(second)
    defined = [r["metric"] for r in records if r["type"] == "metric"]
    assert {"glob_name": "tatblimp/*", "step_metric": "train/global_step"}.items() <= next(
        m for m in defined if m.get("glob_name") == "tatblimp/*"
    ).items()
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [item["train/global_step"] for item in history if "tatblimp/acc" in item] == [0, 2]
    files, _ = tensorboard_scalars(tmp_path / "tb")
    assert len(files) == 1  # the first run's closed TensorBoard writer was not reopened by the second run


RESUME_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import wandb
from transformers import TrainerCallback
from conftest import tiny_llama, train_bpe
from trainer_utils import make_trainer
from tatblimp_callback import TatBLiMPCallback


class PreemptedAt3(TrainerCallback):
    "The job is killed right after checkpoint-3 is saved."

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            control.should_training_stop = True


tokenizer = train_bpe(lines=1500)
options = dict(report_to=["wandb"], max_steps=6, save_strategy="steps", save_steps=3)
first = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r}, [], **options)
first.add_callback(PreemptedAt3())
TatBLiMPCallback.attach(first, data={data!r}, allow_modified=True, eval_steps=2, eval_on_end=False)
first.train()
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
# The restarted job: a new process in real life, the same wandb run id (WANDB_RUN_ID, WANDB_RESUME=allow).
second = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r}, [], **options)
TatBLiMPCallback.attach(second, data={data!r}, allow_modified=True, eval_steps=2)
second.train(resume_from_checkpoint={out!r} + "/checkpoint-3")
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


@pytest.mark.slow
def test_a_resumed_wandb_run_keeps_one_curve(small_data, tmp_path):
    script = RESUME_SCRIPT.format(tests=str(Path(__file__).parent), data=str(small_data), out=str(tmp_path / "out"))
    before, after = run_wandb_script(script, tmp_path, WANDB_RUN_ID="tatblimp-resume-test", WANDB_RESUME="allow")
    steps = []
    for run_dir in (before, after):
        records = wandb_records(run_dir)
        assert Path(run_dir).name.endswith("-tatblimp-resume-test")  # offline-run-<time>-<run id>: one run
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        steps.append([item["train/global_step"] for item in history if "tatblimp/acc" in item])
    # Scored at 0 and 2 before the pre-emption; after the resume at 4 and 6 only: each step once, one curve.
    assert steps == [[0, 2], [4, 6]]
