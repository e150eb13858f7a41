"""``precision=``: a mixed-precision run is scored in the precision it trains in (bf16 under the Trainer's
``bf16=True``), or in the one asked for, and every record says which."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import reference_logprobs, tiny_llama
from tatblimp_callback import Evaluator, TatBLiMPCallback, evaluate
from trainer_utils import make_trainer

CHOICES = "'auto', 'float32', 'bfloat16', 'float16'"


def trained_with_bf16_autocast(tokenizer, small_data, tmp_path, **options):
    callback = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=3, raise_on_error=True, **options)
    trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, tmp_path, [callback], max_steps=3, bf16=True)
    trainer.train()
    assert hasattr(trainer.model, "_original_forward")  # accelerate put the training forwards under bf16 autocast
    untouched = tiny_llama(len(tokenizer))
    untouched.load_state_dict(trainer.model.state_dict())
    return callback, untouched


def history(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "tatblimp_history.jsonl").read_text().splitlines()]


def test_a_bf16_mixed_precision_trainer_run_is_scored_in_bf16_by_default_and_says_so(bpe_tokenizer, small_data, tmp_path):
    callback, untouched = trained_with_bf16_autocast(bpe_tokenizer, small_data, tmp_path)
    first = callback._evaluator.cache.sentence(0)
    plain = reference_logprobs(untouched, [first])[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = reference_logprobs(untouched, [first])[0]
    scored = callback.last_results.pairs[0].good_logprob
    assert abs(scored - autocast) < abs(scored - plain)  # computed under bf16 autocast, not in float32
    assert abs(scored - plain) > 1e-3
    lines = history(tmp_path)
    assert [(line["precision"], line["dtype"]) for line in lines] == [("bfloat16", "float32")] * 2
    # Below float32 the decisions are float32's: the pairs within rounding were scored again (exact_decisions).
    assert all(
        line["exact_decisions"]["precision"] == "bfloat16" and line["exact_decisions"]["bound_per_token"] > 0 for line in lines
    )
    table = callback.last_results.format_table().splitlines()
    assert "dtype: float32  precision: bfloat16" in table[0]
    exact = lines[-1]["exact_decisions"]  # the table names what was rescored
    assert f"decisions as float32 makes them: {exact['rescored_pairs']} pairs within rounding" in table[-1]


def test_precision_float32_scores_the_float32_master_weights_exactly(bpe_tokenizer, small_data, tmp_path):
    callback, untouched = trained_with_bf16_autocast(bpe_tokenizer, small_data, tmp_path, precision="float32")
    fp32 = evaluate(untouched, bpe_tokenizer, small_data, allow_modified=True)
    assert [p.good_logprob for p in callback.last_results.pairs] == [p.good_logprob for p in fp32.pairs]
    assert fp32.run_info["precision"] == "float32"
    assert [line["precision"] for line in history(tmp_path)] == ["float32", "float32"]
    assert not any("exact_decisions" in line for line in history(tmp_path))
    assert "decisions as float32" not in callback.last_results.format_table()


def test_bf16_weights_scored_in_float32_are_upcast_for_the_forward_only(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer)).to(torch.bfloat16)
    results = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, precision="float32")
    upcast = tiny_llama(len(bpe_tokenizer)).to(torch.bfloat16).float()  # the same bf16 weights, as float32
    expected = evaluate(upcast, bpe_tokenizer, small_data, allow_modified=True)
    assert [p.good_logprob for p in results.pairs] == pytest.approx([p.good_logprob for p in expected.pairs], abs=1e-4)
    assert (results.run_info["precision"], results.run_info["dtype"]) == ("float32", "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bf16 = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert bf16.run_info["precision"] == "bfloat16"


def test_bf16_weights_scored_under_a_float16_autocast(bpe_tokenizer, small_data):
    """``tatblimp score --dtype bfloat16 --precision float16`` stopped with autocast's "Unexpected floating ScalarType
    in at::autocast::prioritize": the weights' fingerprint joined bf16 samples under the float16 autocast."""
    model = tiny_llama(len(bpe_tokenizer)).to(torch.bfloat16)
    results = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, precision="float16")
    assert (results.run_info["precision"], results.run_info["dtype"]) == ("float16", "bfloat16")
    in_float32 = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, precision="float32")
    assert [p.good_logprob for p in results.pairs] == pytest.approx([p.good_logprob for p in in_float32.pairs], rel=0.05)


