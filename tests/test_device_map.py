"""Models placed by accelerate's big-model dispatch (``device_map``), with CPU and disk offload.

The checkpoint is saved as ``pytorch_model.bin``: accelerate reads offloaded weights of a
safetensors checkpoint straight from its file, but writes those of a ``.bin`` checkpoint to the
offload folder, so the tests can see real files there.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.commands.loading import load_model
from tatblimp_callback.engine.scoring_method import agree, relative_tolerance

LAYERS = 4


@pytest.fixture(scope="module")
def plain(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer), hidden=64, layers=LAYERS)


@pytest.fixture(scope="module")
def bin_model_dir(tmp_path_factory, plain, bpe_tokenizer):
    folder = tmp_path_factory.mktemp("bin-model")
    plain.config.save_pretrained(folder)
    torch.save(plain.state_dict(), folder / "pytorch_model.bin")
    bpe_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain_results(plain, bpe_tokenizer, small_data):
    return evaluate(plain, bpe_tokenizer, small_data, allow_modified=True)


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def assert_same_logprobs(payload: dict, expected) -> None:
    """Each sentence's log-prob in ``payload`` (a results dict) equals the plain model's within the scoring engine's
    float32 allowance."""
    got, want = payload["pairs"], expected.to_dict()["pairs"]
    for side in ("good", "bad"):
        values = torch.tensor([p[f"{side}_logprob"] for p in got], dtype=torch.float64)
        reference = torch.tensor([p[f"{side}_logprob"] for p in want], dtype=torch.float64)
        tokens = torch.tensor([p[f"{side}_tokens"] for p in want], dtype=torch.float64)
        assert agree(values, reference, tokens, relative_tolerance(torch.float32, torch.device("cpu"))), side
    assert payload["acc_norm"] == expected.acc_norm and payload["acc"] == expected.acc


def test_split_between_cpu_and_disk_scores_as_the_plain_model(
    bin_model_dir, plain, plain_results, bpe_tokenizer, small_data, tmp_path
):
    offload = tmp_path / "offload"
    model = load_model(
        bin_model_dir,
        dtype="float32",
        device_map="auto",
        max_memory={"cpu": model_bytes(plain) // 2},
        offload_folder=str(offload),
    )
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map
    offloaded = sorted(path.name for path in offload.iterdir())
    assert "lm_head.weight.safetensors" in offloaded and len(offloaded) > LAYERS  # real files, one per offloaded weight
    assert model.lm_head.weight.is_meta  # the head lives on disk: only its hook can load it

    results = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert_same_logprobs(results.to_dict(), plain_results)
    # The method check ran through accelerate's hooks; the head is the model's own (full logits).
    assert results.run_info["scoring_method"].endswith("full logits")


def test_head_on_the_cpu_and_layers_on_disk(bin_model_dir, plain_results, bpe_tokenizer, small_data, tmp_path):
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    device_map.update({f"model.layers.{i}": "disk" for i in range(1, LAYERS)})
    model = load_model(bin_model_dir, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert not model.lm_head.weight.is_meta and model.model.layers[1].mlp.up_proj.weight.is_meta
    results = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert_same_logprobs(results.to_dict(), plain_results)
    # The head's weight is resident, only placed by accelerate's hook: the tiled head runs on its device.
    assert results.run_info["scoring_method"].endswith("tiled head")


def test_cli_score_with_a_device_map(bin_model_dir, plain, plain_results, small_data, tmp_path, capsys):
    out, offload = tmp_path / "out.json", tmp_path / "offload"
    budget = f"cpu={model_bytes(plain) // 2}"
    command = ["score", str(bin_model_dir), "--data", str(small_data), "--allow-modified", "--output", str(out)]
    assert main([*command, "--device-map", "auto", "--max-memory", budget, "--offload-folder", str(offload)]) == 0
    assert any(offload.iterdir())
    assert_same_logprobs(json.loads(out.read_text(encoding="utf-8")), plain_results)
    capsys.readouterr()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-memory", "cpu=lots"], "'lots' is not a size"),
        (["--max-memory", "gpu0=1GiB"], "DEVICE must be a GPU index"),
        (["--offload-folder", "off"], "--max-memory and --offload-folder need --device-map"),
        (["--device-map", "auto", "--device", "cpu"], "either --device cpu or --device-map auto"),
        (["--tp-plan", "auto"], "start them with torchrun --nproc-per-node N -m tatblimp_callback"),
    ],
)
def test_placement_options_that_do_not_go_together(bin_model_dir, small_data, extra, message, capsys):
    command = ["score", str(bin_model_dir), "--data", str(small_data), "--allow-modified", *extra]
    try:
        code = main(command)
    except SystemExit as exit:  # argparse rejects a bad DEVICE=SIZE itself
        code = exit.code
    assert code != 0
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tensor_parallel_under_torchrun_on_the_cpu(plain, plain_results, bpe_tokenizer, small_data, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    plain.save_pretrained(tmp_path / "model")
    bpe_tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "tp.json"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "tatblimp_callback"]
    command += ["score", str(tmp_path / "model"), "--tp-plan", "auto", "--data", str(small_data), "--allow-modified"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([*command, "--output", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"wrote {out}") == 1  # process 0 writes; both scored every row
    payload = json.loads(out.read_text(encoding="utf-8"))
    assert payload["scoring_method"].endswith("full logits")  # a sharded head: the model's own forward
    assert_same_logprobs(payload, plain_results)
