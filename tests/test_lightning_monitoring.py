"""Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` monitoring ``tatblimp/acc_norm`` in real ``lightning.Trainer``
runs on the CPU: the checkpoint kept is the step that scored best, the run stops where EarlyStopping's rule says,
and a check at a step that was not scored reads the last evaluation's value instead of raising.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from tatblimp_callback.lightning import TatBLiMPLightningCallback
from tatblimp_callback.reading.jsonl import read_complete_lines
from test_lightning import Probe, Wrapped, blimp_slice, fail_evaluation, fit, fresh_metrics


class Perturbed(L.Callback):
    """Moves the weights by seeded noise after each optimizer step up to ``until``: scores that go up and down."""

    def __init__(self, until: int = 10**9, scale: float = 0.05):
        self.until, self.scale = until, scale

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step <= self.until:
            generator = torch.Generator().manual_seed(trainer.global_step)
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * self.scale)


def history_lines(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in read_complete_lines(path)]


def test_model_checkpoint_keeps_the_best_scored_step_whatever_the_callback_order(tmp_path, bpe_tokenizer, small_data):
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="tatblimp/acc_norm", mode="max", every_n_train_steps=1, save_top_k=1, filename="{step}"
    )
    # ModelCheckpoint listed first: Lightning runs checkpoints after the other callbacks, so after the scoring.
    fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 6, bpe_tokenizer, callbacks=[checkpoint, Perturbed(), callback])
    lines = history_lines(tmp_path / "tatblimp_history.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5, 6]
    best = max(lines[1:], key=lambda line: line["acc_norm"])  # step 0 comes before training: never a checkpoint
    assert best["step"] != lines[-1]["step"]  # the best is not merely the last
    assert Path(checkpoint.best_model_path).name == f"step={best['step']}.ckpt"
    assert checkpoint.best_model_score.item() == best["acc_norm"]
    # The best checkpoint holds the very weights that scored best.
    state = torch.load(checkpoint.best_model_path, weights_only=False)["state_dict"]
    weights = {name.removeprefix("model."): value for name, value in state.items()}
    assert fresh_metrics(weights, bpe_tokenizer, small_data)["tatblimp/acc_norm"] == best["acc_norm"]


@pytest.mark.parametrize("checked_at", ["epoch end", "validation end"])
def test_early_stopping_stops_when_acc_norm_stops_improving(tmp_path, bpe_tokenizer, small_data, checked_at, caplog):
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2)
    # strict (the default): a missing key raises
    stopping = EarlyStopping(
        monitor="tatblimp/acc_norm", mode="max", patience=2, check_on_train_epoch_end=checked_at == "epoch end"
    )
    if checked_at == "epoch end":  # two batches an epoch, up to 20 epochs
        options, most = dict(rows=8, max_epochs=20), 40
    else:  # one epoch of 15 batches, a validation run every 2
        options, most = dict(max_epochs=1, val=True, val_check_interval=2, num_sanity_val_steps=0), 15
    # The weights change up to step 4, then stay.
    callbacks = [stopping, Perturbed(until=4, scale=0.1), callback]
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        trainer = fit(Wrapped(len(bpe_tokenizer), lr=0.0), None, tmp_path, -1, bpe_tokenizer, callbacks=callbacks, **options)
    assert "tatblimp:" not in caplog.text  # scored at every check: nothing to warn about
    checked = [(e["step"], e["tatblimp/acc_norm"]) for e in callback.history if e["step"] > 0]
    best, wait, stop = float("-inf"), 0, None
    for step, value in checked:  # EarlyStopping's rule over the scores it saw
        best, wait = (value, 0) if value > best else (best, wait + 1)
        if wait >= stopping.patience:
            stop = step
            break
    assert stop is not None and stop < most
    assert trainer.global_step == stop
    assert stopping.best_score.item() == best == max(v for _, v in checked)
    assert [e["step"] for e in callback.history] == list(range(0, stop + 1, 2))


def test_between_evaluations_the_monitored_keys_keep_the_last_value(tmp_path, bpe_tokenizer, small_data, caplog):
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="tatblimp/acc_norm", mode="max", every_n_train_steps=1)
    probe = Probe()
    # A validation run every 2 batches: ModelCheckpoint then raises on a monitored key that is missing.
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        fit(
            Wrapped(len(bpe_tokenizer)),
            None,
            tmp_path,
            5,
            bpe_tokenizer,
            callbacks=[callback, probe, checkpoint],
            val=True,
            val_check_interval=2,
            num_sanity_val_steps=0,
        )
    values = {e["step"]: e["tatblimp/acc_norm"] for e in callback.history}
    assert sorted(values) == [0, 2, 4, 5]
    assert probe.seen == {1: values[0], 2: values[2], 3: values[2], 4: values[4], 5: values[5]}
    assert "checks every 1 steps, TatBLiMP is scored every 2" in caplog.text
    assert checkpoint.best_model_score.item() == max(probe.seen.values())


def test_the_last_step_of_an_epoch_run_is_scored_before_the_epoch_end_checkpoint(tmp_path, bpe_tokenizer, small_data, caplog):
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="tatblimp/acc_norm", mode="max", save_top_k=-1)
    # Two epochs of two steps: scored at 0, 3 and the last, 4, which the checkpoint at the end of epoch 1 reads.
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        callbacks = [Perturbed(), callback, checkpoint]
        fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, -1, bpe_tokenizer, callbacks=callbacks, rows=8, max_epochs=2)
    assert "ModelCheckpoint(monitor='tatblimp/acc_norm') checks every 2 steps, TatBLiMP is scored every 3" in caplog.text
    values = {e["step"]: e["tatblimp/acc_norm"] for e in callback.history}
    assert sorted(values) == [0, 3, 4] and values[4] != values[3]
    scores = {Path(path).name: score.item() for path, score in checkpoint.best_k_models.items()}
    assert scores == {"epoch=0-step=2.ckpt": values[0], "epoch=1-step=4.ckpt": values[4]}


def test_a_checkpoint_on_a_suite_key_never_ranks_a_stale_suite_score(tmp_path, bpe_tokenizer, small_data, caplog):
    suites = dict(suites={"blimp": blimp_slice(tmp_path)}, suite_every={"blimp": 2})  # blimp at every 2nd evaluation
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1, **suites
    )
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="blimp/acc_norm", mode="max", every_n_train_steps=1, save_top_k=1, filename="{step}"
    )
    probe = Probe("blimp/acc_norm")
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 4, bpe_tokenizer, callbacks=[Perturbed(), callback, probe, checkpoint])
    assert "blimp is scored at every 2-th evaluation only (suite_every), every 2 steps" in caplog.text
    scored = {e["step"]: e["blimp/acc_norm"] for e in callback.history if "blimp/acc_norm" in e}
    assert sorted(scored) == [0, 2, 4]
    # The steps whose evaluation skipped blimp read NaN, never step 0's (or 2's) blimp score.
    assert [step for step, value in probe.seen.items() if value != value] == [1, 3]
    assert {step: probe.seen[step] for step in (2, 4)} == {2: scored[2], 4: scored[4]}
    best = max((2, 4), key=lambda step: scored[step])
    assert Path(checkpoint.best_model_path).name == f"step={best}.ckpt"
    assert checkpoint.best_model_score.item() == scored[best]


def test_early_stopping_on_a_suite_key_that_suite_every_skips_is_warned_of(tmp_path, bpe_tokenizer, small_data, caplog):
    from tatblimp_callback.training.lightning_monitoring import warn_about_monitors

    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer, data=small_data, suites={"blimp": small_data}, suite_every=3, eval_every_n_steps=2
    )
    trainer = L.Trainer(callbacks=[callback, EarlyStopping(monitor="blimp/acc_norm", mode="max")], logger=False)
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        warn_about_monitors(trainer, callback)
    assert (
        "EarlyStopping(monitor='blimp/acc_norm'): blimp is scored at every 3-th evaluation only (suite_every), every 6 "
        "steps; at the evaluations between, blimp/acc_norm is NaN (ModelCheckpoint ranks it the worst, EarlyStopping "
        "counts it as no improvement); make the checks every 6 steps"
    ) in caplog.text
    caplog.clear()
    trainer = L.Trainer(callbacks=[callback, EarlyStopping(monitor="tatblimp/acc_norm", mode="max")], logger=False)
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        warn_about_monitors(trainer, callback)
    assert "suite_every" not in caplog.text  # TatBLiMP is scored at every evaluation


@pytest.mark.parametrize("unscored", ["failed evaluation", "suite skipped"])
def test_early_stopping_counts_an_unscored_evaluation_as_no_improvement(
    tmp_path, bpe_tokenizer, small_data, monkeypatch, caplog, unscored
):
    """One evaluation fails (or skips the monitored suite) at an epoch end: EarlyStopping reads NaN there, which the
    Trainer callback's EarlyStoppingCallback counts as no improvement; with check_finite=True, Lightning's default, it
    stopped the run at that step (issue #51: step 4 of 12 with patience=100)."""
    import csv

    options = dict(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    if unscored == "failed evaluation":  # the evaluation of step 4 fails; epochs of 2 steps: checked at 2, 4, ..., 12
        fail_evaluation(monkeypatch, 5)  # steps 0, 1, 2, 3, then 4
        monitor, rows, nan_steps, unscored_steps = "tatblimp/acc_norm", 8, [4], [4]
    else:  # blimp at every 2nd evaluation (even steps); epochs of 3 steps: checked at 3, 6, 9, 12
        options.update(suites={"blimp": blimp_slice(tmp_path)}, suite_every={"blimp": 2})
        monitor, rows, nan_steps, unscored_steps = "blimp/acc_norm", 12, [3, 9], list(range(1, 12, 2))
    callback = TatBLiMPLightningCallback(**options)
    stopping = EarlyStopping(monitor=monitor, mode="max", patience=100)  # check_finite=True, the default
    seen = Probe(monitor)
    with caplog.at_level("INFO", logger="tatblimp_callback"):
        trainer = fit(
            Wrapped(len(bpe_tokenizer)), None, tmp_path, 12, bpe_tokenizer, callbacks=[callback, seen, stopping], rows=rows
        )
    assert trainer.global_step == 12 and not trainer.should_stop and stopping.stopped_epoch == 0
    checks = list(range(rows // 4, 13, rows // 4))  # the epoch ends (4 rows a batch)
    assert [step for step in checks if seen.seen[step] != seen.seen[step]] == nan_steps  # NaN there, never a stale score
    best, wait = float("-inf"), 0
    for step in checks:  # the Trainer callback's rule: NaN is no improvement
        value = seen.seen[step]
        best, wait = (value, 0) if value > best else (best, wait + 1)
    assert stopping.best_score.item() == best and stopping.wait_count == wait
    assert stopping.check_finite is True  # the user's setting, as it was
    set_aside = [r.getMessage() for r in caplog.records if "check_finite" in r.getMessage()]
    assert set_aside == [
        f"tatblimp: step {step}: {monitor} was not scored (NaN): EarlyStopping(monitor={monitor!r}) counts it as no "
        "improvement, its check_finite set aside until the key is scored again"
        for step in unscored_steps
    ]
    if unscored == "failed evaluation":
        assert callback.failures == 1 and "scoring failed (failure 1); training continues" in caplog.text
        assert [e["step"] for e in callback.history] == [s for s in range(13) if s != 4]  # no curve point at 4
        with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
            logged = {int(r["step"]): r for r in csv.DictReader(handle)}
        # What step 4 logs: the count of failures, and no score of other weights.
        assert (logged[4]["tatblimp/failures"], logged[4]["tatblimp/acc_norm"]) == ("1.0", "")
        assert (logged[3]["tatblimp/failures"], logged[5]["tatblimp/failures"]) == ("", "1.0")


def test_a_finite_check_is_set_aside_only_while_its_key_holds_an_unscored_nan():
    from tatblimp_callback.training.lightning_monitoring import UnscoredChecks, expose

    ours = EarlyStopping(monitor="tatblimp/acc_norm", mode="max")
    other = EarlyStopping(monitor="val_loss", mode="min")
    trainer = L.Trainer(callbacks=[ours, other], logger=False)
    checks = UnscoredChecks()
    is_ours = lambda name: name.startswith("tatblimp/")  # noqa: E731
    expose(trainer, {"tatblimp/acc_norm": 0.5}, is_ours, 0, checks)
    assert ours.check_finite is True
    expose(trainer, {"tatblimp/failures": 1.0}, is_ours, 1, checks)  # a failed evaluation
    assert trainer.callback_metrics["tatblimp/acc_norm"].isnan() and ours.check_finite is False and other.check_finite
    expose(trainer, {"tatblimp/acc_norm": 0.6, "tatblimp/failures": 1.0}, is_ours, 2, checks)
    assert ours.check_finite is True
    expose(trainer, {"tatblimp/acc_norm": float("nan")}, is_ours, 3, checks)  # a NaN scoring gave: not set aside
    assert ours.check_finite is True
    expose(trainer, {}, is_ours, 4, checks)
    assert ours.check_finite is False
    checks.put_back()  # training ended, or stopped on an error
    assert ours.check_finite is True
    # A check the user turned off stays off.
    off = EarlyStopping(monitor="tatblimp/acc_norm", mode="max", check_finite=False)
    trainer = L.Trainer(callbacks=[off], logger=False)
    expose(trainer, {"tatblimp/acc_norm": 0.5}, is_ours, 0, checks)
    expose(trainer, {}, is_ours, 1, checks)
    checks.put_back()
    assert off.check_finite is False


def test_monitors_of_a_run_whose_every_evaluation_fails_read_nan_and_the_run_goes_on(tmp_path, bpe_tokenizer, caplog):
    """The benchmark file missing: every evaluation fails. The monitored key was never in ``callback_metrics`` (only
    keys already there got the NaN), and EarlyStopping ended the run at the first epoch end: "conditioned on metric
    'tatblimp/acc_norm' which is not available"."""
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=str(tmp_path / "moved.jsonl"), eval_every_n_steps=2)
    stopping = EarlyStopping(monitor="tatblimp/acc_norm", mode="max", patience=100)
    best = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="tatblimp/acc_norm", mode="max", every_n_train_steps=2)
    seen = Probe("tatblimp/acc_norm")
    trainer = fit(
        Wrapped(len(bpe_tokenizer)), None, tmp_path, 8, bpe_tokenizer, callbacks=[callback, seen, best, stopping], rows=8
    )
    assert trainer.global_step == 8 and stopping.stopped_epoch == 0 and callback.failures == 5  # steps 0, 2, 4, 6, 8
    assert callback.history == [] and all(value != value for value in seen.seen.values())  # NaN at every check
    assert stopping.check_finite is True
