"""TatBLiMP and more suites in one cache and one forward sweep: the same log-probs as each alone, bounded memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import SHARED, peak_allocation, tiny_llama
from tatblimp_callback import Evaluator, Scorer, build_cache, evaluate
from tatblimp_callback.engine.scoring_method import LOGIT_SCALE, relative_tolerance
from tatblimp_callback.reading.suites import load_suite
from tatblimp_callback.tokenized.cache import concat_caches

BLIMP = SHARED / "blimp" / "data"


def blimp_subset(folder: Path, files: dict[str, tuple[int, int]]) -> Path:
    """Lines [start, stop) (1-based) of some BLiMP files, under their own names."""
    folder.mkdir(exist_ok=True)
    for name, (start, stop) in files.items():
        lines = (BLIMP / name).read_text(encoding="utf-8").split("\n")[start - 1 : stop - 1]
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def suite_folder(tmp_path_factory) -> Path:
    # passive_1.jsonl line 325 is one of BLiMP's identical pairs: line 25 of the copy.
    return blimp_subset(
        tmp_path_factory.mktemp("blimp"), {"anaphor_gender_agreement.jsonl": (1, 41), "passive_1.jsonl": (301, 341)}
    )


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))


def assert_same_logprobs(fused, alone):
    """Every sentence's log-prob within the engine's tolerance (as the scoring method check allows)."""
    got = torch.tensor([[p.good_logprob, p.bad_logprob] for p in fused.pairs], dtype=torch.float64)
    want = torch.tensor([[p.good_logprob, p.bad_logprob] for p in alone.pairs], dtype=torch.float64)
    tokens = torch.tensor([[p.good_tokens, p.bad_tokens] for p in alone.pairs], dtype=torch.float64)
    allowed = relative_tolerance(torch.float32, torch.device("cpu")) * (want.abs() + LOGIT_SCALE * tokens)
    assert got.shape == want.shape and bool(((got - want).abs() <= allowed).all())


def test_tatblimp_and_a_suite_in_one_pass_give_each_the_log_probs_it_gets_alone(model, bpe_tokenizer, suite_folder, small_data):
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True, suites={"blimp": suite_folder})
    fused = evaluator(model)
    tatblimp_alone = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    suite = load_suite("blimp", suite_folder)
    blimp_alone = evaluate(model, bpe_tokenizer, suite)

    assert_same_logprobs(fused, tatblimp_alone)
    blimp = fused.suites["blimp"]
    assert len(blimp.pairs) == 79 and blimp.overall.n == 79  # 80 pairs, the identical one left out
    assert_same_logprobs(blimp, blimp_alone)
    assert (blimp.acc, blimp.acc_norm) == (blimp_alone.acc, blimp_alone.acc_norm)
    assert (
        blimp.left_out
        == blimp_alone.left_out
        == [{"file": str(suite_folder / "passive_1.jsonl"), "line": 25, "reason": "the good and bad sentences are identical"}]
    )
    assert set(blimp.phenomena) == {"anaphor_agreement", "argument_structure"}
    assert set(blimp.subtypes) == {"anaphor_gender_agreement", "passive_1"}
    # One cache: TatBLiMP's sentences, then the suite's.
    assert evaluator.cache.num_sentences == 2 * (48 + 79)
    assert fused.run_info["cache_bytes"] == evaluator.cache.nbytes > 0

    # TatBLiMP's keys are unchanged; the suite is under "suites", with its left-out pairs.
    record, alone_record = fused.to_dict(), tatblimp_alone.to_dict()
    assert set(record) - set(alone_record) == {"suites"} and set(alone_record) <= set(record)
    assert record["acc_norm"] == alone_record["acc_norm"]
    suite_record = json.loads(json.dumps(record["suites"]["blimp"]))
    assert suite_record["left_out"][0]["line"] == 25 and len(suite_record["pairs"]) == 79
    assert suite_record["benchmark"]["md5"] == suite.md5 and "scoring_method" not in suite_record
    # What a custom loop logs (Fabric's log_dict, Accelerator.log): TatBLiMP's scalars and the suite's, by its name.
    flat = fused.flat_metrics("tb")
    assert flat["tb/acc_norm"] == fused.acc_norm and flat["blimp/acc_norm"] == blimp.acc_norm
    assert {key for key in flat if key.startswith("blimp/")} == set(blimp.flat_metrics("blimp"))

    # The suite skipped this time: TatBLiMP alone, the same numbers, in a layout of its own sentences.
    skipped = evaluator(model, suites=[])
    assert skipped.suites == {} and skipped.acc_norm == fused.acc_norm
    assert_same_logprobs(skipped, tatblimp_alone)
    with pytest.raises(ValueError, match=r"unknown suites \['nope'\]"):
        evaluator(model, suites=["nope"])


def test_include_tokens_gives_a_suites_pairs_their_tokens_too(model, bpe_tokenizer, suite_folder, small_data):
    """``include_tokens=True`` with a suite: its pairs had none of the token fields (TatBLiMP's only), with no word;
    the docs say a suite's results have the same keys."""
    fused = Evaluator(bpe_tokenizer, small_data, allow_modified=True, suites={"blimp": suite_folder}, include_tokens=True)(model)
    alone = evaluate(model, bpe_tokenizer, load_suite("blimp", suite_folder), include_tokens=True)
    record, alone_record = fused.to_dict()["suites"]["blimp"], alone.to_dict()
    assert len(record["pairs"]) == 79 and record.keys() >= {"edit_margins", "critical_region_surprisal"}
    for pair, by_itself in zip(record["pairs"], alone_record["pairs"]):
        assert pair["good_tokens_text"] == by_itself["good_tokens_text"] and pair["edit"] == by_itself["edit"]
        assert sum(pair["good_token_logprobs"]) == pytest.approx(pair["good_logprob"], abs=1e-4)
        assert pair["critical_region_tokens"] == by_itself["critical_region_tokens"]
    assert "good_token_logprobs" in fused.to_dict()["pairs"][0]  # TatBLiMP's as before


@pytest.mark.slow
def test_one_batch_at_a_time_and_peak_memory_within_the_budget(model, bpe_tokenizer, small_data, tmp_path):
    """The rows of a layout are kept, never its batches: one forward call's batch exists at a time, so the
    peak tensor memory of an evaluation stays at the budget's size whatever the number of sentences.

    Before, every batch (inputs, 4D tree masks, score indices) was built at once and kept for the next
    evaluation: 1.16 GiB over the budget with all of BLiMP. The torch profiler counts tensors; tracemalloc
    counts the Python objects the profiler does not see (a tree mask once built from lists of every pair).
    """
    import tracemalloc
    import weakref

    from torch.profiler import ProfilerActivity, profile

    from tatblimp_callback import load_benchmark
    from tatblimp_callback.engine.packing import Batches

    budget = 16 * 2**20
    folder = blimp_subset(
        tmp_path / "blimp", {name: (1, 151) for name in ("adjunct_island.jsonl", "anaphor_gender_agreement.jsonl")}
    )
    tatblimp = build_cache(bpe_tokenizer, load_benchmark(small_data, allow_modified=True))
    cache = concat_caches([tatblimp, build_cache(bpe_tokenizer, load_suite("blimp", folder))])
    scorer = Scorer(model, cache, memory_budget=budget)
    scorer.score()  # the method check

    alive, most = [0], [0]
    build = Batches.__getitem__

    def counted(self, index):
        batch = build(self, index)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(batch, lambda: alive.__setitem__(0, alive[0] - 1))
        return batch

    Batches.__getitem__ = counted
    tracemalloc.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            scorer.score()
        python_peak = tracemalloc.get_traced_memory()[1]  # what the profiler does not see: Python objects
    finally:
        tracemalloc.stop()
        Batches.__getitem__ = build
    layout = scorer.layout()
    assert len(layout.batches) >= 4 and most[0] == 1
    # What the scorer keeps between evaluations: the plan, compact, within its share of the budget, counted below.
    from tatblimp_callback.engine.scoring import PLAN_SHARE

    assert 0 < layout.plan_bytes <= budget // PLAN_SHARE
    peak = peak_allocation(prof) + layout.plan_bytes
    # Measured (2026-12-01): tensor peak 10.1 MiB; Python objects 0.20 MiB at peak, 1.47 MiB when each tree batch's
    # mask was built from Python lists of every attending pair. Both within the budget, the Python share under 1/32.
    assert 0 < peak <= budget, peak
    assert peak + python_peak <= budget and python_peak <= budget // 32, (peak, python_peak)
