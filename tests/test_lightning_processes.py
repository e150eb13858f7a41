"""What each process of a Lightning run does, and two TatBLiMP callbacks in one Trainer: only the global rank 0
logs (curve points, regression alerts' warnings, wandb alerts), every rank holds the same metrics and state, and
each callback keeps (and restores) its own state."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_llama, write_pairs

pytest.importorskip("lightning")
import lightning as L

from tatblimp_callback import Evaluator
from tatblimp_callback.lightning import TatBLiMPLightningCallback
from test_lightning import Wrapped, fit


@pytest.fixture(scope="module")
def falling_data(tmp_path_factory, records, bpe_tokenizer):
    """60 pairs that tiny_llama(seed 0) all passes (acc_norm 1.0), each pair in the order it prefers: another
    model's weights then score about 0.5 on them, a fall McNemar calls significant."""
    chosen = records[::20][:60]
    path = write_pairs(tmp_path_factory.mktemp("falling") / "falling.jsonl", chosen)
    results = Evaluator(bpe_tokenizer, path, allow_modified=True)(tiny_llama(len(bpe_tokenizer)))
    ordered = [r if p.passed_norm else {**r, "good": r["bad"], "bad": r["good"]} for r, p in zip(chosen, results.pairs)]
    path = write_pairs(path, ordered)
    assert Evaluator(bpe_tokenizer, path, allow_modified=True)(tiny_llama(len(bpe_tokenizer))).acc_norm == 1.0
    return path


class OtherWeights(L.Callback):
    """At the end of step k (a key of ``seeds``), the model holds the random model ``seeds[k]``'s weights."""

    def __init__(self, seeds: dict[int, int] | None = None):
        self.seeds = seeds or {1: 1}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.seeds:
            seed = self.seeds[trainer.global_step]
            pl_module.model.load_state_dict(tiny_llama(pl_module.model.config.vocab_size, seed=seed).state_dict())


class Alerts:
    def __init__(self):
        self.sent = []

    def alert(self, **kwargs):
        self.sent.append(kwargs["title"])


@pytest.mark.parametrize("rank_zero", [True, False])
def test_only_the_global_rank_zero_warns_and_sends_regression_alerts(
    tmp_path, bpe_tokenizer, falling_data, monkeypatch, caplog, rank_zero
):
    from tatblimp_callback.training import alerts

    run = Alerts()
    monkeypatch.setattr(alerts, "wandb_run", lambda: run)
    if not rank_zero:  # this process is another rank than 0, as Lightning's strategy says
        monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
        # The run's alert count is rank 0's (a maximum over the processes): here rank 0, absent, would send the
        # count of the same comparisons this process made.
        monkeypatch.setattr(
            alerts, "distributed", SimpleNamespace(check_in=lambda **kw: (True, len(callback._monitor.alerts.alerts)))
        )
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer, data=falling_data, allow_modified=True, eval_every_n_steps=1, history_file=None
    )
    module = Wrapped(len(bpe_tokenizer), lr=0.0)
    module.model.load_state_dict(tiny_llama(len(bpe_tokenizer)).state_dict())
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        trainer = fit(module, None, tmp_path, 2, bpe_tokenizer, callbacks=[OtherWeights(), callback])
    assert callback.history[0]["tatblimp/acc_norm"] == 1.0
    assert callback.history[1]["tatblimp/acc_norm"] < 0.7
    # Every rank counts the alerts alike (the same callback_metrics and checkpointed state on each).
    assert callback.history[1]["tatblimp/alerts"] >= 1
    assert trainer.callback_metrics["tatblimp/alerts"].item() == callback.history[-1]["tatblimp/alerts"]
    assert callback.state_dict()["entries"] == callback.history
    warned = caplog.text.count("REGRESSION")
    if rank_zero:
        assert warned >= 1 and "tatblimp: overall fell" in run.sent and len(run.sent) == warned
    else:
        assert warned == 0 and run.sent == []


