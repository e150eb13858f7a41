"""``TatBLiMPLightningCallback`` in real ``lightning.Trainer`` runs on the CPU: one process and DDP with two.

The runs are ``lightning_worker.py`` in a fresh process (Lightning starts DDP's second rank by running the
script again); these tests read back what they logged: CSV, TensorBoard event files and the offline wandb run.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from trainer_utils import corpus_blocks, wandb_records

pytest.importorskip("lightning")
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from tatblimp_callback import Evaluator
from tatblimp_callback.lightning import TatBLiMPLightningCallback
from tatblimp_callback.reading.jsonl import read_complete_lines

WORKER = Path(__file__).with_name("lightning_worker.py")
STEPS = [0, 2, 4, 5]  # eval_every_n_steps=2 over max_steps=5: the start, every 2, the last


def run_worker(tmp_path: Path, tokenizer, small_data, devices: int, *options: str) -> list[dict]:
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    shutil.copy(small_data, tmp_path / "small.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(devices), *options],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def fresh_metrics(weights, tokenizer, small_data) -> dict[str, float]:
    """What a fresh ``Evaluator`` gives for ``weights``, as the flat keys the callback logs."""
    model = tiny_llama(len(tokenizer))
    model.load_state_dict(weights)
    results = Evaluator(tokenizer, small_data, allow_modified=True)(model.eval())
    return results.flat_metrics("tatblimp")


def without_seconds(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k != "tatblimp/eval_seconds"} for entry in history]


def check_run(tmp_path: Path, ranks: list[dict], tokenizer, small_data, steps=STEPS, failures: int = 0) -> None:
    history = ranks[0]["history"]
    assert [entry["step"] for entry in history] == steps
    # Every rank gets the same results (each times its own share).
    assert all(without_seconds(out["history"]) == without_seconds(history) for out in ranks)
    assert all(out["failures"] == failures for out in ranks)
    # Each point measured the weights of its step (taken just before the callback ran), to the last digit.
    for entry in history:
        expected = fresh_metrics(ranks[0]["weights"][entry["step"]], tokenizer, small_data)
        assert {k: v for k, v in entry.items() if k not in ("step", "tatblimp/eval_seconds", "tatblimp/failures")} == expected
    if failures:  # the points after a failure carry the count
        assert history[-1]["tatblimp/failures"] == failures
    # The random generators and the train mode are as they were, after every event of the callback.
    assert all(out["rng_same"] and all(out["rng_same"]) for out in ranks)
    assert all(out["train_mode"] and all(out["train_mode"]) for out in ranks)

    # ModelCheckpoint(monitor="tatblimp/acc_norm", every_n_train_steps=2) on every rank kept the best-scored step.
    top = max((e for e in history if e["step"] and e["step"] % 2 == 0), key=lambda e: e["tatblimp/acc_norm"])
    assert all(out["best"] == (f"step={top['step']}.ckpt", top["tatblimp/acc_norm"]) for out in ranks)

    # CSVLogger: one row per evaluation, at its global step.
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("tatblimp/acc")]
    assert [int(row["step"]) for row in rows] == steps
    assert [float(row["tatblimp/acc_norm"]) for row in rows] == [e["tatblimp/acc_norm"] for e in history]

    # TensorBoardLogger: the event files read back as TensorBoard does.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    scalars = events.Scalars("tatblimp/acc_norm")
    assert [s.step for s in scalars] == steps
    assert [s.value for s in scalars] == pytest.approx([e["tatblimp/acc_norm"] for e in history], abs=1e-6)
    assert "tatblimp/binding/acc_norm" in events.Tags()["scalars"]

    # WandbLogger (offline): the history records read back with `wandb leet inspect --json`.
    records = [r for r in wandb_records(ranks[0]["wandb_dir"]) if r.get("type") == "history"]
    ours = [r for r in records if "tatblimp/acc" in str(r)]
    assert len(ours) == len(steps), records[:3]
    text = str(ours)
    for entry in history:
        assert repr(entry["tatblimp/acc_norm"]) in text


@pytest.mark.slow
def test_one_process_logs_every_point_once_to_csv_tensorboard_and_wandb(tmp_path, bpe_tokenizer, small_data):
    ranks = run_worker(tmp_path, bpe_tokenizer, small_data, devices=1)
    check_run(tmp_path, ranks, bpe_tokenizer, small_data)
    lines = list(read_complete_lines(tmp_path / "root" / "tatblimp_history.jsonl"))
    assert len(lines) == len(STEPS)


@pytest.mark.slow
def test_ddp_two_processes_score_sharded_and_rank_zero_logs(tmp_path, bpe_tokenizer, small_data):
    ranks = run_worker(tmp_path, bpe_tokenizer, small_data, devices=2)
    assert len(ranks) == 2
    check_run(tmp_path, ranks, bpe_tokenizer, small_data)


@pytest.mark.slow
@pytest.mark.parametrize("root", ["module", "model"])
def test_fsdp2_scores_the_full_weights_in_lockstep_and_rank_zero_logs(tmp_path, bpe_tokenizer, small_data, root):
    """``ModelParallelStrategy`` with ``fully_shard`` on each layer and on the LightningModule itself (the
    callback gathers the root unit's parameters, which only the module's own forward would) or on its
    transformers model (whose forward gathers them) as the root unit: every rank runs
    every forward, rank 0 logs each point once, with the values a fresh one-process evaluation of the full
    weights of that step gives. The evaluation of step 4 fails on rank 1 only (before any forward): both
    ranks stop it and count it, no rank waits in a sharded forward, and training goes on to the last step."""
    ranks = run_worker(tmp_path, bpe_tokenizer, small_data, 2, f"fsdp2-{root}")
    check_run(tmp_path, ranks, bpe_tokenizer, small_data, steps=[0, 2, 5], failures=1)


def test_fsdp1_on_the_cpu_is_refused_by_lightning_itself():
    """Why FSDP1 (``strategy="fsdp"``) has no CPU test here: Lightning refuses it without a GPU (and torch's
    ``FullyShardedDataParallel`` needs an accelerator device too); FSDP2 above is the sharded CPU run."""
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp")


# -- in this process ------------------------------------------------------------------------------


class Wrapped(L.LightningModule):
    def __init__(self, vocab_size: int, attribute: str = "model", lr: float = 0.05):
        super().__init__()
        setattr(self, attribute, tiny_llama(vocab_size).train())
        self._name = attribute
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return getattr(self, self._name)(input_ids=batch, labels=batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", getattr(self, self._name)(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(
    module,
    callback,
    root: Path,
    max_steps: int,
    tokenizer,
    ckpt_path=None,
    checkpoint=None,
    callbacks=None,
    rows=None,
    val=False,
    **options,
) -> L.Trainer:
    """A CPU ``lightning.Trainer`` run; ``callbacks`` (in that order) replaces ``[callback, checkpoint]``."""
    blocks = torch.tensor([b["input_ids"] for b in corpus_blocks(tokenizer, lines=120)])[:rows]
    callbacks = callbacks if callbacks is not None else [callback, *([checkpoint] if checkpoint else [])]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=str(root),
        logger=CSVLogger(str(root), name="csv"),
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(each, ModelCheckpoint) for each in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    loader = DataLoader(blocks, batch_size=4)
    trainer.fit(module, loader, val_dataloaders=DataLoader(blocks[:4], batch_size=4) if val else None, ckpt_path=ckpt_path)
    return trainer


class Probe(L.Callback):
    """What a callback after the TatBLiMP one reads in ``trainer.callback_metrics`` after each batch."""

    def __init__(self, key: str = "tatblimp/acc_norm"):
        self.key, self.seen = key, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics.get(self.key)
        self.seen[trainer.global_step] = None if value is None else value.item()


def test_fit_again_on_the_same_trainer_continues_the_curve_and_its_file(tmp_path, bpe_tokenizer, small_data):
    """A second ``trainer.fit`` with ``max_steps`` raised goes on from the global step; the callback started afresh,
    dropping steps 0-4 from its history, from the history file and from the alerts' windows."""
    import json

    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2)
    module = Wrapped(len(bpe_tokenizer))
    trainer = fit(module, callback, tmp_path, 4, bpe_tokenizer)
    first = [dict(entry) for entry in callback.history]
    trainer.fit_loop.epoch_loop.max_steps = 8
    loader = DataLoader(torch.tensor([b["input_ids"] for b in corpus_blocks(bpe_tokenizer, lines=120)]), batch_size=4)
    trainer.fit(module, loader)
    assert trainer.global_step == 8 and [e["step"] for e in callback.history] == [0, 2, 4, 6, 8]
    assert callback.history[:3] == first  # kept, not scored again
    lines = [json.loads(line) for line in read_complete_lines(tmp_path / "tatblimp_history.jsonl")]
    assert [line["step"] for line in lines] == [0, 2, 4, 6, 8]
    assert callback._monitor.alerts.monitor.evaluations == 5


