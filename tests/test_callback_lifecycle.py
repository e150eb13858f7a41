"""TatBLiMPCallback through a run's whole life, in real Trainer runs: resume, best-model selection and early
stopping on TatBLiMP, the final score labelled with the weights it measured, several train() calls."""

from __future__ import annotations

import json

import pytest
from transformers import EarlyStoppingCallback, LlamaForCausalLM, TrainerCallback

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback, evaluate
from tatblimp_callback.cli import main as cli_main
from trainer_utils import corpus_blocks, make_trainer, tatblimp_entries


def callback(small_data, **options):
    return TatBLiMPCallback(data=small_data, allow_modified=True, **options)


def fresh_score(checkpoint, tokenizer, data):
    return evaluate(LlamaForCausalLM.from_pretrained(checkpoint), tokenizer, data, allow_modified=True)


def timeless(entries: list[dict]) -> list[dict]:
    """The entries without the seconds an evaluation took and when it was made, which differ between any two runs."""
    return [{k: v for k, v in e.items() if not k.endswith("seconds") and k != "created"} for e in entries]


def history_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("eval_steps", [2, 3])
def test_a_resumed_run_has_the_curves_of_an_uninterrupted_one(bpe_tokenizer, small_data, tmp_path, monkeypatch, eval_steps):
    options = dict(max_steps=6, save_strategy="steps", save_steps=3)
    cache = tmp_path / "cache.safetensors"
    whole = callback(small_data, eval_steps=eval_steps, cache_path=cache)
    straight = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [whole], **options)
    straight.train()
    expected_file = history_lines(tmp_path / "run" / "tatblimp_history.jsonl")

    # The same run, resumed from step 3 in the same folder: its file holds the abandoned steps 4 to 6 until then.
    import tatblimp_callback.tokenized.cache as cache_module

    encoded = []
    real_encode = cache_module.encode_sentences
    monkeypatch.setattr(cache_module, "encode_sentences", lambda *a, **k: encoded.append(1) or real_encode(*a, **k))
    resumed_cb = callback(small_data, eval_steps=eval_steps, cache_path=cache)
    resumed = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [resumed_cb], **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))

    steps = list(range(0, 7, eval_steps))
    assert [e["step"] for e in tatblimp_entries(resumed)] == steps  # none repeated, none missing
    assert timeless(tatblimp_entries(resumed)) == timeless(tatblimp_entries(straight))
    assert timeless(resumed_cb.history) == timeless(whole.history) and [h["step"] for h in resumed_cb.history] == steps
    assert resumed_cb.acquisition == whole.acquisition and resumed_cb.failures == 0
    assert encoded == []  # the tokenized benchmark came from cache_path
    resumed_file = history_lines(tmp_path / "run" / "tatblimp_history.jsonl")
    assert [r["step"] for r in resumed_file] == steps
    assert timeless(resumed_file) == timeless(expected_file)


def test_failures_continue_across_a_resume(bpe_tokenizer, tmp_path, caplog):
    options = dict(max_steps=4, save_strategy="steps", save_steps=2)
    first = TatBLiMPCallback(data=tmp_path / "missing.jsonl", eval_steps=2)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [first], **options).train()
    # Said once at the start, with its traceback, and not counted; then one failure per scoring point: steps 0, 2, 4.
    assert first.failures == 3
    with_traceback = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(with_traceback) == 1 and "cannot score this model" in with_traceback[0]
    second = TatBLiMPCallback(data=tmp_path / "missing.jsonl", eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [second], **options)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    # Up to step 2: steps 0 and 2 (2 failures, restored); after the resume: step 4.
    assert second.failures == 3
    assert [(e["step"], e["tatblimp/failures"]) for e in tatblimp_entries(trainer, "tatblimp/failures")] == [
        (0, 1.0),
        (2, 2.0),
        (4, 3.0),
    ]


class Order(TrainerCallback):
    """Records what every on_evaluate (EarlyStoppingCallback's among them) sees of the TatBLiMP metric."""

    def __init__(self):
        self.seen = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append((state.global_step, metrics.get("eval_tatblimp/acc_norm")))


