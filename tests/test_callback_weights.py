"""Every TatBLiMP score labelled with the weights it measured, in real Trainer runs: the best checkpoint loaded
at the end, an evaluation before training, a crash mid-append, an unwritable cache file, a setting that fails
every evaluation."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback, evaluate
from trainer_utils import corpus_blocks, make_trainer, tatblimp_entries

pytestmark = pytest.mark.slow  # real Trainer runs


def callback(small_data, **options):
    return TatBLiMPCallback(data=small_data, allow_modified=True, **options)


def history_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_evaluate_after_load_best_model_at_end_scores_the_loaded_weights(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=2)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb],
        max_steps=8,
        learning_rate=5e-2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="tatblimp/acc_norm",
        load_best_model_at_end=True,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    trainer.train()
    best_step = trainer.state.best_global_step
    curve = {e["step"]: e["tatblimp/acc_norm"] for e in tatblimp_entries(trainer)}
    assert best_step != 8 and curve[best_step] != curve[8], curve  # the test needs a best checkpoint unlike the last

    metrics = trainer.evaluate()  # train(); evaluate(); save_metrics(): the loaded best weights, at step 8
    fresh = evaluate(trainer.model, bpe_tokenizer, small_data, allow_modified=True)
    assert metrics["eval_tatblimp/acc_norm"] == fresh.acc_norm == trainer.state.best_metric == curve[best_step]
    assert metrics["eval_tatblimp/acc"] == fresh.acc
    from tatblimp_callback.engine.model_checks import weights_label

    # One curve point per step still, and the history file names the weights each line measured.
    assert [e["step"] for e in tatblimp_entries(trainer)] == [0, 2, 4, 6, 8]
    lines = {r["step"]: r for r in history_lines(tmp_path / "tatblimp_history.jsonl")}
    assert lines[best_step]["weights"] == fresh.run_info["weights"] == weights_label(trainer.model)
    assert lines[8]["weights"] != weights_label(trainer.model)
    # The evaluation entry the Trainer keeps (trainer_state.json, the model card) has the keys too.
    assert trainer.state.log_history[-1]["eval_tatblimp/acc_norm"] == fresh.acc_norm


def test_evaluate_before_train_scores_the_untrained_model(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=2)
    model = tiny_llama(len(bpe_tokenizer))
    trainer = make_trainer(model, bpe_tokenizer, tmp_path, [cb], eval_dataset=corpus_blocks(bpe_tokenizer, lines=8))
    metrics = trainer.evaluate()  # a zero-shot baseline, before any train()
    baseline = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert metrics["eval_tatblimp/acc_norm"] == baseline.acc_norm and metrics["eval_tatblimp/acc"] == baseline.acc
    evaluation = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluation) == 1 and evaluation[0]["eval_tatblimp/acc_norm"] == baseline.acc_norm
    assert not (tmp_path / "tatblimp_history.jsonl").exists()  # an evaluation-only script leaves a run's file alone
    trainer.train()  # and training afterwards starts its curve as usual
    assert [e["step"] for e in tatblimp_entries(trainer)] == [0, 2, 4, 5] and cb.failures == 0


def test_a_partial_last_history_line_is_dropped_on_resume(bpe_tokenizer, small_data, tmp_path, caplog):
    options = dict(max_steps=6, save_strategy="steps", save_steps=3)
    straight = callback(small_data, eval_steps=2)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [straight], **options).train()
    path = tmp_path / "run" / "tatblimp_history.jsonl"
    expected = history_lines(path)
    # The crash came while step 6's line was being appended: half of it is on disk.
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + text.split("\n")[-2][:100], encoding="utf-8")

    resumed = callback(small_data, eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [resumed], **options)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert "cannot use the history file" not in caplog.text and "partial line" in caplog.text
    lines = history_lines(path)
    assert [r["step"] for r in lines] == [0, 2, 4, 6]  # every step once: the abandoned 4 and the partial 6 replaced
    assert [r["acc_norm"] for r in lines] == [r["acc_norm"] for r in expected]


def test_an_unwritable_cache_file_warns_once_and_scoring_goes_on(bpe_tokenizer, small_data, tmp_path, caplog, monkeypatch):
    import tatblimp_callback.tokenized.cache as cache_module

    encoded = []
    real_encode = cache_module.encode_sentences
    monkeypatch.setattr(cache_module, "encode_sentences", lambda *a, **k: encoded.append(1) or real_encode(*a, **k))
    (tmp_path / "a-file").write_text("not a folder", encoding="utf-8")
    cb = callback(small_data, eval_steps=2, cache_path=tmp_path / "a-file" / "cache.safetensors")
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [cb], max_steps=4)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert [h["step"] for h in cb.history] == [0, 2, 4] and cb.failures == 0
    assert encoded == [1]  # tokenized once, kept in memory
    assert caplog.text.count("cannot write the tokenized benchmark") == 1 and "a-file" in caplog.text

    made = callback(small_data, eval_steps=2, cache_path=tmp_path / "new" / "folder" / "cache.safetensors")
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run2", [made], max_steps=2).train()
    assert (tmp_path / "new" / "folder" / "cache.safetensors").is_file() and made.failures == 0


def test_a_context_shorter_than_a_sentence_is_said_once_then_counted(bpe_tokenizer, small_data, tmp_path, caplog):
    cb = callback(small_data, eval_steps=2)
    model = tiny_llama(len(bpe_tokenizer), max_position_embeddings=16)
    trainer = make_trainer(model, bpe_tokenizer, tmp_path, [cb], max_steps=4, max_grad_norm=1.0)
    with caplog.at_level(logging.ERROR):
        trainer.train()
    assert cb.failures == 3  # steps 0, 2 and 4; preparing is not a scoring point
    with_traceback = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(with_traceback) == 1 and "cannot score this model" in with_traceback[0] and "truncate=True" in with_traceback[0]
    assert sum("(as before)" in r.getMessage() for r in caplog.records) == 3


def test_an_error_that_comes_back_after_a_success_gets_its_traceback_again(
    bpe_tokenizer, small_data, tmp_path, caplog, monkeypatch
):
    from tatblimp_callback import Evaluator

    real_call, calls = Evaluator.__call__, []

    def fails_at_steps_0_and_4(self, model, *args, **kwargs):  # evaluations 1 and 3 of 0, 2, 4
        calls.append(1)
        if len(calls) in (1, 3):
            raise RuntimeError("the disk is full")
        return real_call(self, model, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "__call__", fails_at_steps_0_and_4)
    cb = callback(small_data, eval_steps=2)
    with caplog.at_level(logging.ERROR):
        make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=4).train()
    assert cb.failures == 2 and [h["step"] for h in cb.history] == [2]
    with_traceback = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(with_traceback) == 2 and all("RuntimeError: the disk is full" in text for text in with_traceback)
    assert not any("(as before)" in r.getMessage() for r in caplog.records)
