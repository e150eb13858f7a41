"""Scoring a model offloaded to disk: what its provenance says, and whether its scorer is kept between calls (#30)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator
from tatblimp_callback.commands.loading import load_model


@pytest.fixture(scope="module")
def bin_model_dir(tmp_path_factory, bpe_tokenizer):
    folder = tmp_path_factory.mktemp("bin-model")
    plain = tiny_llama(len(bpe_tokenizer), hidden=64, layers=2)
    plain.config.save_pretrained(folder)
    torch.save(plain.state_dict(), folder / "pytorch_model.bin")
    return folder


LAYERS_ON_DISK = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk"}
LAYERS_ON_DISK |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize(
    "device_map, device",
    [({"": "disk"}, "disk"), (LAYERS_ON_DISK, "disk,cpu")],
    ids=["all-on-disk", "cpu-and-disk"],
)
def test_a_disk_offloaded_model_says_disk_and_keeps_its_scorer(
    bin_model_dir, bpe_tokenizer, small_data, tmp_path, device_map, device, monkeypatch
):
    from tatblimp_callback.engine import scoring

    model = load_model(bin_model_dir, dtype="float32", device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert next(model.parameters()).is_meta  # the first weight lives on disk
    built = []
    real_init = scoring.Scorer.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(scoring.Scorer, "__init__", counted)
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    first, second = evaluator(model), evaluator(model)
    assert first.run_info["device"] == device  # before: "meta" (or "meta,cpu"): the map says disk
    assert first.acc_norm == second.acc_norm
    assert len(built) == 1  # suspicion: the meta first weight rebuilt the scorer (and its method check) every call