def test_auto_follows_autocast_from_one_evaluation_to_the_next(bpe_tokenizer, small_data):
    """A plain loop scores at step 0, then trains under ``torch.autocast``: "auto" was fixed at the first call."""
    evaluator, model = Evaluator(bpe_tokenizer, small_data, allow_modified=True), tiny_llama(len(bpe_tokenizer))
    assert evaluator(model).run_info["precision"] == "float32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert evaluator(model).run_info["precision"] == "bfloat16"
    assert evaluator(model).run_info["precision"] == "float32"


@pytest.mark.parametrize(
    "make",
    [
        lambda p: TatBLiMPCallback(precision=p),
        lambda p: Evaluator(object(), precision=p),
    ],
    ids=["callback", "evaluator"],
)
def test_an_unknown_precision_is_one_clear_error(make):
    with pytest.raises(ValueError, match=f"precision must be one of {CHOICES}, got 'bf16'"):
        make("bf16")


def test_the_lightning_callback_takes_bf16_mixed_from_the_trainer(bpe_tokenizer, small_data, tmp_path):
    pytest.importorskip("lightning")
    import lightning as L
    from torch.utils.data import DataLoader

    from tatblimp_callback.lightning import TatBLiMPLightningCallback
    from test_lightning import Wrapped
    from trainer_utils import corpus_blocks

    with pytest.raises(ValueError, match=f"precision must be one of {CHOICES}, got 'fp8'"):
        TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, precision="fp8")
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=1,
        default_root_dir=str(tmp_path),
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    blocks = torch.tensor([b["input_ids"] for b in corpus_blocks(bpe_tokenizer, lines=40)])
    trainer.fit(Wrapped(len(bpe_tokenizer)), DataLoader(blocks, batch_size=2))
    assert (callback.last_results.run_info["precision"], callback.last_results.run_info["dtype"]) == ("bfloat16", "float32")


def test_the_cli_scores_in_the_precision_asked_for_and_refuses_an_unknown_one(model_dir, small_data, tmp_path, capsys):
    from tatblimp_callback.cli import main

    out = tmp_path / "results.json"
    command = ["score", str(model_dir), "--data", str(small_data), "--allow-modified", "--device", "cpu", "--output", str(out)]
    assert main([*command, "--precision", "bfloat16"]) == 0
    results = json.loads(out.read_text())
    assert (results["precision"], results["dtype"]) == ("bfloat16", "float32")
    assert "dtype: float32  precision: bfloat16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*command, "--precision", "bf16"])
    assert f"argument --precision: invalid choice: 'bf16' (choose from {CHOICES})" in capsys.readouterr().err


def test_a_precision_the_device_cannot_compute_in_is_one_clear_error(bpe_tokenizer):
    from tatblimp_callback.engine.precision import check_runs, mixed_precision_dtype

    model = tiny_llama(len(bpe_tokenizer))
    with pytest.raises(ValueError, match="precision='bfloat16' needs autocast, which meta lacks; choose 'auto' or 'float32'"):
        check_runs(model, torch.bfloat16, torch.device("meta"))
    check_runs(model, torch.float32, torch.device("meta"))  # the weights' own precision needs nothing
    check_runs(model, torch.bfloat16, torch.device("cpu"))
    assert [mixed_precision_dtype(s) for s in ("bf16-mixed", "16-mixed", "32-true", "bf16-true")] == [
        torch.bfloat16,
        torch.float16,
        None,
        None,
    ]
