"""``benchmarks/bench_overhead.py``'s measures run on the engine as it is: ``gpu_check.py`` part 3 calls them in the one
GPU call a task may get, so a measure that no longer finds what it times must fail here, not there."""

from __future__ import annotations

import pytest

from conftest import REPO, load_module, tiny_llama
from tatblimp_callback import Scorer


@pytest.fixture(scope="module")
def bench_overhead():
    return load_module(REPO / "benchmarks" / "bench_overhead.py")


@pytest.fixture
def cache(bpe_tokenizer, small_data):
    from tatblimp_callback import build_cache

    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


def test_host_time_leaves_out_the_body_and_the_head(bench_overhead, bpe_tokenizer, cache):
    scorer = Scorer(tiny_llama(len(bpe_tokenizer)), cache)
    scorer.score()
    measured = bench_overhead.host_seconds(scorer, repeats=2)
    host, total, inside = min(measured["all"])
    assert inside > 0 and host == pytest.approx(total - inside)
    calls = 2 * len(scorer.layout().batches)
    assert measured["timed_calls"]["model_output"] == calls
    head = "method_logprobs" if scorer.method.head == "tiled" else "read_logprobs"
    assert measured["timed_calls"][head] >= calls  # the tiled head: a call per tile


def test_the_graph_path_with_free_replays_replays_every_batch(bench_overhead, bpe_tokenizer, cache):
    model = tiny_llama(len(bpe_tokenizer))
    measured = bench_overhead.graph_path_host(model, cache, repeats=2)
    batches = len(Scorer(model, cache).layout().batches)
    assert measured["reason"] is None
    assert measured["replays"] == 3 * batches  # captured at the second evaluation, replayed at the third and the two timed
    assert len(measured["times"]) == 2 and measured["seconds"] == min(measured["times"])


def test_the_per_evaluation_checks_are_timed_each(bench_overhead, bpe_tokenizer):
    checks = bench_overhead.per_evaluation_checks(tiny_llama(len(bpe_tokenizer)), repeats=1, number=2)
    assert sorted(checks) == ["model_structure", "scoring_mode", "weight_fingerprint"]
    assert all(0 < ms < 1000 for ms in checks.values())
