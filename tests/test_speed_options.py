"""``cuda_graphs=`` and ``compile=`` reach the scorer from every entry point: the callbacks (checked when made), the
``Evaluator`` and ``evaluate``, and ``tatblimp score`` (``--no-cuda-graphs``, ``--compile``)."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback


@pytest.mark.parametrize("name", ["cuda_graphs", "compile"])
def test_the_callbacks_refuse_a_speed_option_that_is_not_a_bool(name):
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    for callback in (TatBLiMPCallback, TatBLiMPLightningCallback):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'yes'"):
            callback(**{name: "yes"})


def test_the_callbacks_pass_cuda_graphs_and_compile_to_their_scorer(bpe_tokenizer, small_data):
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    model = tiny_llama(len(bpe_tokenizer))
    for callback in (TatBLiMPCallback, TatBLiMPLightningCallback):
        default = callback(data=small_data, allow_modified=True)
        default._monitor.prepare(bpe_tokenizer, model)
        scorer = default._monitor.evaluator.prepare(model)
        assert scorer.graphs.enabled is True and scorer.compiled.enabled is False
        chosen = callback(data=small_data, allow_modified=True, cuda_graphs=False, compile=True)
        chosen._monitor.prepare(bpe_tokenizer, model)
        scorer = chosen._monitor.evaluator.prepare(model)
        assert scorer.graphs.enabled is False and scorer.compiled.enabled is True


def test_the_score_command_passes_its_flags_and_refuses_them_with_vllm(model_dir, monkeypatch, capsys):
    from conftest import DATA
    from tatblimp_callback import evaluation
    from tatblimp_callback.cli import main

    given = {}
    original = evaluation.evaluate

    def evaluate(*args, **options):
        given.update(options)
        return original(*args, **options)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    args = ["score", str(model_dir), "--data", str(DATA), "--limit", "1", "--device", "cpu"]
    assert main(args) == 0 and given["cuda_graphs"] is True and given["compile"] is False
    assert main([*args, "--no-cuda-graphs"]) == 0 and given["cuda_graphs"] is False
    assert main([*args[:-2], "--backend", "vllm", "--compile"]) != 0
    assert "--compile: an option of --backend transformers" in capsys.readouterr().err
