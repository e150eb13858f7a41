"""The per-run false-alarm budget (results/alert_budget.py), and the false-alarm benchmark's simulation checked
against RegressionMonitor on the same outcomes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from conftest import REPO, load_module
from tatblimp_callback.results import alert_budget
from tatblimp_callback.results.regressions import RegressionMonitor
from tatblimp_callback.results.stats import Outcomes, encode_outcomes


def _bench():
    return load_module(REPO / "benchmarks" / "bench_alert_false_alarms.py")


def test_the_shares_of_the_evaluations_sum_to_at_most_one_over_any_number_of_them():
    j = np.arange(1, 2_000_001, dtype=float)
    partial = float(np.sum(1 / ((j + 10) * np.log(j + 10) ** 2)))  # computed here, not with the module
    tail = 1 / math.log(2_000_000 + 10)  # the integral of 1 / (x ln^2 x) from the last term on bounds the rest
    assert (partial + tail) / alert_budget.SPENDING_NORMALISER <= 1.0
    assert (partial + tail) / alert_budget.SPENDING_NORMALISER > 0.9999  # and not far below: little is wasted
    assert float(np.sum(alert_budget.look_share(j))) <= 1.0
    # what a run may spend at its 20th, 100th and 500th comparison
    assert [round(alert_budget.look_share(k), 6) for k in (20, 100, 500)] == [
        round(1 / (0.42515696619253746 * (k + 10) * math.log(k + 10) ** 2), 6) for k in (20, 100, 500)
    ]


def test_the_fall_p_value_is_the_one_sided_exact_binomial_and_holm_is_holm():
    for b, c in ((18, 0), (20, 5), (3, 3), (0, 7)):
        assert alert_budget.fall_p_value(b, c) == pytest.approx(binomtest(b, b + c, 0.5, alternative="greater").pvalue)
    assert alert_budget.fall_p_value(0, 0) == 1.0
    # Holm by hand: sorted 0.01, 0.02, 0.04 -> 0.03, 0.04, 0.04 (monotone), in the order given
    assert list(alert_budget.holm_adjust([0.04, 0.01, 0.02])) == pytest.approx([0.04, 0.03, 0.04])
    rows = alert_budget.holm_adjust(np.array([[0.04, 0.01, 0.02], [0.5, 0.9, 0.001]]))
    assert rows[1].tolist() == pytest.approx([1.0, 1.0, 0.003])
    # the group's p-value: the better of previous (x2) and best (x earlier x2)
    assert alert_budget.group_p_value(0.01, 0.001, 30) == pytest.approx(0.02)
    assert alert_budget.group_p_value(1.0, 0.001, 3) == pytest.approx(0.006)


def test_the_benchmark_simulation_raises_the_monitors_alerts_alert_for_alert():
    """The benchmark's array version of every mode, fed the outcomes a RegressionMonitor of each mode is fed,
    raises the same alerts at the same evaluations (falls included, so that there are some to compare);
    pooled_planned is the pooled monitor given the run's number of evaluations as its plan."""
    bench = _bench()
    phenomena = tuple(f"p{i // 40}" for i in range(200))  # five phenomena of 40 pairs
    groups, index, names = bench.membership(phenomena)
    rng = np.random.default_rng(3)
    runs, evaluations = 6, 40
    base = rng.beta(7, 3, (runs, 200))
    monitors = bench.Monitors(groups, runs, evaluations - 1)
    as_monitor = {mode: mode.removesuffix("_planned") for mode in bench.MODES}
    plan = {mode: evaluations if mode.endswith("_planned") else None for mode in bench.MODES}
    reference = {mode: [RegressionMonitor(mode=as_monitor[mode]) for _ in range(runs)] for mode in bench.MODES}
    seen = {mode: [] for mode in bench.MODES}
    expected = {mode: [] for mode in bench.MODES}
    passed = rng.random((runs, 200)) < base
    for e in range(evaluations):
        falls = e % 4 == 3  # a phenomenon falls now and then (all its pairs drawn again), and recovers
        p = np.where((index == e % 5) & falls, 0.1 * base, base)
        again = rng.random((runs, 200)) < (1.0 if falls else 0.5)
        passed = np.where(again, rng.random((runs, 200)) < p, passed)
        found = monitors.observe(passed)
        for mode in bench.MODES:
            seen[mode] += [(e, r, names[g]) for r, g in zip(*np.nonzero(found[mode]))]
            for r in range(runs):
                text = encode_outcomes(bool(v) for v in passed[r])
                alerts = reference[mode][r].observe(e, {"t": Outcomes(text, text, phenomena)}, plan[mode])
                expected[mode] += [(e, r, alert.group) for alert in alerts]
    for mode in bench.MODES:
        assert sorted(seen[mode]) == sorted(expected[mode])
        assert len(expected[mode]) >= 10  # there was something to agree on
    assert len(expected["per_run"]) < len(expected["per_evaluation"])
    assert len(expected["pooled"]) < len(expected["pooled_planned"])  # the plan spends more at each evaluation


def test_runs_that_never_regress_rarely_alert_pooled_or_per_run_and_often_per_evaluation():
    """200 simulated runs of 60 evaluations on TatBLiMP's shape, every pair redrawn at each evaluation (the
    benchmark's harshest null): at most alert_q of them alert per run (4 here); the per-evaluation rule almost half (92)."""
    bench = _bench()
    groups, index, _ = bench.membership(tuple(f"p{i // 78}" for i in range(1248)))
    figures = bench.false_alarms(groups, index, 200, 60, "redraw_all", seed=0, chunk=200)
    assert figures["pooled"]["runs_with_an_alert"]["count"] <= 10  # 5% of 200
    assert figures["per_run"]["runs_with_an_alert"]["count"] <= 10
    assert figures["per_evaluation"]["runs_with_an_alert"]["count"] >= 40


