"""Results say what made them (versions, dtype, device, date), list each pair's sentences and outcomes, and
say when they cover only some pairs (``--limit``, ``--phenomena``)."""

from __future__ import annotations

import json
import logging
import platform
import shutil
from datetime import datetime, timedelta, timezone

import pytest
import torch
import transformers

from conftest import DATA
from tatblimp_callback import __version__, build_cache, load_benchmark
from tatblimp_callback.cli import main
from tatblimp_callback.commands.sweep import SweepOptions, sweep
from tatblimp_callback.reading.data import OFFICIAL_MD5, BenchmarkError

ENVIRONMENT = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "tatblimp_callback": __version__,
}


def assert_made_by_this_machine(record: dict, dtype: str) -> None:
    assert record["environment"] == ENVIRONMENT and record["dtype"] == dtype and record["device"] == "cpu"
    created = datetime.strptime(record["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(datetime.now(timezone.utc) - created) < timedelta(hours=1)


def first_pairs(limit: int, phenomena=None):
    seen: dict[str, int] = {}
    kept = []
    for pair in load_benchmark(DATA).pairs:
        if (phenomena is None or pair.phenomenon in phenomena) and seen.get(pair.phenomenon, 0) < limit:
            seen[pair.phenomenon] = seen.get(pair.phenomenon, 0) + 1
            kept.append(pair)
    return kept


def test_a_limited_score_is_partial_and_says_what_made_it_pair_by_pair(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--data", str(DATA), "--device", "cpu", "--dtype", "bfloat16", "--limit", "2", "--output", str(out)]
    assert main(["score", str(model_dir), *args]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    selection = "first 2 pairs of each phenomenon (32 of 1248 pairs)"
    assert header == f"TatBLiMP v1.0 (2026-06-19), partial: {selection}  dtype: bfloat16  tokenizer: {model_dir}"
    result = json.loads(out.read_text())
    assert_made_by_this_machine(result, "bfloat16")
    assert result["partial"] is True and result["selection"] == selection and result["n"] == 32
    assert result["benchmark"]["md5"] == OFFICIAL_MD5 and {g["n"] for g in result["phenomena"].values()} == {2}
    rows = result["pairs"]
    assert [(row["good"], row["bad"], row["phenomenon"]) for row in rows] == [
        (p.good, p.bad, p.phenomenon) for p in first_pairs(2)
    ]
    for row in rows:  # bf16: the pairs within rounding are decided by their float32 log-probs (exact_decisions)
        good, bad = (
            (row["float32_good_logprob"], row["float32_bad_logprob"])
            if row.get("rescored")
            else (row["good_logprob"], row["bad_logprob"])
        )
        assert row["passed"] == (good > bad)
        assert row["passed_norm"] == (good / row["good_bytes"] > bad / row["bad_bytes"])
    assert result["exact_decisions"]["rescored_pairs"] == sum(bool(row.get("rescored")) for row in rows) > 0
    assert sum(row["passed"] for row in rows) / 32 == result["acc"]
    assert sum(row["passed_norm"] for row in rows) / 32 == result["acc_norm"]
    assert result["non_finite_pairs"] == 0  # partial here only because of the selection


def test_chosen_phenomena_keep_the_benchmark_order(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["score", str(model_dir), "--data", str(DATA), "--phenomena", "passives, binding", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["phenomena"]) == ["binding", "passives"] and result["n"] == 78 + 83
    assert result["selection"] == "phenomena binding,passives (161 of 1248 pairs)" and result["partial"] is True
    assert [row["good"] for row in result["pairs"]] == [p.good for p in first_pairs(1000, {"binding", "passives"})]


def test_selection_errors_and_the_cache_of_a_selection(bpe_tokenizer, small_data, tmp_path):
    benchmark = load_benchmark(small_data, allow_modified=True)
    with pytest.raises(BenchmarkError, match="no phenomenon nope, other"):
        benchmark.select(phenomena="binding,nope,other")
    assert benchmark.select() is benchmark
    # A limit of at least every phenomenon's count, or all phenomena named, keeps the whole file: not partial (it was
    # "first 1000 pairs of each phenomenon (1248 of 1248 pairs)", which compare then refused against a full run).
    assert benchmark.select(limit=3) is benchmark and benchmark.select(limit=1000) is benchmark
    assert benchmark.select(phenomena=",".join(benchmark.phenomena)) is benchmark
    assert benchmark.select(limit=2).selection == "first 2 pairs of each phenomenon (32 of 48 pairs)"
    for nothing in ("", " , "):  # --phenomena "" scored every phenomenon
        with pytest.raises(BenchmarkError, match=f"^phenomena {nothing!r} names none \\(phenomena: "):
            benchmark.select(phenomena=nothing)
    path = tmp_path / "cache.safetensors"
    assert build_cache(bpe_tokenizer, benchmark, cache_path=path).num_pairs == 48
    # The same file, tokenizer and prefix but fewer pairs: another cache, not the saved one.
    assert build_cache(bpe_tokenizer, benchmark.select(limit=1), cache_path=path).num_pairs == 16


def test_a_sweep_record_says_what_made_it(model_dir, small_data, tmp_path):
    shutil.copytree(model_dir, tmp_path / "run" / "checkpoint-7")
    (tmp_path / "run" / "checkpoint-7" / "trainer_state.json").write_text("{}")
    report = sweep(tmp_path / "run", SweepOptions(data=str(small_data), allow_modified=True, progress=False, device="cpu"))
    (record,) = [json.loads(line) for line in report.results_path.read_text().splitlines()]
    assert_made_by_this_machine(record, "float32")
    assert record["partial"] is False and record["selection"] is None


def test_a_checkpoint_left_unscored_is_named_with_why(model_dir, small_data, tmp_path, caplog):
    """A checkpoint folder with a config but no weights (a save under way, or one that failed) was "not complete yet"
    with no reason given."""
    shutil.copytree(model_dir, tmp_path / "run" / "checkpoint-7")
    (tmp_path / "run" / "checkpoint-7" / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "checkpoint-9").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "run" / "checkpoint-9")
    with caplog.at_level(logging.WARNING, logger="tatblimp_callback"):
        report = sweep(tmp_path / "run", SweepOptions(data=str(small_data), allow_modified=True, progress=False, device="cpu"))
    assert report.scored == ["checkpoint-7"] and report.incomplete == ["checkpoint-9"]
    assert "1 checkpoint(s) not complete yet, not scored: checkpoint-9 (no weights file yet)" in caplog.text


def test_endpoint_answers_of_the_whole_benchmark_are_not_reused_for_a_selection(small_data, tmp_path):
    from tatblimp_callback.chat.endpoint import EndpointError, _load_results, open_results

    benchmark = load_benchmark(small_data, allow_modified=True)
    header = {"tatblimp_forced_choice": 1, "model": "m", "benchmark_md5": benchmark.md5, "prompt": "p", "system_prompt": None}
    path = tmp_path / "answers.jsonl"
    with open_results(path, {**header, "benchmark_selection": None}) as sink:
        sink.write(json.dumps({"item": 0, "text": "A"}) + "\n")
    assert _load_results(path, {**header, "benchmark_selection": None}, 96) == {0: "A"}
    selection = benchmark.select(limit=1).selection
    with pytest.raises(EndpointError, match="holds answers for a different benchmark selection"):
        _load_results(path, {**header, "benchmark_selection": selection}, 32)