def test_a_run_resumed_from_a_checkpoint_continues_one_curve(tmp_path, bpe_tokenizer, small_data):
    options = dict(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2)
    first = TatBLiMPLightningCallback(**options)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    fit(Wrapped(len(bpe_tokenizer)), first, tmp_path, 4, bpe_tokenizer, checkpoint=checkpoint)
    assert [e["step"] for e in first.history] == [0, 2, 4]
    # Resumed from step 2 (the run went on to 4 and stopped): step 4 is scored again, once, and 6 follows.
    second, probe = TatBLiMPLightningCallback(**options), Probe()
    fit(
        Wrapped(len(bpe_tokenizer)),
        None,
        tmp_path,
        6,
        bpe_tokenizer,
        ckpt_path=tmp_path / "ckpt" / "step=2.ckpt",
        callbacks=[second, probe],
    )
    assert [e["step"] for e in second.history] == [0, 2, 4, 6]
    # Before its first evaluation (step 4), the resumed run's monitored keys hold the checkpoint's last values.
    assert probe.seen[3] == first.history[1]["tatblimp/acc_norm"]
    assert second.history[:2] == first.history[:2]  # restored from the checkpoint, not scored again
    import json

    lines = [json.loads(line) for line in read_complete_lines(tmp_path / "tatblimp_history.jsonl")]
    assert [line["step"] for line in lines] == [0, 2, 4, 6]
    assert [line["acc_norm"] for line in lines] == [e["tatblimp/acc_norm"] for e in second.history]
    # The alerts' per-run sequence went on from the checkpoint's evaluations (0 and 2), and a replay of the file agrees.
    from tatblimp_callback.results.regressions import recorded_alerts, replay_alerts

    assert second._monitor.alerts.monitor.evaluations == 4
    assert recorded_alerts(lines) == replay_alerts(lines)
    # Each line names its run's plan: 3 evaluations for max_steps=4 (0, 2, 4), then 4 for the resumed max_steps=6.
    # The budget spent: 0.45 at step 2 (0.9 over 2 comparisons), then what was left, 0.45, over the 2 comparisons
    # still planned (4 and 6): 0.9 of alert_q in all, not 0.45 + 2 x 0.3.
    assert [line["alert_plan"] for line in lines] == [3, 3, 4, 4]
    assert second._monitor.alerts.monitor.spending.total == pytest.approx(0.9)


