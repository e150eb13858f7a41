"""Intervals, paired tests and per-pair outcomes, checked against closed forms computed here."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from conftest import DATA, tiny_llama
from tatblimp_callback import build_cache, compute_results, load_benchmark
from tatblimp_callback.results.stats import Outcomes, bh_adjust, mcnemar_p, paired_tests, wilson_interval

Z = NormalDist().inv_cdf(0.975)


def wilson(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval, closed form."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return centre - half, centre + half


def exact_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar: twice the smaller binomial tail at 0.5, at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def benjamini_hochberg(p: list[float]) -> list[float]:
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adjusted = [0.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, p[i] * m / rank)
        adjusted[i] = running
    return adjusted


@pytest.mark.parametrize("k, n", [(0, 1), (1, 1), (0, 78), (78, 78), (58, 78), (39, 78), (24, 47), (766, 1248), (1, 1248)])
def test_wilson_interval_matches_the_closed_form(k, n):
    low, high = wilson_interval(k, n)
    expected = wilson(k, n)
    assert low == pytest.approx(expected[0], abs=1e-12) and high == pytest.approx(expected[1], abs=1e-12)
    assert low <= k / n <= high


def test_wilson_interval_edges():
    assert wilson_interval(78, 78)[1] == 1.0 and wilson_interval(0, 78)[0] == 0.0
    assert wilson_interval(58, 78) == pytest.approx((0.6369, 0.8274), abs=1e-4)  # the "0.65 to 0.83" at 0.75
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


@pytest.mark.parametrize("b, c", [(0, 0), (5, 5), (0, 1), (0, 6), (1, 9), (9, 1), (30, 55), (103, 181), (40, 0)])
def test_mcnemar_p_is_the_exact_binomial_sum(b, c):
    assert mcnemar_p(b, c) == pytest.approx(exact_mcnemar(b, c), rel=1e-12, abs=1e-300)


def test_mcnemar_known_values():
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(7, 7) == 1.0
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)  # 0.03125: six discordant pairs, all one way
    assert mcnemar_p(0, 5) == pytest.approx(2 / 32)  # 0.0625: five are not enough


def test_benjamini_hochberg_matches_the_step_up_rule():
    p = [0.01, 0.04, 0.03, 0.5, 0.0001, 1.0, 0.2, 0.04]
    assert bh_adjust(p) == pytest.approx(benjamini_hochberg(p), abs=1e-12)
    assert bh_adjust([]) == []
    assert bh_adjust([1.0] * 16) == [1.0] * 16


# -- Results: intervals and outcomes on known log-probs ----------------------------------------


@pytest.fixture(scope="module")
def known(bpe_tokenizer):
    """Results of the whole benchmark from made-up log-probs: one phenomenon passes all, one none,
    one has non-finite pairs, one pair ties; the rest at random."""
    benchmark = load_benchmark(DATA)
    cache = build_cache(bpe_tokenizer, DATA)
    good_bytes = np.array([len(p.good.encode()) for p in benchmark.pairs], dtype=np.float64)
    bad_bytes = np.array([len(p.bad.encode()) for p in benchmark.pairs], dtype=np.float64)
    names = [p.phenomenon for p in benchmark.pairs]
    rng = np.random.default_rng(0)
    good, bad = rng.normal(-60, 8, len(names)), rng.normal(-60, 8, len(names))
    everything, nothing, broken = benchmark.phenomena[0], benchmark.phenomena[1], benchmark.phenomena[2]
    for i, name in enumerate(names):
        if name == everything:
            good[i], bad[i] = -1.0 * good_bytes[i], -9.0 * bad_bytes[i]
        elif name == nothing:
            good[i], bad[i] = -9.0 * good_bytes[i], -1.0 * bad_bytes[i]
    broken_pairs = [i for i, name in enumerate(names) if name == broken][:5]
    good[broken_pairs[:3]] = np.nan
    bad[broken_pairs[3:]] = -np.inf
    tie = names.index(benchmark.phenomena[3])
    good[tie] = bad[tie]
    logprobs = np.empty(2 * len(names))
    logprobs[0::2], logprobs[1::2] = good, bad
    results = compute_results(cache, torch.tensor(logprobs))
    finite = np.isfinite(good) & np.isfinite(bad)
    with np.errstate(invalid="ignore"):
        passed = {"acc": good > bad, "acc_norm": good / good_bytes > bad / bad_bytes}
    return results, benchmark, finite, passed, (everything, nothing, broken, broken_pairs, tie)


def test_intervals_of_every_group_match_the_closed_form(known):
    results, benchmark, finite, passed, (everything, nothing, broken, _, tie) = known
    as_dict = results.to_dict()
    groups = {"overall": [True] * len(finite)}
    groups |= {name: [p.phenomenon == name for p in benchmark.pairs] for name in benchmark.phenomena}
    # A subtype group holds one phenomenon's pairs: a label found under several (TatBLiMP's "past" under passives and
    # suspended_affixation) is named with its phenomenon; before, one group pooled both.
    kinds = {(p.phenomenon, p.subtype) for p in benchmark.pairs if p.subtype}
    shared = {s for _, s in kinds if sum(t == s for _, t in kinds) > 1}
    assert len(shared) == 10 and "past" in shared and "past" not in as_dict["subtypes"]
    groups |= {
        f"subtype:{f'{name}/{s}' if s in shared else s}": [(p.phenomenon, p.subtype) == (name, s) for p in benchmark.pairs]
        for name, s in kinds
    }
    assert set(as_dict["subtypes"]) == {group[len("subtype:") :] for group in groups if group.startswith("subtype:")}
    assert as_dict["subtypes"]["passives/past"]["n"] == 33 and as_dict["subtypes"]["suspended_affixation/past"]["n"] == 42
    for group, members in groups.items():
        keep = np.array(members) & finite
        n = int(keep.sum())
        if group == "overall":
            entry = as_dict
        elif group.startswith("subtype:"):
            entry = as_dict["subtypes"][group[len("subtype:") :]]
        else:
            entry = as_dict["phenomena"][group]
        assert entry["n"] == n, group
        for metric in ("acc", "acc_norm"):
            k = int((passed[metric] & keep).sum())
            assert entry[metric] == pytest.approx(k / n), (group, metric)
            assert entry[f"{metric}_ci"] == pytest.approx(list(wilson(k, n)), abs=1e-12), (group, metric)
    # The edge cases, by value.
    assert as_dict["phenomena"][everything]["acc_norm"] == 1.0 and as_dict["phenomena"][everything]["acc_norm_ci"][1] == 1.0
    assert as_dict["phenomena"][nothing]["acc"] == 0.0 and as_dict["phenomena"][nothing]["acc_ci"][0] == 0.0
    assert as_dict["phenomena"][broken]["non_finite"] == 5
    assert results.overall.ties == 1 and results.pairs[tie].passed is False


def test_outcome_strings_one_character_per_pair(known):
    results, benchmark, finite, passed, (everything, _, _, broken_pairs, tie) = known
    outcomes = results.to_dict()["outcomes"]
    for metric in ("acc", "acc_norm"):
        expected = "".join("-" if not f else "1" if p else "0" for f, p in zip(finite, passed[metric]))
        assert outcomes[metric] == expected and len(expected) == 1248
    assert outcomes["acc"][tie] == "0"  # a tie fails
    assert [outcomes["acc"][i] for i in broken_pairs] == ["-"] * 5
    assert outcomes["phenomenon_runs"][0] == [everything, 79]
    assert sum(count for _, count in outcomes["phenomenon_runs"]) == 1248
    assert Outcomes.from_dict(outcomes).phenomena == tuple(p.phenomenon for p in benchmark.pairs)


def test_flat_metrics_table_and_text_show_the_intervals(known):
    results = known[0]
    flat = results.flat_metrics("tb")
    k = results.to_dict()["outcomes"]["acc_norm"].count("1")
    assert (flat["tb/acc_norm_ci_low"], flat["tb/acc_norm_ci_high"]) == pytest.approx(wilson(k, results.overall.n), abs=1e-12)
    assert flat["tb/acc_ci_low"] < flat["tb/acc"] < flat["tb/acc_ci_high"]
    columns, rows = results.phenomenon_table()
    assert columns == ["phenomenon", "n", "acc", "acc CI", "acc_norm", "acc_norm CI", "mean margin", "ties"]
    assert [row[0] for row in rows] == [*results.phenomena, "overall"] and len(rows) == 17
    everything = known[4][0]
    assert rows[0][:6] == [everything, 79, 1.0, "[0.954, 1.000]", 1.0, "[0.954, 1.000]"]
    low, high = wilson(k, results.overall.n)
    assert rows[-1][5] == f"[{low:.3f}, {high:.3f}]"
    line = next(line for line in results.format_table().splitlines() if line.startswith(everything))
    assert line.split()[1:] == ["79", "1.0000", "[0.954,", "1.000]", "1.0000", "[0.954,", "1.000]"]


# -- paired tests on known outcome strings --------------------------------------------------------


def test_paired_tests_on_known_outcomes():
    # Phenomenon a (10 pairs): the run passes 6 the baseline fails, the baseline 1 the run fails;
    # b (6): identical; c (8): one pair not finite in the run, one in the baseline, then 6 discordant one way.
    base = {"acc_norm": "0000001111" + "110100" + "-1" + "000000", "acc": "1" * 24}
    run = {"acc_norm": "1111110111" + "110100" + "1-" + "111111", "acc": "1" * 24}
    names = [["a", 10], ["b", 6], ["c", 8]]
    tests = paired_tests(
        Outcomes.from_dict({**base, "phenomenon_runs": names}), Outcomes.from_dict({**run, "phenomenon_runs": names})
    )
    got = {(t.metric, t.group): (t.n, t.baseline_only, t.run_only, t.p_value, t.p_adjusted) for t in tests}
    p_a, p_c = exact_mcnemar(1, 6), exact_mcnemar(0, 6)
    adjusted = benjamini_hochberg([p_a, 1.0, p_c])
    assert got[("acc_norm", "overall")] == pytest.approx((22, 1, 12, exact_mcnemar(1, 12), exact_mcnemar(1, 12)))
    assert got[("acc_norm", "a")] == pytest.approx((10, 1, 6, p_a, adjusted[0]))
    assert got[("acc_norm", "b")] == pytest.approx((6, 0, 0, 1.0, adjusted[1]))  # no discordant pairs
    assert got[("acc_norm", "c")] == pytest.approx((6, 0, 6, p_c, adjusted[2]))  # non-finite in either: left out
    assert all(v[1:] == (0, 0, 1.0, 1.0) for (metric, _), v in got.items() if metric == "acc")  # every pair passed by both
    assert [t.group for t in tests] == ["overall", "a", "b", "c"] * 2 and tests[0].metric == "acc_norm"
    assert tests[0].difference == pytest.approx(11 / 22)


def test_malformed_outcomes_are_refused():
    with pytest.raises(ValueError, match=r"outcomes\.acc has 3 pairs but phenomenon_runs 4"):
        Outcomes.from_dict({"acc": "101", "acc_norm": "1011", "phenomenon_runs": [["a", 4]]})
    with pytest.raises(ValueError, match="string of '1', '0' and '-'"):
        Outcomes.from_dict({"acc": "1x11", "acc_norm": "1011", "phenomenon_runs": [["a", 4]]})
    with pytest.raises(ValueError, match="malformed outcomes"):
        Outcomes.from_dict({"acc": "1011"})


# -- the callback logs the overall intervals --------------------------------------------------------


def test_callback_logs_the_overall_intervals(bpe_tokenizer, small_data, tmp_path):
    from tatblimp_callback import TatBLiMPCallback
    from trainer_utils import make_trainer, tatblimp_entries

    cb = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=100)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=1)
    trainer.train()
    entries = tatblimp_entries(trainer)
    assert [e["step"] for e in entries] == [0, 1]
    pairs = cb.last_results.pairs
    for metric, passed in (
        ("acc", [p.good_logprob > p.bad_logprob for p in pairs]),
        ("acc_norm", [p.good_logprob / p.good_bytes > p.bad_logprob / p.bad_bytes for p in pairs]),
    ):
        low, high = wilson(sum(passed), len(pairs))
        assert entries[-1][f"tatblimp/{metric}_ci_low"] == pytest.approx(low, abs=1e-12)
        assert entries[-1][f"tatblimp/{metric}_ci_high"] == pytest.approx(high, abs=1e-12)
        assert cb.history[-1][f"tatblimp/{metric}_ci_low"] == entries[-1][f"tatblimp/{metric}_ci_low"]


def test_outcomes_of_a_record_without_them_read_a_null_log_prob_as_not_finite():
    """Results JSON writes a non-finite log-prob as null: a record read by its pairs (no ``outcomes``) takes it so."""
    pair = {"good_bytes": 10, "bad_bytes": 10, "phenomenon": "p"}
    record = {
        "acc": 1.0,
        "acc_norm": 1.0,
        "pairs": [{**pair, "good_logprob": -1.0, "bad_logprob": -2.0}, {**pair, "good_logprob": None, "bad_logprob": -2.0}],
    }
    outcomes = Outcomes.from_record(record)
    assert (outcomes.acc, outcomes.acc_norm) == ("1-", "1-")
