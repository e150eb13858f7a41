"""What users expect of a loader: ``--trust-remote-code`` (off by default), ``--attn-implementation``, ``--revision``."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from tatblimp_callback.cli import main
from tatblimp_callback.commands.loading import load_model

CUSTOM_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


@pytest.fixture(scope="module")
def custom_model_dir(tmp_path_factory, bpe_tokenizer):
    """A model whose architecture lives in a Python file of its own folder (``auto_map``)."""
    folder = tmp_path_factory.mktemp("custom")
    tiny_llama(len(bpe_tokenizer)).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    (folder / "modeling_tiny_custom.py").write_text(CUSTOM_CODE, encoding="utf-8")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "tiny_custom"
    config["auto_map"] = {
        "AutoConfig": "modeling_tiny_custom.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_remote_code_runs_only_when_trusted(custom_model_dir, small_data, capsys):
    command = ["score", str(custom_model_dir), "--data", str(small_data), "--allow-modified"]
    assert main(command) == 1
    assert "model's architecture is Python code in its folder or repository; read it, then pass --trust-remote-code" in (
        capsys.readouterr().err
    )
    assert main([*command, "--trust-remote-code"]) == 0
    assert "overall" in capsys.readouterr().out
    assert type(load_model(custom_model_dir, trust_remote_code=True)).__name__ == "TinyCustomForCausalLM"


def test_attention_implementation_is_passed(custom_model_dir):
    model = load_model(custom_model_dir, trust_remote_code=True, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_revision_reaches_from_pretrained(small_data, monkeypatch, capsys):
    """The Hub cannot be reached here: the loader's call is recorded instead."""
    import types

    import transformers

    calls = []

    def record(name, **options):
        calls.append((name, options))
        raise OSError("recorded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda name, **options: calls.append((name, options)) or types.SimpleNamespace(),
    )
    command = ["score", "someone/some-model", "--revision", "v1.0", "--device", "cpu", "--data", str(small_data)]
    assert main([*command, "--allow-modified"]) == 1
    assert [options.get("revision") for _, options in calls] == ["v1.0", "v1.0"]  # the tokenizer, then the model
    assert calls[1][1]["trust_remote_code"] is False
    capsys.readouterr()


def test_explain_and_report_load_the_model_with_every_loader_option(custom_model_dir, small_data, tmp_path, capsys):
    """explain and report --model take score's loader options, and pass them on (here --trust-remote-code)."""
    data = ["--data", str(small_data), "--allow-modified"]
    results = tmp_path / "results.json"
    assert main(["score", str(custom_model_dir), *data, "--trust-remote-code", "--output", str(results)]) == 0
    explain = ["explain", str(custom_model_dir), "--pair", "0", *data]
    report = ["report", str(results), "--output", str(tmp_path / "report.html"), "--model", str(custom_model_dir), *data]
    for command, done in ((explain, "pair 0 "), (report, "wrote ")):
        capsys.readouterr()
        assert main(command) == 1
        assert "pass --trust-remote-code" in capsys.readouterr().err
        assert main([*command, "--trust-remote-code"]) == 0
        assert capsys.readouterr().out.startswith(done)
