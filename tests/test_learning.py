"""Fitted acquisition steps with bootstrap intervals, the order of acquisition, and trends (results/learning.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest, false_discovery_control, kendalltau

from tatblimp_callback.results.learning import (
    NOT_ACQUIRED,
    NOT_ENOUGH,
    AcquisitionFit,
    _curve,
    acquisition_fits,
    evaluations_from_records,
    fit_acquisition,
    learning_order,
    trends,
)
from tatblimp_callback.results.stats import Outcomes, encode_outcomes

STEPS = [0, 10, 20, 50, 100, 200, 400, 700, 1000, 1500, 2000]


def noisy_history(rng, midpoint: float, plateau: float, slope: float, pairs: int = 78) -> list[str]:
    shares = _curve(np.log1p(STEPS), plateau, np.log1p(midpoint), slope)
    return [encode_outcomes(bool(v) for v in rng.random(pairs) < share) for share in shares]


def test_intervals_hold_known_midpoints_at_about_95_percent():
    """Synthetic histories, a known midpoint each, binomial noise on 78 pairs (a TatBLiMP phenomenon)."""
    rng = np.random.default_rng(7)
    inside = acquired = 0
    errors = []
    for _ in range(40):
        midpoint = float(rng.uniform(80, 600))
        fit = fit_acquisition(STEPS, noisy_history(rng, midpoint, float(rng.uniform(0.8, 0.97)), float(rng.uniform(2, 5))))
        acquired += fit.acquired
        if fit.acquired:
            inside += fit.interval[0] <= midpoint <= fit.interval[1]
            errors.append(abs(math.log(fit.step / midpoint)))
    assert acquired == 40
    assert 0.85 <= inside / acquired <= 1.0  # the benchmark: 0.95 over 200 histories
    assert np.median(errors) < 0.25  # the fitted step itself within about 25% of the truth


def test_statuses_where_the_fit_does_not_hold_and_the_seed():
    rng = np.random.default_rng(1)
    assert fit_acquisition(STEPS[:3], ["1" * 10] * 3).status == NOT_ENOUGH
    flat = [encode_outcomes(bool(v) for v in rng.random(78) < 0.5) for _ in STEPS]
    assert fit_acquisition(STEPS, flat).status == NOT_ACQUIRED
    late = noisy_history(rng, midpoint=20000, plateau=0.95, slope=4)  # still at chance at step 2000
    assert fit_acquisition(STEPS, late).status == NOT_ACQUIRED
    history = noisy_history(rng, midpoint=150, plateau=0.9, slope=4)
    once, again, other = (fit_acquisition(STEPS, history, seed=seed) for seed in (0, 0, 1))
    assert once == again and once.interval != other.interval and once.step == other.step
    assert AcquisitionFit("acquired", 150.4, (120.0, 190.2)).describe() == "150 [120, 190]"
    with pytest.raises(ValueError, match="same pairs"):
        fit_acquisition(STEPS[:4], ["1", "1", "11", "1"])


def test_acquisition_fits_of_records_per_phenomenon():
    rng = np.random.default_rng(2)
    early, never = noisy_history(rng, 60, 0.95, 4, pairs=60), noisy_history(rng, 10**6, 0.9, 4, pairs=60)
    records = []
    for step, a, b in zip(STEPS, early, never):
        text = a + b
        records.append(
            {
                "step": step,
                "acc": text.count("1") / 120,
                "acc_norm": text.count("1") / 120,
                "outcomes": {"acc": text, "acc_norm": text, "phenomenon_runs": [["early", 60], ["never", 60]]},
            }
        )
    fits = acquisition_fits(evaluations_from_records(records[::-1]))  # any order: sorted by step
    assert list(fits) == ["early", "never"] and fits["never"].status == NOT_ACQUIRED
    assert fits["early"].acquired and fits["early"].interval[0] <= 60 <= fits["early"].interval[1]


def test_kendalls_tau_is_scipys_over_the_phenomena_both_acquired():
    a = {"p": 100.0, "q": 300.0, "r": 200.0, "s": 50.0, "t": None}
    b = {"p": 120.0, "q": 250.0, "r": 400.0, "s": 60.0, "t": 10.0}

    def fits(steps):
        return {
            name: AcquisitionFit("acquired", step, (step, step)) if step is not None else AcquisitionFit(NOT_ACQUIRED)
            for name, step in steps.items()
        }

    order = learning_order(fits(a), fits(b))
    expected = kendalltau([100, 300, 200, 50], [120, 250, 400, 60])
    assert order.phenomena == ("p", "q", "r", "s")
    assert (order.tau, order.p_value) == pytest.approx((expected.statistic, expected.pvalue))
    assert order.order_a == ("s", "p", "r", "q") and order.order_b == ("t", "s", "p", "q", "r")
    assert math.isnan(learning_order(fits({"p": 1.0}), fits({"p": 2.0})).tau)


def test_trends_from_the_latest_evaluation_against_an_earlier_one():
    phenomena = ("up",) * 40 + ("down",) * 40 + ("same",) * 40

    def at(up: int, down: int) -> Outcomes:
        text = "1" * up + "0" * (40 - up) + "1" * down + "0" * (40 - down) + "10" * 20
        return Outcomes(text, text, phenomena)

    evaluations = [(0, at(0, 40)), (100, at(10, 40)), (200, at(20, 38)), (300, at(25, 35)), (400, at(30, 30))]
    found = trends(evaluations)  # step 400 against step 100 (three evaluations back)
    assert {name: t.direction for name, t in found.items()} == {"up": "rising", "down": "falling", "same": "flat"}
    assert found["up"].from_step == 100 and found["up"].difference == pytest.approx(0.5)
    ps = [binomtest(0, 20, 0.5).pvalue, binomtest(0, 10, 0.5).pvalue, 1.0]
    assert [t.q_value for t in found.values()] == pytest.approx(list(false_discovery_control(ps, method="bh")))
    assert trends(evaluations[:1]) == {}


def test_the_end_of_training_line_and_table_columns():
    from tatblimp_callback.results.learning import LearningSummary
    from tatblimp_callback.training.reporting import learning_columns, learning_line

    phenomena = ("up",) * 40 + ("same",) * 40
    evaluations = [(s, Outcomes(t, t, phenomena)) for s, t in ((0, "0" * 40 + "10" * 20), (100, "1" * 40 + "10" * 20))]
    summary = LearningSummary(trends=trends(evaluations), fits={"up": AcquisitionFit("not enough evaluations")})
    assert learning_line(summary) == "tatblimp: trend from step 0 to 100: rising 1 (up); flat 1; falling 0"
    columns, rows = learning_columns(["phenomenon", "n"], [["up", 40], ["same", 40], ["overall", 80]], {"up": None}, summary)
    assert columns[-3:] == ["acquired (threshold)", "acquired (fit) [95%]", "trend"]
    assert rows == [
        ["up", 40, "never", "not enough evaluations", "rising (+1.000 since step 0)"],
        ["same", 40, "-", "-", "flat (+0.000 since step 0)"],
        ["overall", 80, "-", "-", "-"],
    ]
