"""The callback with ``suites=`` in real Trainer runs: a suite's metric selecting the best model while ``suite_every``
skips the suite at some evaluations; a scoring error that repeats, said once (#30)."""

from __future__ import annotations

import logging
import math

import pytest

from conftest import SHARED, tiny_llama
from tatblimp_callback import TatBLiMPCallback
from trainer_utils import corpus_blocks, make_trainer


@pytest.fixture(scope="module")
def blimp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blimp")
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")[300:324]
    (folder / "passive_1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.mark.parametrize("greater_is_better", [True, False])
def test_a_suite_metric_for_best_model_with_suite_every_trains_to_the_end(
    bpe_tokenizer, small_data, blimp, tmp_path, greater_is_better
):
    cb = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=100, suites={"blimp": blimp}, suite_every={"blimp": 2})
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb],
        max_steps=4,
        learning_rate=2e-2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="blimp/acc_norm",
        greater_is_better=greater_is_better,
        load_best_model_at_end=True,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    trainer.train()  # before the fix: KeyError 'eval_blimp/acc_norm' at step 1, whose evaluation skips BLiMP
    assert trainer.state.global_step == 4
    # Evaluations 0 (the start), 2 and 4 score BLiMP; 1 and 3 skip it and give the Trainer NaN.
    evaluations = {e["step"]: e["eval_blimp/acc_norm"] for e in trainer.state.log_history if "eval_loss" in e}
    assert list(evaluations) == [1, 2, 3, 4]
    assert math.isnan(evaluations[1]) and math.isnan(evaluations[3])
    measured = {e["step"]: e["blimp/acc_norm"] for e in cb.history if "blimp/acc_norm" in e}
    assert list(measured) == [0, 2, 4] and evaluations[2] == measured[2] and evaluations[4] == measured[4]
    # The best is chosen among the measured evaluations only, in the direction asked for (the first on a tie).
    pick = max if greater_is_better else min
    best = pick(measured[2], measured[4])
    best_step = 2 if measured[2] == best else 4
    assert trainer.state.best_metric == best and trainer.state.best_global_step == best_step
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")


def test_a_repeated_error_with_suites_gets_one_traceback(bpe_tokenizer, small_data, blimp, tmp_path, caplog):
    cb = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=2, suites={"blimp": blimp}, suite_every=2)
    model = tiny_llama(len(bpe_tokenizer), max_position_embeddings=16)  # shorter than the sentences: every evaluation fails
    trainer = make_trainer(model, bpe_tokenizer, tmp_path, [cb], max_steps=4, max_grad_norm=1.0)
    with caplog.at_level(logging.ERROR):
        trainer.train()
    assert cb.failures == 3 and trainer.state.global_step == 4
    with_traceback = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    # Before: a traceback at every evaluation (the error log was keyed by a new functools.partial each time).
    assert len(with_traceback) == 1 and "cannot score this model" in with_traceback[0]
    assert sum("(as before)" in r.getMessage() for r in caplog.records) == 3


def test_a_metric_for_best_model_the_callback_never_logs_is_named_once(bpe_tokenizer, small_data, blimp, tmp_path, caplog):
    cb = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=100, suites={"blimp": blimp})
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb],
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="blimp/acc_normm",  # a typo: NaN at every evaluation, the run goes on
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.best_metric == -math.inf  # the Trainer's start: never improved
    said = [r.getMessage() for r in caplog.records if "is not a key the callback logs" in r.getMessage()]
    assert len(said) == 1 and "'blimp/acc_normm'" in said[0] and "blimp/acc_norm" in said[0]
