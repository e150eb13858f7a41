"""The callback's settings follow the Trainer's conventions: a fractional ``eval_steps``, files under ``output_dir``;
its history lines say what made them, and ``acquisition_steps`` reads them as they are."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback
from tatblimp_callback.results.curves import acquisition_steps
from trainer_utils import make_trainer


@pytest.mark.slow
def test_fraction_eval_steps_cache_under_output_dir_and_history_lines(bpe_tokenizer, small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a cache_path relative to the working directory would land here
    out = tmp_path / "out"
    cb = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=0.25, cache_path="tatblimp-cache.safetensors")
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, out, [cb], max_steps=8).train()
    assert [entry["step"] for entry in cb.history] == [0, 2, 4, 6, 8]  # ceil(0.25 * 8) = 2, as the Trainer's eval_steps
    assert (out / "tatblimp-cache.safetensors").is_file() and not (tmp_path / "tatblimp-cache.safetensors").exists()

    lines = [json.loads(line) for line in (out / "tatblimp_history.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4, 6, 8]
    for line in lines:
        assert set(line["environment"]) == {"python", "torch", "transformers", "tatblimp_callback"}
        assert line["dtype"] == "float32" and line["device"] == "cpu" and line["created"].endswith("Z")
    # The lines of the history file, as read from it, give the acquisition steps of the callback's own history.
    from_lines = acquisition_steps(lines, threshold=0.5)
    assert len(from_lines) == 16 and from_lines == acquisition_steps(cb.history, threshold=0.5)
    assert any(step is not None for step in from_lines.values()) and any(step is None for step in from_lines.values())