def test_the_sign_flip_p_value_is_exact_by_enumeration_and_mcnemar_with_one_evaluation():
    import itertools

    from tatblimp_callback.results.alert_windows import sign_flip_p_value

    for magnitudes in ((3, 2, 1), (0, 4, 2), (5,), (2, 3), (1, 1, 1), (0, 0, 3)):
        values = [m for m, count in enumerate(magnitudes, 1) for _ in range(count)]
        sums = [sum(s * v for s, v in zip(signs, values)) for signs in itertools.product((1, -1), repeat=len(values))]
        for s in sorted(set(sums)):  # the sums that can occur
            assert sign_flip_p_value(magnitudes, s) == pytest.approx(np.mean([x >= s for x in sums]), abs=1e-12)
    assert sign_flip_p_value((0, 0, 0), 0) == 1.0
    assert sign_flip_p_value((23,), 20 - 3) == pytest.approx(alert_budget.fall_p_value(20, 3))


def test_the_pooled_group_p_value_is_the_smallest_weighted_p_value_and_the_weights_sum_to_one():
    """12 window tests (widths 1, 2, 3, each against 4 earlier windows) weighted 0.2 / 4, 0.1 / 4 and 0.65 / 4, and
    the best weighted 0.05, its p-value times the evaluations it was chosen from."""
    from tatblimp_callback.results.alert_windows import WINDOW_TESTS

    assert WINDOW_TESTS == ((1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 2), (2, 4), (2, 6), (3, 0), (3, 3), (3, 6), (3, 9))
    only = [1.0] * 12
    only[4] = 1e-4  # the last 2 against the 2 before them
    assert alert_budget.pooled_group_p_value(only, 1e-5, 30) == pytest.approx(1e-4 / 0.025)
    assert alert_budget.pooled_group_p_value(only, 1e-6, 30) == pytest.approx(1e-6 * 30 / 0.05)
    only[4], only[11] = 1.0, 1e-4  # the last 3 against the 3 that end 9 evaluations before them
    assert alert_budget.pooled_group_p_value(only, 1.0, 30) == pytest.approx(1e-4 / 0.1625)
    assert alert_budget.pooled_group_p_value([1.0] * 12, 1.0, 30) == 1.0
    # early in a run the tests that fit share the whole: at the 2nd evaluation the previous one and the best, half
    # each; at the 6th, windows of 2 to 6 evaluations, 0.05 x 4 + 0.025 x 2 + 0.1625 + 0.05 = 0.4625 of base weight
    assert alert_budget.pooled_group_p_value([1e-4] + [1.0] * 11, 1.0, 1) == pytest.approx(1e-4 / 0.5)
    assert alert_budget.pooled_group_p_value([1.0] * 12, 1e-4, 1) == pytest.approx(1e-4 / 0.5)
    assert alert_budget.pooled_weights(5)[0][8] == pytest.approx(0.1625 / 0.4625)  # the last 3 against the 3 before
    assert alert_budget.pooled_weights(5)[0][9] == 0.0  # the 3 that end 3 before them: 9 evaluations needed
    weights = sum(alert_budget.window_weight(width) for width, _ in WINDOW_TESTS)
    assert weights + alert_budget.BEST_WEIGHT == pytest.approx(1.0)
    for earlier in range(1, 20):
        windows, best = alert_budget.pooled_weights(earlier)
        assert sum(windows) + best == pytest.approx(1.0)


def test_a_window_against_an_earlier_one_counts_the_pairs_by_hand_and_holds_its_level_when_outcomes_are_kept():
    """The last 3 evaluations against the 3 that end 3 before them: the evaluations between are not compared. On a
    chain that keeps each pair's outcome and redraws a fifth (reversible, as the long-runs guide assumes), the
    lagged windows' p-values are at or below 0.05 in at most 5% of 4,000 groups of 80 pairs."""
    from tatblimp_callback.results.alert_windows import sign_flip_p_value, window_counts

    recent = ["111", "110", "100", "000", "000", "000", "000", "011", "001"]
    # compared: "111", "110", "100" (the first 3) against "000", "011", "001" (the last 3); "000" x 3 between
    counts = window_counts(recent, 3, lag=3)
    assert (counts.n, counts.statistic, counts.magnitudes, counts.lag) == (3, 3 + 1 - 1, (2, 0, 1), 3)  # d: 3, 1, -1
    assert (counts.before_score, counts.after_score) == (6 / 9, 3 / 9)
    assert window_counts(recent, 3, lag=4) is None  # 10 evaluations needed
    assert window_counts(recent, 1, lag=2).statistic == 0 - 1  # "000" (3 before) against "001"
    rng = np.random.default_rng(5)
    chance = rng.beta(7, 3, (4000, 80))
    passed = rng.random((4000, 80)) < chance
    history = []
    for _ in range(15):
        again = rng.random((4000, 80)) < 0.2
        passed = np.where(again, rng.random((4000, 80)) < chance, passed)
        history.append(passed)
    for width, lag in ((3, 9), (2, 6), (1, 3)):
        texts = [[encode_outcomes(bool(v) for v in e[g]) for e in history] for g in range(4000)]
        p = [sign_flip_p_value(c.magnitudes, c.statistic) for c in (window_counts(t, width, lag) for t in texts)]
        assert np.mean(np.array(p) <= 0.05) <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 4000)
