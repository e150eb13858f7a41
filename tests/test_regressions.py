"""Regression alerts from per-pair outcomes (results/regressions.py): when they fire, once, and how rarely by chance."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest, false_discovery_control

from tatblimp_callback.results.regressions import RegressionAlert, RegressionMonitor, recorded_alerts, replay_alerts
from tatblimp_callback.results.stats import Outcomes, encode_outcomes

PHENOMENA = ("a",) * 40 + ("b",) * 40


def outcomes(a_passed: int, b_passed: int = 30) -> Outcomes:
    """Phenomenon a passes its first ``a_passed`` pairs, b its first ``b_passed``."""
    text = "1" * a_passed + "0" * (40 - a_passed) + "1" * b_passed + "0" * (40 - b_passed)
    return Outcomes(text, text, PHENOMENA)


def test_a_fall_alerts_once_with_its_steps_scores_and_q_until_it_recovers():
    monitor = RegressionMonitor()
    assert monitor.observe(0, {"tatblimp": outcomes(30)}) == []
    assert monitor.observe(100, {"tatblimp": outcomes(38)}) == []  # rising: nothing
    alerts = monitor.observe(200, {"tatblimp": outcomes(20)})
    assert [alert.key for alert in alerts] == ["tatblimp/overall", "tatblimp/a"]
    a = alerts[1]
    assert (a.step, a.best_step, a.score, a.best_score, a.n) == (200, 100, 0.5, 0.95, 40)
    # 18 pairs only the best passes, none only the latest; two earlier evaluations (x2), BH over overall, a and b.
    p = binomtest(0, 18, 0.5).pvalue
    assert a.p_value == pytest.approx(p)
    overall_p = binomtest(0, 18, 0.5).pvalue  # overall: the same 18 discordant pairs of 80
    expected = false_discovery_control([min(1, 2 * overall_p), min(1, 2 * p), 1.0], method="bh")
    assert [alerts[0].q_value, a.q_value] == pytest.approx(list(expected[:2]))
    assert "a acc_norm fell from 0.9500 at step 100 to 0.5000 at step 200" in a.text
    assert monitor.observe(300, {"tatblimp": outcomes(21)}) == []  # still fallen: not again
    assert monitor.observe(400, {"tatblimp": outcomes(38)}) == []  # recovered (within 2.5 points of its best)
    again = monitor.observe(500, {"tatblimp": outcomes(19)})
    assert [(alert.key, alert.best_step) for alert in again] == [("tatblimp/overall", 100), ("tatblimp/a", 100)]


def test_a_significant_fall_smaller_than_the_minimum_does_not_alert():
    many = ("big",) * 4000
    before = "1" * 3000 + "0" * 1000
    after = "1" * 2840 + "0" * 1160  # 4 points down: p ~ 1e-48
    for min_drop, expected in ((0.05, []), (0.03, ["t/overall", "t/big"])):
        monitor = RegressionMonitor(min_drop=min_drop)
        monitor.observe(0, {"t": Outcomes(before, before, many)})
        assert [alert.key for alert in monitor.observe(1, {"t": Outcomes(after, after, many)})] == expected


def test_a_large_fall_on_few_pairs_is_not_significant():
    few = ("small",) * 8
    monitor = RegressionMonitor()
    monitor.observe(0, {"t": Outcomes("11111111", "11111111", few)})
    assert monitor.observe(1, {"t": Outcomes("11111100", "11111100", few)}) == []  # 25 points, 2 pairs: p = 0.5


def test_other_pairs_or_a_new_suite_start_afresh_and_bad_options_are_refused():
    monitor = RegressionMonitor()
    monitor.observe(0, {"t": outcomes(38)})
    shorter = Outcomes("0" * 40, "0" * 40, ("a",) * 40)
    assert monitor.observe(1, {"t": shorter, "suite": outcomes(38)}) == []
    with pytest.raises(ValueError, match="q threshold"):
        RegressionMonitor(alpha=0)
    with pytest.raises(ValueError, match="minimum drop"):
        RegressionMonitor(min_drop=1.5)


def test_random_fluctuation_alerts_at_most_alert_q_of_the_evaluations():
    """The null: every pair's outcome drawn afresh at every evaluation around its own fixed pass probability. The
    correction for choosing the best of k earlier evaluations and BH keep an evaluation's chance of any alert under
    q (0.05); measured here on 30 runs of 20 evaluations of TatBLiMP's size (the benchmark: about 0.01)."""
    rng = np.random.default_rng(0)
    phenomena = tuple(f"p{i // 78}" for i in range(1248))
    alarmed = evaluations = 0
    for _ in range(30):
        p = rng.beta(7, 3, 1248)
        monitor = RegressionMonitor()
        for step in range(20):
            text = encode_outcomes(bool(v) for v in rng.random(1248) < p)
            alarmed += bool(monitor.observe(step, {"tatblimp": Outcomes(text, text, phenomena)}))
            evaluations += step > 0
    assert alarmed / evaluations < 0.03


def test_replay_over_records_and_recorded_alerts_round_trip():
    def record(step, a):
        o = outcomes(a)
        return {
            "step": step,
            "acc": 0,
            "acc_norm": 0,
            "outcomes": {"acc": o.acc, "acc_norm": o.acc_norm, "phenomenon_runs": [["a", 40], ["b", 40]]},
        }

    records = [record(0, 38), record(1, 10)]
    for r in records:
        r["acc"] = r["acc_norm"] = r["outcomes"]["acc"].count("1") / 80
    alerts = replay_alerts(records)
    assert [(a.key, a.step) for a in alerts] == [("tatblimp/overall", 1), ("tatblimp/a", 1)]
    assert recorded_alerts(records) is None
    records[1]["alerts"] = [alert.to_dict() for alert in alerts]
    assert recorded_alerts(records) == alerts
    with pytest.raises(ValueError, match="malformed alert"):
        RegressionAlert.from_dict({"step": 1})