def test_two_callbacks_in_one_trainer_each_keep_and_restore_their_own_state(tmp_path, bpe_tokenizer, small_data, records):
    from lightning.pytorch.callbacks import ModelCheckpoint

    heldout = write_pairs(tmp_path / "heldout.jsonl", records[100:130])

    def callbacks():
        common = dict(tokenizer=bpe_tokenizer, allow_modified=True, eval_every_n_steps=2)
        return (
            TatBLiMPLightningCallback(data=small_data, **common),
            TatBLiMPLightningCallback(data=heldout, log_prefix="heldout", history_file="heldout_history.jsonl", **common),
        )

    main, other = callbacks()
    assert main.state_key != other.state_key and "heldout" in other.state_key
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 4, bpe_tokenizer, callbacks=[main, other, checkpoint])
    assert [e["step"] for e in main.history] == [0, 2, 4] == [e["step"] for e in other.history]
    assert "tatblimp/acc_norm" in main.history[0] and "heldout/acc_norm" in other.history[0]
    assert main.history[0]["tatblimp/acc_norm"] != other.history[0]["heldout/acc_norm"]  # other pairs, other scores
    saved = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=False)["callbacks"]
    assert saved[main.state_key]["entries"] == main.history[:2]
    assert saved[other.state_key]["entries"] == other.history[:2]
    # Resumed from step 2: each callback gets its own points back (not scored again), and goes on.
    main_again, other_again = callbacks()
    resumed = dict(ckpt_path=tmp_path / "ckpt" / "step=2.ckpt", callbacks=[other_again, main_again])  # the other order
    fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 6, bpe_tokenizer, **resumed)
    assert main_again.history[:2] == main.history[:2] and other_again.history[:2] == other.history[:2]
    assert [e["step"] for e in main_again.history] == [0, 2, 4, 6] == [e["step"] for e in other_again.history]
    lines = [json.loads(line) for line in (tmp_path / "heldout_history.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4, 6] and lines[0]["n"] == 30


def test_two_callbacks_logging_one_suite_name_are_refused(tmp_path, bpe_tokenizer, small_data):
    """Their keys collided: the loggers got two values of blimp/acc_norm a step, the monitors whichever came last."""
    from test_lightning import blimp_slice

    suite = {"blimp": blimp_slice(tmp_path)}
    common = dict(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2, suites=suite)
    both = [TatBLiMPLightningCallback(**common), TatBLiMPLightningCallback(log_prefix="heldout", **common)]
    with pytest.raises(ValueError, match=r"log_prefix 'tatblimp' and 'heldout'\) would log under the same keys \(blimp/\.\.\.\)"):
        fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 2, bpe_tokenizer, callbacks=both)


def test_a_failed_evaluation_keeps_the_suite_schedule(tmp_path, bpe_tokenizer, small_data, monkeypatch):
    """``suite_every`` counts evaluations, failed ones too: one failure moved the suite to other steps for the rest
    of the run (4 and 8 became 6 and 10), where a checkpoint every 4 steps, as the callback advises, read NaN."""
    from test_lightning import blimp_slice, fail_evaluation

    fail_evaluation(monkeypatch, 2)
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=2,
        suites={"blimp": blimp_slice(tmp_path)}, suite_every={"blimp": 2},
    )  # fmt: skip
    fit(Wrapped(len(bpe_tokenizer)), callback, tmp_path, 12, bpe_tokenizer)
    assert callback.failures == 1 and [e["step"] for e in callback.history] == [0, 4, 6, 8, 10, 12]
    assert [e["step"] for e in callback.history if "blimp/acc_norm" in e] == [0, 4, 8, 12]


def test_after_a_failed_evaluation_the_scores_are_nan_and_the_counts_stay(tmp_path, bpe_tokenizer, falling_data, monkeypatch):
    from test_lightning import Probe, fail_evaluation

    fail_evaluation(monkeypatch, 3)
    callback = TatBLiMPLightningCallback(
        tokenizer=bpe_tokenizer, data=falling_data, allow_modified=True, eval_every_n_steps=1, history_file=None
    )
    module = Wrapped(len(bpe_tokenizer), lr=0.0)
    module.model.load_state_dict(tiny_llama(len(bpe_tokenizer)).state_dict())
    alerts, score_probe = Probe("tatblimp/alerts"), Probe("tatblimp/acc_norm")
    fit(module, None, tmp_path, 2, bpe_tokenizer, callbacks=[OtherWeights({1: 1, 2: 2}), callback, alerts, score_probe])
    assert callback.failures == 1 and [e["step"] for e in callback.history] == [0, 1]  # step 2 failed
    count = callback.history[1]["tatblimp/alerts"]
    assert count >= 1 and alerts.seen == {1: count, 2: count}  # the run's count, also at the failed step
    assert score_probe.seen[2] != score_probe.seen[2]  # NaN: step 2's weights were not scored
