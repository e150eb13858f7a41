"""TatBLiMPCallback inside real (tiny) HF Trainer runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback, evaluate
from trainer_utils import corpus_blocks, losses, make_trainer, run_wandb_script, tatblimp_entries, wandb_records

PHENOMENA = 16


def callback(small_data, **options):
    return TatBLiMPCallback(data=small_data, allow_modified=True, **options)


class Reporter(TrainerCallback):
    """Stands for a report_to backend such as tensorboard: records what reaches on_log."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append((state.global_step, dict(logs)))


def test_scores_at_start_every_n_steps_and_at_the_end(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=2)
    reporter = Reporter()
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [reporter, cb], attach=True)
    trainer.train()
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [0, 2, 4, 5]
    reported = [(step, logs["tatblimp/acc_norm"]) for step, logs in reporter.logged if "tatblimp/acc_norm" in logs]
    assert reported == [(e["step"], e["tatblimp/acc_norm"]) for e in entries]
    last = entries[-1]
    assert sum(k.endswith("/acc_norm") for k in last) == PHENOMENA + 1
    assert sum(k.endswith("/acc") for k in last) == PHENOMENA + 1
    # The last logged numbers are those of the trained weights.
    final = evaluate(trainer.model, bpe_tokenizer, small_data, allow_modified=True)
    assert last["tatblimp/acc"] == final.acc and last["tatblimp/acc_norm"] == final.acc_norm
    assert last["tatblimp/binding/acc_norm"] == final.phenomena["binding"].acc_norm
    assert [h["step"] for h in cb.history] == [0, 2, 4, 5] and cb.failures == 0


def test_training_losses_are_bit_identical_with_and_without_the_callback(bpe_tokenizer, small_data, tmp_path, monkeypatch):
    def run(callbacks):
        model = tiny_llama(len(bpe_tokenizer), attention_dropout=0.3)
        trainer = make_trainer(model, bpe_tokenizer, tmp_path / str(len(callbacks)), callbacks, max_steps=6)
        trainer.train()
        return losses(trainer), model

    plain, _ = run([])
    # Make scoring consume random numbers: the callback must still leave every generator as it was.
    import tatblimp_callback.evaluation as evaluation

    original = evaluation.Evaluator.__call__

    def noisy(self, model, **options):
        torch.rand(10), __import__("random").random(), __import__("numpy").random.rand()
        return original(self, model, **options)

    monkeypatch.setattr(evaluation.Evaluator, "__call__", noisy)
    cb = callback(small_data, eval_steps=2)
    with_callback, model = run([cb])
    assert len(plain) == 6 and plain == with_callback
    assert len(cb.history) == 4 and model.training


def test_gradient_accumulation_counts_optimizer_steps(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=2, eval_on_start=False)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], gradient_accumulation_steps=3, max_steps=4
    )
    trainer.train()
    assert [e["step"] for e in tatblimp_entries(trainer)] == [2, 4]


def test_gradient_checkpointing(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=3)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=3, gradient_checkpointing=True
    )
    trainer.train()
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [0, 3] and cb.failures == 0
    untouched = tiny_llama(len(bpe_tokenizer))  # the same weights in a model no Trainer has wrapped
    untouched.load_state_dict(trainer.model.state_dict())
    assert entries[-1]["tatblimp/acc_norm"] == evaluate(untouched, bpe_tokenizer, small_data, allow_modified=True).acc_norm


def test_a_compiled_model_is_scored_through_its_eager_module(bpe_tokenizer, small_data):
    """The scorer unwraps ``torch.compile`` (``_orig_mod``): it runs the same weights eagerly, so scoring
    neither compiles graphs for its own shapes nor recompiles the training graph."""
    compilations = []

    def counting_backend(graph, example_inputs):
        compilations.append(graph)
        return graph.forward

    model = tiny_llama(len(bpe_tokenizer))
    compiled = torch.compile(model, backend=counting_backend)
    try:
        plain = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
        scored = evaluate(compiled, bpe_tokenizer, small_data, allow_modified=True)
        assert compilations == []
        assert [p.good_logprob for p in scored.pairs] == [p.good_logprob for p in plain.pairs]
        compiled(input_ids=torch.tensor([[1, 5, 9]]))
        assert compilations  # calling the compiled module itself does compile: the check above can fail
    finally:
        torch._dynamo.reset()