@pytest.mark.parametrize("metric", ["tatblimp/acc_norm", "tatblimp/binding/acc_norm"])
@pytest.mark.parametrize("stopper_first", [True, False], ids=["early-stopping-first", "tatblimp-first"])
def test_early_stopping_and_best_model_on_tatblimp(bpe_tokenizer, small_data, tmp_path, metric, stopper_first):
    cb = callback(small_data, eval_steps=100)  # scored at every Trainer evaluation, nothing else set
    stopper, order = EarlyStoppingCallback(early_stopping_patience=2), Order()
    callbacks = [order, stopper, cb] if stopper_first else [cb, stopper, order]
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        callbacks,
        max_steps=30,
        learning_rate=2e-2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model=metric,
        load_best_model_at_end=True,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    trainer.train()
    curve = [(e["step"], e[metric]) for e in tatblimp_entries(trainer) if e["step"] > 0]
    # What patience 2 must do with this curve: stop at the second evaluation in a row without a new best.
    best, best_step, waited, stop = float("-inf"), None, 0, None
    for step, value in curve:
        if value > best:
            best, best_step, waited = value, step, 0
        else:
            waited += 1
            if waited == 2:
                stop = step
                break
    assert stop is not None and stop < 30, curve  # the test needs a run that stops early
    assert trainer.state.global_step == stop and curve[-1][0] == stop
    assert trainer.state.best_metric == best and trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    # Every EarlyStoppingCallback.on_evaluate saw the metric, whichever callback came first.
    assert [step for step, value in order.seen] == list(range(1, stop + 1)) and all(v is not None for _, v in order.seen)
    # The loaded best model is the one that scored best; the last entry is the stop step's own weights.
    loaded = evaluate(trainer.model, bpe_tokenizer, small_data, allow_modified=True)
    assert loaded.flat_metrics()[metric] == best
    final = fresh_score(tmp_path / f"checkpoint-{stop}", bpe_tokenizer, small_data)
    assert tatblimp_entries(trainer)[-1]["tatblimp/acc_norm"] == final.acc_norm


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_the_final_score_is_of_the_final_weights_not_the_best_checkpoints(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=4, eval_on_evaluate=False)
    # The "best" checkpoint by this (deliberately odd) choice is an early one, loaded before on_train_end.
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb, StopAt(5)],
        max_steps=12,
        learning_rate=2e-2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        load_best_model_at_end=True,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    trainer.train()
    assert trainer.state.global_step == 5 and trainer.state.best_global_step != 5
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [0, 4, 5]
    final = fresh_score(tmp_path / "checkpoint-5", bpe_tokenizer, small_data)
    assert entries[-1]["tatblimp/acc_norm"] == final.acc_norm and entries[-1]["tatblimp/acc"] == final.acc
    assert [p.good_logprob for p in cb.last_results.pairs] == [p.good_logprob for p in final.pairs]
    best = evaluate(trainer.model, bpe_tokenizer, small_data, allow_modified=True)
    assert [p.good_logprob for p in best.pairs] != [p.good_logprob for p in final.pairs]  # the check can tell them apart


def test_two_train_calls_give_two_clean_histories(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=3)
    trainer.train()
    first_history, cache = list(cb.history), cb._evaluator.cache
    trainer.train()  # a fresh state: global step 0 again, the weights trained further
    assert [h["step"] for h in first_history] == [0, 2, 3] and [h["step"] for h in cb.history] == [0, 2, 3]
    assert cb.history[0]["tatblimp/acc"] == first_history[-1]["tatblimp/acc"]  # scored again at step 0, not skipped
    assert [e["step"] for e in tatblimp_entries(trainer)] == [0, 2, 3]
    assert cb._evaluator.cache is cache  # same tokenizer and data: not tokenized again
    assert [r["step"] for r in history_lines(tmp_path / "tatblimp_history.jsonl")] == [0, 2, 3]


def test_history_file_is_read_by_tatblimp_compare(bpe_tokenizer, small_data, tmp_path, capsys):
    cb = callback(small_data, eval_steps=2)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [cb], max_steps=4).train()
    records = history_lines(tmp_path / "run" / "tatblimp_history.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all("pairs" not in r and "checkpoint" not in r for r in records)
    assert [r["acc_norm"] for r in records] == [h["tatblimp/acc_norm"] for h in cb.history]
    assert records[-1]["phenomena"]["binding"]["acc_norm"] == cb.history[-1]["tatblimp/binding/acc_norm"]
    cli_main(["compare", str(tmp_path / "run" / "tatblimp_history.jsonl")])
    assert f"{records[-1]['acc_norm']:.4f}" in capsys.readouterr().out

    off = callback(small_data, eval_steps=2, history_file=None)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "off", [off], max_steps=2).train()
    assert not (tmp_path / "off" / "tatblimp_history.jsonl").exists()


def test_an_unreadable_history_file_is_named_and_training_goes_on(bpe_tokenizer, small_data, tmp_path, caplog):
    (tmp_path / "tatblimp_history.jsonl").write_text("not json\n", encoding="utf-8")
    cb = callback(small_data, eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2 and [h["step"] for h in cb.history] == [0, 2] and cb.failures == 0
    assert "cannot use the history file" in caplog.text and "tatblimp_history.jsonl" in caplog.text
    assert (tmp_path / "tatblimp_history.jsonl").read_text(encoding="utf-8") == "not json\n"  # left as it was
