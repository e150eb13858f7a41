"""`tatblimp score` end to end on a saved tiny model and the real benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA, reference_logprobs, tiny_llama
from tatblimp_callback import load_benchmark
from tatblimp_callback.cli import main
from tatblimp_callback.reading.data import OFFICIAL_PHENOMENA


def test_score_prints_the_table_and_writes_json(model_dir, bpe_tokenizer, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert main(["score", str(model_dir), "--data", str(DATA), "--output", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in OFFICIAL_PHENOMENA) and "overall" in printed and "TatBLiMP v1.0" in printed

    results = json.loads(out.read_text())
    assert set(results["phenomena"]) == set(OFFICIAL_PHENOMENA)
    assert {name: g["n"] for name, g in results["phenomena"].items()} == OFFICIAL_PHENOMENA
    assert results["benchmark"]["md5"] == "7659770ffe671579746a445a173a294a"
    assert results["partial"] is False and results["selection"] is None  # every pair scored
    assert results["dtype"] == "float32" and results["device"] == "cpu" and "dtype: float32" in printed.splitlines()[0]

    # Independent check: one sentence at a time, from the saved weights, in file order.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    benchmark = load_benchmark(DATA)
    picks = range(0, 1248, 41)
    sentences = [s for i in picks for s in (benchmark.pairs[i].good, benchmark.pairs[i].bad)]
    ids = [[bpe_tokenizer.bos_token_id, *x] for x in bpe_tokenizer(sentences, add_special_tokens=False)["input_ids"]]
    expected = reference_logprobs(model, ids)
    got = [v for i in picks for v in (results["pairs"][i]["good_logprob"], results["pairs"][i]["bad_logprob"])]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4

    pairs = results["pairs"]
    acc = sum(p["good_logprob"] > p["bad_logprob"] for p in pairs) / 1248
    acc_norm = sum(p["good_logprob"] / p["good_bytes"] > p["bad_logprob"] / p["bad_bytes"] for p in pairs) / 1248
    assert results["acc"] == pytest.approx(acc) and results["acc_norm"] == pytest.approx(acc_norm)
    quantifiers = [p for p in pairs if p["phenomenon"] == "quantifiers"]
    assert results["phenomena"]["quantifiers"]["acc"] == pytest.approx(
        sum(p["good_logprob"] > p["bad_logprob"] for p in quantifiers) / 85
    )


def test_failure_is_one_line_and_non_zero(tmp_path):
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "tatblimp"), "score", str(tmp_path / "no-model"), "--data", str(DATA)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1
    assert completed.stderr.startswith("tatblimp score: error: ")
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr


def test_modified_data_without_consent_fails_cleanly(model_dir, tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"good": "Мин барам.", "bad": "Мин барасың.", "phenomenon": "agr"}, ensure_ascii=False) + "\n")
    assert main(["score", str(model_dir), "--data", str(data)]) == 1
    assert "not the official TatBLiMP v1.0 release" in capsys.readouterr().err
    assert main(["score", str(model_dir), "--data", str(data), "--allow-modified"]) == 0
    assert "modified (md5" in capsys.readouterr().out


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory, bpe_tokenizer):
    """A model folder with weights and config but no tokenizer files."""
    folder = tmp_path_factory.mktemp("bare-model")
    tiny_llama(len(bpe_tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bare_run_dir(tmp_path_factory, bare_model_dir):
    """A run folder with one complete checkpoint and no tokenizer files anywhere."""
    import shutil

    run = tmp_path_factory.mktemp("run")
    shutil.copytree(bare_model_dir, run / "checkpoint-5")
    (run / "checkpoint-5" / "trainer_state.json").write_text("{}")
    return run


NO_TOKENIZER_FILES = "(none of tokenizer.json, tokenizer_config.json, tokenizer.model)"
LOADING_ERRORS = {  # case: (command line, the start of the one-line error)
    "missing model folder": (["score", "{missing}"], "{missing}: no such model folder"),
    "missing model folder, forced choice": (
        ["score", "{missing}", "--protocol", "forced-choice"],
        "{missing}: no such model folder",
    ),
    "a file as the model": (["score", "{model}/model.safetensors"], "{model}/model.safetensors: a file, not a model folder"),
    "model folder without tokenizer": (
        ["score", "{bare}"],
        f"the model folder {{bare}} has no tokenizer {NO_TOKENIZER_FILES}; "
        "pass --tokenizer with a tokenizer folder, a Hub id or a SentencePiece .model file",
    ),
    "model folder without tokenizer, forced choice": (
        ["score", "{bare}", "--protocol", "forced-choice"],
        f"the model folder {{bare}} has no tokenizer {NO_TOKENIZER_FILES}; pass --tokenizer",
    ),
    "missing tokenizer folder": (["score", "{bare}", "--tokenizer", "{missing}"], "{missing}: no such tokenizer folder"),
    "missing sentencepiece file": (
        ["score", "{bare}", "--tokenizer", "{missing}.model"],
        "{missing}.model: no such SentencePiece model file",
    ),
    "tokenizer.json instead of its folder": (
        ["score", "{bare}", "--tokenizer", "{model}/tokenizer.json"],
        "{model}/tokenizer.json: a file; give the tokenizer's folder, or a SentencePiece .model file",
    ),
    "unknown Hub id": (
        ["score", "no-such-org/no-such-model"],
        "no-such-org/no-such-model: no such folder, and not loadable from the Hub",
    ),
    "sweep, missing tokenizer folder": (["sweep", "{run}", "--tokenizer", "{missing}"], "{missing}: no such tokenizer folder"),
    "sweep without any tokenizer": (
        ["sweep", "{run}"],
        "no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model) in {run}/checkpoint-5 or {run}; "
        "pass --tokenizer",
    ),
}


@pytest.mark.parametrize("case", LOADING_ERRORS)
def test_loading_errors_say_what_is_missing(case, model_dir, bare_model_dir, bare_run_dir, tmp_path, capsys):
    """What a new user mistypes gets one line naming the path and what is wrong with it, never a Hub validation error."""
    args, expected = LOADING_ERRORS[case]
    paths = {"missing": tmp_path / "no-such-folder", "model": model_dir, "bare": bare_model_dir, "run": bare_run_dir}
    args = [arg.format(**paths) for arg in args]
    assert main([*args, "--data", str(DATA), "--device", "cpu", *(["--no-progress"] if args[0] == "sweep" else [])]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tatblimp {args[0]}: error: {expected.format(**paths)}") and len(err.splitlines()) == 1
    assert "Repo id" not in err


def test_the_table_names_the_tokenizer_by_the_path_given(model_dir, bare_model_dir, small_data, monkeypatch, capsys):
    monkeypatch.chdir(model_dir.parent)
    args = ["--data", str(small_data), "--allow-modified", "--device", "cpu"]
    assert main(["score", str(bare_model_dir), "--tokenizer", model_dir.name, *args]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"  tokenizer: {model_dir.name}")


def test_sweep_records_name_the_tokenizer_by_the_path_given(model_dir, bare_model_dir, small_data, tmp_path, capsys):
    import shutil

    shutil.copytree(bare_model_dir, tmp_path / "checkpoint-5")
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("{}")
    args = ["--data", str(small_data), "--allow-modified", "--device", "cpu", "--no-progress"]
    assert main(["sweep", str(tmp_path), "--tokenizer", str(model_dir), *args]) == 0
    record = json.loads((tmp_path / "tatblimp.jsonl").read_text())
    assert record["tokenizer"] == str(model_dir) and record["step"] == 5