def test_the_model_is_found_named_or_refused_clearly(tmp_path, bpe_tokenizer, small_data):
    options = dict(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    named = TatBLiMPLightningCallback(model="lm", **options)
    fit(Wrapped(len(bpe_tokenizer), "lm"), named, tmp_path / "named", 1, bpe_tokenizer)
    assert [e["step"] for e in named.history] == [0, 1]
    found = TatBLiMPLightningCallback(**options)  # no `model` attribute: the one PreTrainedModel
    fit(Wrapped(len(bpe_tokenizer), "backbone"), found, tmp_path / "found", 1, bpe_tokenizer)
    assert [e["step"] for e in found.history] == [0, 1]
    assert found.history[0]["tatblimp/acc"] == named.history[0]["tatblimp/acc"]  # the same seed: the same model

    class Two(Wrapped):
        def __init__(self, vocab_size):
            super().__init__(vocab_size, "student")
            self.teacher = tiny_llama(vocab_size)

    with pytest.raises(ValueError, match=r"2 PreTrainedModels.*pass model="):
        fit(Two(len(bpe_tokenizer)), TatBLiMPLightningCallback(**options), tmp_path / "two", 1, bpe_tokenizer)
    with pytest.raises(ValueError, match="has no such module"):
        fit(Wrapped(len(bpe_tokenizer)), TatBLiMPLightningCallback(model="lm", **options), tmp_path / "x", 1, bpe_tokenizer)
    with pytest.raises(ValueError, match="eval_every_n_steps"):
        TatBLiMPLightningCallback(eval_every_n_steps=0)


def test_importing_the_package_does_not_import_lightning():
    code = "import sys, tatblimp_callback; assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def fail_evaluation(monkeypatch, call: int) -> None:
    """Make the ``call``-th evaluation (counting from 1) raise ``RuntimeError("injected")``, once."""
    from tatblimp_callback import evaluation

    score, calls = evaluation.Evaluator.__call__, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected")
        return score(self, *args, **kwargs)

    monkeypatch.setattr(evaluation.Evaluator, "__call__", failing)


def test_a_scoring_error_is_logged_and_counted_and_training_goes_on(tmp_path, bpe_tokenizer, small_data, monkeypatch):
    fail_evaluation(monkeypatch, 2)
    options = dict(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    callback, probe = TatBLiMPLightningCallback(**options), Probe()
    trainer = fit(Wrapped(len(bpe_tokenizer)), None, tmp_path / "goes-on", 3, bpe_tokenizer, callbacks=[callback, probe])
    assert trainer.global_step == 3 and callback.failures == 1
    assert probe.seen[1] != probe.seen[1]  # the failed step's keys are NaN (never the last value, of other weights)
    assert probe.seen[2] == callback.history[1]["tatblimp/acc_norm"]
    assert [e["step"] for e in callback.history] == [0, 2, 3]  # step 1 failed: no point there
    assert callback.history[-1]["tatblimp/failures"] == 1.0
    with (tmp_path / "goes-on" / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(r["step"]), r["tatblimp/failures"]) for r in rows] == [(0, ""), (1, "1.0"), (2, "1.0"), (3, "1.0")]
    monkeypatch.undo()
    fail_evaluation(monkeypatch, 2)  # counted afresh
    with pytest.raises(RuntimeError, match="injected"):
        fit(
            Wrapped(len(bpe_tokenizer)),
            TatBLiMPLightningCallback(raise_on_error=True, **options),
            tmp_path / "raise",
            3,
            bpe_tokenizer,
        )


def blimp_slice(folder: Path) -> Path:
    """30 lines of BLiMP's passive_1 (one of them a pair of identical sentences, left out) as a suite file."""
    from conftest import SHARED

    blimp = folder / "passive_1.jsonl"
    source = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")
    blimp.write_text("\n".join(source[300:330]) + "\n", encoding="utf-8")
    return blimp


def test_suites_and_gradient_accumulation_one_row_per_evaluation(tmp_path, bpe_tokenizer, small_data):
    blimp = blimp_slice(tmp_path)
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer,
        data=small_data,
        allow_modified=True,
        eval_every_n_steps=2,
        suites={"blimp": blimp},
        suite_every=2,
    )
    blocks = torch.tensor([b["input_ids"] for b in corpus_blocks(bpe_tokenizer, lines=120)])
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        accumulate_grad_batches=2,  # two batches end at each global step: still one evaluation per step
        default_root_dir=str(tmp_path),
        logger=CSVLogger(str(tmp_path), name="csv"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wrapped(len(bpe_tokenizer)), DataLoader(blocks, batch_size=2))
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    assert [bool(r["blimp/acc"]) for r in rows] == [True, False, True]  # every 2nd evaluation: the first and the third
    assert float(rows[2]["blimp/acc"]) == callback.last_results.suites["blimp"].acc
    suite_lines = list(read_complete_lines(tmp_path / "tatblimp_history.blimp.jsonl"))
    assert len(suite_lines) == 2


