"""Scoring puts a model back as it found it: every module's own train/eval mode, the random generators and the
grad-enabled state, after a plain ``Scorer.score``, a failed one, and inside a real Lightning run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator
from tatblimp_callback.engine.scoring import Scorer
from tatblimp_callback.tokenized.cache import build_cache


def modes(model: torch.nn.Module) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def test_score_restores_each_module_mode_the_generators_and_grad_state(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer)).train()
    model.model.layers[0].eval()  # frozen by the user: its dropout stays off in training
    before = modes(model)
    assert before["model.layers.0"] is False and before["model.layers.1"] is True
    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with torch.enable_grad():
        Scorer(model, cache).score()
        assert torch.is_grad_enabled()
    assert modes(model) == before
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_failed_score_also_leaves_the_model_as_found(bpe_tokenizer, small_data, monkeypatch):
    model = tiny_llama(len(bpe_tokenizer)).train()
    model.model.layers[1].mlp.eval()
    before = modes(model)
    scorer = Scorer(model, build_cache(bpe_tokenizer, small_data, allow_modified=True))

    def fails(*args, **kwargs):
        assert not any(modes(model).values())  # scored in eval mode throughout
        raise KeyboardInterrupt

    monkeypatch.setattr(scorer, "_attempt", fails)
    with pytest.raises(KeyboardInterrupt):
        scorer.score()
    assert modes(model) == before


def test_a_frozen_submodule_stays_in_eval_mode_through_a_lightning_run(tmp_path, bpe_tokenizer, small_data):
    pytest.importorskip("lightning")
    from tatblimp_callback.lightning import TatBLiMPLightningCallback
    from test_lightning import Wrapped, fit

    class Frozen(Wrapped):
        def __init__(self, vocab_size):
            super().__init__(vocab_size)
            self.seen = []

        def on_train_start(self):
            self.model.model.layers[0].eval()

        def training_step(self, batch, batch_idx):
            self.seen.append((self.model.training, self.model.model.layers[0].training))
            return super().training_step(batch, batch_idx)

    module = Frozen(len(bpe_tokenizer))
    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    fit(module, callback, tmp_path, 3, bpe_tokenizer)
    assert [e["step"] for e in callback.history] == [0, 1, 2, 3]  # scored before every step
    assert module.seen == [(True, False)] * 3


def test_evaluator_leaves_a_callable_lm_module_as_found(bpe_tokenizer, small_data):
    from tatblimp_callback.engine.callable_model import CallableLM

    model = tiny_llama(len(bpe_tokenizer)).train()
    model.lm_head.eval()
    before = modes(model)
    lm = CallableLM(
        lambda ids, pos: model(input_ids=ids, position_ids=pos).logits,
        vocab_size=len(bpe_tokenizer),
        context_length=256,
        module=model,
    )
    Evaluator(bpe_tokenizer, small_data, allow_modified=True)(lm)
    assert modes(model) == before
