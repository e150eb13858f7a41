"""Two TatBLiMP callbacks in one run (two benchmarks, two prefixes) write two history files: the default,
``{log_prefix}_history.jsonl``, is named for each one's prefix, and two that would write one file are refused when
training starts, with the Lightning Trainer and the Hugging Face one."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def lightning_callback(tokenizer, data, **options):
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    return TatBLiMPLightningCallback(tokenizer=tokenizer, data=data, allow_modified=True, eval_every_n_steps=1, **options)


def test_two_lightning_callbacks_of_other_prefixes_write_a_file_each(tmp_path, bpe_tokenizer, small_data):
    pytest.importorskip("lightning")
    from test_lightning import Wrapped, fit

    first, second = (
        lightning_callback(bpe_tokenizer, small_data),
        lightning_callback(bpe_tokenizer, small_data, log_prefix="again"),
    )
    fit(Wrapped(len(bpe_tokenizer)), None, tmp_path, 1, bpe_tokenizer, callbacks=[first, second])
    assert first.history_file == second.history_file == "{log_prefix}_history.jsonl"
    assert sorted(path.name for path in tmp_path.glob("*.jsonl")) == ["again_history.jsonl", "tatblimp_history.jsonl"]
    for callback, name in ((first, "tatblimp"), (second, "again")):
        written = lines(tmp_path / f"{name}_history.jsonl")
        assert [r["step"] for r in written] == [0, 1]  # its own two evaluations, not the other's too
        assert [r["acc_norm"] for r in written] == [e[f"{name}/acc_norm"] for e in callback.history]


def test_two_lightning_callbacks_on_one_file_are_refused(tmp_path, bpe_tokenizer, small_data):
    pytest.importorskip("lightning")
    from test_lightning import Wrapped, fit

    same_prefix = [lightning_callback(bpe_tokenizer, small_data), lightning_callback(bpe_tokenizer, small_data)]
    with pytest.raises(RuntimeError, match=r"state_key` must be unique"):  # one prefix: Lightning refuses the pair itself
        fit(Wrapped(len(bpe_tokenizer)), None, tmp_path / "a", 1, bpe_tokenizer, callbacks=same_prefix)
    assert not (tmp_path / "a" / "tatblimp_history.jsonl").exists()
    named = [
        lightning_callback(bpe_tokenizer, small_data, history_file="runs.jsonl"),
        lightning_callback(bpe_tokenizer, small_data, log_prefix="b", history_file=str(tmp_path / "b" / "runs.jsonl")),
    ]
    with pytest.raises(ValueError, match=r"'tatblimp' and 'b'\) would write the same history file .*runs.jsonl: give each"):
        fit(Wrapped(len(bpe_tokenizer)), None, tmp_path / "b", 1, bpe_tokenizer, callbacks=named)
    # Each its own file (or none): trains.
    apart = [
        lightning_callback(bpe_tokenizer, small_data, history_file="runs.jsonl"),
        lightning_callback(bpe_tokenizer, small_data, log_prefix="c", history_file=None),
    ]
    fit(Wrapped(len(bpe_tokenizer)), None, tmp_path / "c", 1, bpe_tokenizer, callbacks=apart)
    assert [r["step"] for r in lines(tmp_path / "c" / "runs.jsonl")] == [0, 1]


def test_two_trainer_callbacks_on_one_file_are_refused_and_of_other_prefixes_write_two(tmp_path, bpe_tokenizer, small_data):
    from trainer_utils import make_trainer

    def callbacks(**second):
        return [
            TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=1),
            TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=1, **second),
        ]

    model = tiny_llama(len(bpe_tokenizer))
    one_file = callbacks(log_prefix="again", history_file="tatblimp_history.jsonl")
    trainer = make_trainer(model, bpe_tokenizer, tmp_path / "a", one_file, attach=True)
    with pytest.raises(ValueError, match=r"'tatblimp' and 'again'\) would write the same history file"):
        trainer.train()
    trainer = make_trainer(model, bpe_tokenizer, tmp_path / "a", callbacks(), attach=True)  # one prefix: the same keys
    with pytest.raises(ValueError, match=r"'tatblimp' and 'tatblimp'\) would log under the same keys \(tatblimp/\.\.\."):
        trainer.train()
    trainer = make_trainer(model, bpe_tokenizer, tmp_path / "b", callbacks(log_prefix="again"), attach=True, max_steps=1)
    trainer.train()
    assert [r["step"] for r in lines(tmp_path / "b" / "tatblimp_history.jsonl")] == [0, 1]
    assert [r["step"] for r in lines(tmp_path / "b" / "again_history.jsonl")] == [0, 1]


def test_two_trainer_callbacks_each_put_their_keys_in_the_evaluations_log_history_entry(tmp_path, bpe_tokenizer, small_data):
    """At a Trainer evaluation where the first callback scored a new point, the second's ``eval_heldout/...`` keys
    missed that evaluation's entry in ``log_history`` (and so trainer_state.json): it looked at the last entry only,
    the first callback's point."""
    from trainer_utils import corpus_blocks, make_trainer

    both = [
        TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=2),
        TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=3, log_prefix="heldout"),
    ]
    options = dict(eval_strategy="steps", eval_steps=3, max_steps=4)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, both, corpus_blocks(bpe_tokenizer)[:8], True, **options
    )
    trainer.train()
    entries = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in entries] == [3, 4]  # at 3, the first callback scored a point of its own first
    assert all("eval_tatblimp/acc_norm" in e and "eval_heldout/acc_norm" in e for e in entries)