def test_without_eval_on_start_or_end_only_the_multiples_are_scored(tmp_path, bpe_tokenizer, small_data, caplog):
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer,
        data=small_data,
        allow_modified=True,
        eval_every_n_steps=2,
        eval_on_start=False,
        eval_on_end=False,
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="tatblimp/acc_norm", mode="max", every_n_train_steps=2)
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        fit(Wrapped(len(bpe_tokenizer)), callback, tmp_path, 5, bpe_tokenizer, checkpoint=checkpoint)
    assert [e["step"] for e in callback.history] == [2, 4]
    # A monitor of a key that is not there before the first evaluation is told so; its schedule is aligned.
    assert "with eval_on_start=False, tatblimp/acc_norm is there only from the first evaluation (step 2)" in caplog.text
    assert "checks every" not in caplog.text
    assert checkpoint.best_model_score.item() == max(e["tatblimp/acc_norm"] for e in callback.history)


@pytest.mark.slow
def test_harness_tasks_are_logged_as_the_harness_scores_the_final_weights(tmp_path, bpe_tokenizer, small_data, monkeypatch):
    """``lm_eval_tasks`` in the Lightning callback: ``lm_eval/<task>/<metric>`` in the CSV log at every evaluation,
    the last the numbers of lm-evaluation-harness's own ``hf`` model on the trained weights."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from conftest import DATA
    from tatblimp_callback.harness import task_path

    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))  # the harness task reads the official file
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer,
        data=small_data,
        allow_modified=True,
        eval_every_n_steps=2,
        lm_eval_tasks=["tatblimp_binding"],
        lm_eval_limit=20,
    )
    module = Wrapped(len(bpe_tokenizer))
    fit(module, callback, tmp_path, 4, bpe_tokenizer)
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    assert all(r["lm_eval/tatblimp_binding/acc_norm"] for r in rows)
    harness = simple_evaluate(
        model=HFLM(pretrained=module.model.eval(), tokenizer=bpe_tokenizer, batch_size=8),
        tasks=["tatblimp_binding"],
        task_manager=TaskManager(include_path=str(task_path()), include_defaults=False),
        limit=20,
    )["results"]["tatblimp_binding"]
    for metric in ("acc", "acc_norm"):
        assert float(rows[-1][f"lm_eval/tatblimp_binding/{metric}"]) == pytest.approx(harness[f"{metric},none"], abs=1e-6)
