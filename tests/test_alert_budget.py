"""The per-run false-alarm budget (results/alert_budget.py), and the false-alarm benchmark's simulation checked
against RegressionMonitor on the same outcomes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

from tatblimp_callback.results import alert_budget
from tatblimp_callback.results.regressions import RegressionMonitor
from tatblimp_callback.results.stats import Outcomes, encode_outcomes


def _bench():
    path = Path(__file__).parents[1] / "benchmarks" / "bench_alert_false_alarms.py"
    spec = importlib.util.spec_from_file_location("bench_alert_false_alarms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    # the pooled group p-value: the smallest of each window's p over its weight and the best's times earlier over 0.1
    assert alert_budget.pooled_group_p_value([1.0, 1e-4, 1.0], 1e-5, 30) == pytest.approx(1e-4 / 0.1)
    assert alert_budget.pooled_group_p_value([1e-4, 1.0, 1e-4], 1.0, 30) == pytest.approx(1e-4 / 0.45)
    assert sum(alert_budget.WINDOW_WEIGHTS) + alert_budget.BEST_WEIGHT == pytest.approx(1.0)
