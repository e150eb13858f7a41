"""PEFT adapter checkpoints (``adapter_config.json`` and ``adapter_model.safetensors``, no ``config.json``), as
peft and the Trainer save a LoRA fine-tune: ``tatblimp score`` and ``tatblimp sweep`` load them on their base model."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, bpe_tokenizer):
    """A base model folder, and a run folder whose checkpoint-2 holds a trained LoRA adapter on it (and the tokenizer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    tiny_llama(len(bpe_tokenizer)).save_pretrained(base)
    bpe_tokenizer.save_pretrained(base)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # as training leaves them: adapters that change the scores
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    checkpoint = root / "run" / "checkpoint-2"
    model.save_pretrained(checkpoint)
    bpe_tokenizer.save_pretrained(checkpoint)
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "config.json").exists()
    return base, checkpoint, model.eval()


def test_score_and_sweep_load_an_adapter_checkpoint_on_its_base_model(lora_run, bpe_tokenizer, small_data, tmp_path, capsys):
    base, checkpoint, model = lora_run
    expected = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    plain_base = evaluate(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, small_data, allow_modified=True)
    # The adapter counts: 7.2 nats a sentence on average (2026-12-02), so a score within 1e-4 of `expected` (here and
    # in the device-map test below, where torch warns of copies to meta parameters) has the adapter applied.
    gaps = [abs(a.good_logprob - b.good_logprob) for a, b in zip(plain_base.pairs, expected.pairs)]
    assert sum(gaps) / len(gaps) > 1.0

    out = tmp_path / "score.json"
    data = ["--data", str(small_data), "--allow-modified", "--device", "cpu"]
    assert main(["score", str(checkpoint), *data, "--output", str(out)]) == 0, capsys.readouterr().err
    scored = json.loads(out.read_text(encoding="utf-8"))
    assert max(abs(a["good_logprob"] - b.good_logprob) for a, b in zip(scored["pairs"], expected.pairs)) < 1e-4
    assert scored["acc_norm"] == expected.acc_norm
    # An adapter saved without the tokenizer: its base model's is used.
    bare = tmp_path / "bare-adapter"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (bare / name).write_bytes((checkpoint / name).read_bytes())
    assert main(["score", str(bare), *data, "--output", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text(encoding="utf-8"))["tokenizer"] == str(base)
    assert json.loads(out.read_text(encoding="utf-8"))["acc_norm"] == expected.acc_norm

    # An adapter saved with its base model's config.json beside it (Unsloth, axolotl): still an adapter, not a model
    # whose weights are missing (it was "no file named model.safetensors").
    with_config = tmp_path / "adapter-with-config"
    with_config.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "config.json"):
        (with_config / name).write_bytes(((base if name == "config.json" else checkpoint) / name).read_bytes())
    assert main(["score", str(with_config), *data, "--output", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text(encoding="utf-8"))["acc_norm"] == expected.acc_norm

    assert main(["sweep", str(checkpoint.parent), *data]) == 0, capsys.readouterr().err
    assert "1 checkpoint(s) scored" in capsys.readouterr().out
    records = [
        json.loads(line) for line in (checkpoint.parent / "tatblimp.jsonl").read_text(encoding="utf-8").split("\n") if line
    ]
    assert [(r["step"], r["checkpoint"], r["acc_norm"]) for r in records] == [(2, "checkpoint-2", expected.acc_norm)]


def test_without_peft_an_adapter_checkpoint_says_what_to_install(lora_run, small_data, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails, as where it is not installed
    assert main(["score", str(lora_run[1]), "--data", str(small_data), "--allow-modified", "--device", "cpu"]) == 1
    error = capsys.readouterr().err
    assert "PEFT adapter" in error and "pip install peft" in error and "checkpoint-2" in error


# peft loads the adapter's weights of disk-offloaded layers onto meta parameters (torch warns of a no-op copy) and
# then through its offload folder: the score below, within 1e-4 of the adapted model's, shows them applied.
@pytest.mark.filterwarnings("ignore:for base_model.*copying from a non-meta parameter:UserWarning")
def test_an_adapter_checkpoint_is_placed_by_the_device_map_asked_for(
    lora_run, bpe_tokenizer, small_data, tmp_path, capsys, monkeypatch
):
    _, checkpoint, model = lora_run
    # peft (0.x, PeftModel._update_offload) writes its renamed copy of disk-offloaded weights at their path made
    # relative to the working folder: run where that copy does no harm.
    monkeypatch.chdir(tmp_path)
    expected = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    half = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    out, offload = tmp_path / "score.json", tmp_path / "offload"
    command = ["score", str(checkpoint), "--data", str(small_data), "--allow-modified", "--output", str(out)]
    command += ["--device-map", "auto", "--max-memory", f"cpu={half}", "--offload-folder", str(offload)]
    assert main(command) == 0, capsys.readouterr().err
    scored = json.loads(out.read_text(encoding="utf-8"))
    # Before: the base model loaded whole onto one device; the map, the memory limit and the offload folder dropped.
    assert "disk" in scored["device"].split(",")  # the safetensors checkpoint: accelerate reads the disk part from it
    assert max(abs(a["good_logprob"] - b.good_logprob) for a, b in zip(scored["pairs"], expected.pairs)) < 1e-4
    assert scored["acc_norm"] == expected.acc_norm