def test_lora_model(bpe_tokenizer, small_data, tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(len(bpe_tokenizer)), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cb = callback(small_data, eval_steps=5)
    trainer = make_trainer(model, bpe_tokenizer, tmp_path, [cb], max_steps=5, learning_rate=5e-2)
    trainer.train()
    merged = model.merge_and_unload()
    expected = evaluate(merged, bpe_tokenizer, small_data, allow_modified=True)
    last = tatblimp_entries(trainer)[-1]
    assert last["step"] == 5 and last["tatblimp/acc"] == expected.acc
    assert abs(cb.last_results.pairs[0].good_logprob - expected.pairs[0].good_logprob) < 1e-4


def test_a_scoring_error_is_logged_and_training_goes_on(bpe_tokenizer, tmp_path, caplog):
    cb = TatBLiMPCallback(data=tmp_path / "missing.jsonl", eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4
    assert cb.failures == 3  # steps 0, 2 and 4 (preparing at the start is said, not counted)
    assert [e["tatblimp/failures"] for e in tatblimp_entries(trainer, "tatblimp/failures")] == [1.0, 2.0, 3.0]
    assert "missing.jsonl: cannot read the benchmark file" in caplog.text and "Traceback" in caplog.text


def test_raise_on_error_stops_training(bpe_tokenizer, tmp_path):
    from tatblimp_callback import BenchmarkError

    cb = TatBLiMPCallback(data=tmp_path / "missing.jsonl", eval_steps=2, raise_on_error=True)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=4)
    with pytest.raises(BenchmarkError, match=r"missing\.jsonl"):
        trainer.train()


def test_cache_is_saved_and_reused_by_fingerprint(bpe_tokenizer, eos_only_tokenizer, small_data, tmp_path, monkeypatch):
    path = tmp_path / "cache.safetensors"
    first = callback(small_data, eval_steps=10, cache_path=path)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [first], max_steps=1).train()
    assert path.exists()

    import tatblimp_callback.tokenized.cache as cache_module

    real_encode = cache_module.encode_sentences
    calls = []
    monkeypatch.setattr(cache_module, "encode_sentences", lambda *a, **k: calls.append(1) or real_encode(*a, **k))
    resumed = callback(small_data, eval_steps=10, cache_path=path)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [resumed], max_steps=1).train()
    assert calls == [] and resumed.history[0]["tatblimp/acc"] == first.history[0]["tatblimp/acc"]

    other = callback(small_data, eval_steps=10, cache_path=path, tokenizer=eos_only_tokenizer)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [other], max_steps=1).train()
    assert calls == [1]  # a different tokenizer: rebuilt, not trusted


WANDB_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
from conftest import reference_logprobs, tiny_llama, train_bpe
from trainer_utils import make_trainer
from tatblimp_callback import TatBLiMPCallback
tokenizer = train_bpe()
cb = TatBLiMPCallback(data={data!r}, allow_modified=True, eval_steps=2)
trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, {out!r}, [cb], report_to=["wandb"], max_steps=5)
trainer.train()
import wandb
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


def test_wandb_offline_run_holds_the_curves_at_the_global_steps(small_data, tmp_path):
    tests = str(Path(__file__).parent)
    script = WANDB_SCRIPT.format(tests=tests, data=str(small_data), out=str(tmp_path / "out"))
    (run_dir,) = run_wandb_script(script, tmp_path)
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    ours = [item for item in history if "tatblimp/acc" in item]
    assert [item["train/global_step"] for item in ours] == [0, 2, 4, 5]
    keys = set(ours[-1])
    assert {"tatblimp/acc", "tatblimp/acc_norm", "tatblimp/quantifiers/acc_norm", "tatblimp/binding/acc"} <= keys
    assert sum(k.startswith("tatblimp/") and k.count("/") == 2 for k in keys) == 2 * PHENOMENA
    assert not any(k.startswith("train/tatblimp") for item in history for k in item)
    # The Trainer's own losses still go to train/, and the end-of-training table is logged.
    assert any("train/loss" in item for item in history)
    assert '"path":"tatblimp/results.table.json"' in json.dumps(records).replace(" ", "")
    # The overall 95% intervals are curves too; the table has one row per phenomenon and overall, with intervals.
    assert ours[-1]["tatblimp/acc_norm_ci_low"] <= ours[-1]["tatblimp/acc_norm"] <= ours[-1]["tatblimp/acc_norm_ci_high"]
    (table_file,) = Path(run_dir, "files", "media", "table", "tatblimp").glob("results_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:6] == ["phenomenon", "n", "acc", "acc CI", "acc_norm", "acc_norm CI"]
    assert len(table["data"]) == PHENOMENA + 1 and table["data"][-1][0] == "overall"


def test_every_trainer_evaluation_carries_the_tatblimp_metrics(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_steps=100, eval_on_start=False, eval_on_end=False)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb],
        max_steps=4,
        eval_strategy="steps",
        eval_steps=3,
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=20),
    )
    trainer.train()
    # The Trainer evaluates at step 3 and, as the run ends there, at the last step 4.
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [3, 4]
    metrics = trainer.evaluate()  # at step 4 again: the metrics of step 4, not scored or logged a second time
    ours = {key[len("eval_") :]: value for key, value in metrics.items() if key.startswith("eval_tatblimp/")}
    assert ours == {key: value for key, value in entries[-1].items() if key != "step"}
    # acc and acc_norm overall and per phenomenon, the overall 95% intervals (4 bounds), eval_seconds
    assert len(ours) == 2 * (PHENOMENA + 1) + 4 + 1 and len(tatblimp_entries(trainer)) == 2


def test_tatblimp_as_metric_for_best_model_needs_eval_on_evaluate(bpe_tokenizer, small_data, tmp_path):
    cb = callback(small_data, eval_on_evaluate=False)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)),
        bpe_tokenizer,
        tmp_path,
        [cb],
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="tatblimp/acc_norm",
        eval_dataset=corpus_blocks(bpe_tokenizer, lines=8),
    )
    with pytest.raises(ValueError, match="eval_on_evaluate=True"):
        trainer.train()
