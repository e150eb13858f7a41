"""Regression alerts from per-pair outcomes (results/regressions.py): when they fire, once, and how rarely by chance."""

from __future__ import annotations

import math

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


def test_per_evaluation_a_fall_alerts_once_with_its_steps_scores_and_q_until_it_recovers():
    monitor = RegressionMonitor(mode="per_evaluation")
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
        monitor = RegressionMonitor(min_drop=min_drop, mode="per_evaluation")
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
    with pytest.raises(ValueError, match="alert mode must be one of 'pooled', 'per_run', 'per_evaluation'"):
        RegressionMonitor(mode="per-run")


def test_per_evaluation_random_fluctuation_alerts_at_most_alert_q_of_the_evaluations():
    """The null: every pair's outcome drawn afresh at every evaluation around its own fixed pass probability. The
    correction for choosing the best of k earlier evaluations and BH keep an evaluation's chance of any alert under
    q (0.05); measured here on 30 runs of 20 evaluations of TatBLiMP's size (the benchmark: about 0.01)."""
    rng = np.random.default_rng(0)
    phenomena = tuple(f"p{i // 78}" for i in range(1248))
    alarmed = evaluations = 0
    for _ in range(30):
        p = rng.beta(7, 3, 1248)
        monitor = RegressionMonitor(mode="per_evaluation")
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
    assert [(a.key, a.step, a.mode) for a in alerts] == [("tatblimp/overall", 1, "pooled"), ("tatblimp/a", 1, "pooled")]
    assert recorded_alerts(records) is None
    records[1]["alerts"] = [alert.to_dict() for alert in alerts]
    assert recorded_alerts(records) == alerts
    with pytest.raises(ValueError, match="malformed alert"):
        RegressionAlert.from_dict({"step": 1})
    older = {k: v for k, v in alerts[0].to_dict().items() if k not in ("mode", "reference")}  # written before the mode
    assert RegressionAlert.from_dict(older).mode == "per_evaluation"


def test_per_run_a_fall_alerts_with_the_run_wide_q_computed_by_hand():
    """The q of the per-run mode, from scipy and the formula of the share, not from the module: the one-sided exact
    binomial of 18 pairs only the reference passes, the better of the previous (x2) and best (x2 earlier x2)
    references, Holm over the three groups, divided by the share of the 2nd comparison."""
    monitor = RegressionMonitor(mode="per_run")
    monitor.observe(0, {"tatblimp": outcomes(30)})
    monitor.observe(100, {"tatblimp": outcomes(38)})
    alerts = monitor.observe(200, {"tatblimp": outcomes(20)})
    assert [(a.key, a.reference, a.best_step, a.mode) for a in alerts] == [
        ("tatblimp/overall", "previous", 100, "per_run"),
        ("tatblimp/a", "previous", 100, "per_run"),
    ]
    p = binomtest(18, 18, 0.5, alternative="greater").pvalue
    group_p = min(p / 0.5, p * 2 / 0.5)  # previous; best (chosen among 2 earlier evaluations)
    holm = max(3 * group_p, 2 * group_p)  # overall and a tie; b did not fall (p = 1)
    share = 1 / (0.42515696619253746 * 12 * math.log(12) ** 2)
    assert alerts[1].p_value == pytest.approx(p) and alerts[1].q_value == pytest.approx(holm / share)
    assert alerts[0].q_value == pytest.approx(holm / share) and alerts[1].q_value < 0.05
    assert "(the previous evaluation)" in alerts[1].text and "within the run's false-alarm budget" in alerts[1].text
    assert monitor.observe(300, {"tatblimp": outcomes(21)}) == []  # still fallen: not again
    assert monitor.observe(400, {"tatblimp": outcomes(38)}) == []  # recovered
    assert [a.key for a in monitor.observe(500, {"tatblimp": outcomes(19)})] == ["tatblimp/overall", "tatblimp/a"]


def test_the_same_fall_later_in_the_run_needs_more_evidence_and_the_count_goes_on_across_benchmarks():
    """The 30th comparison spends less than the 1st: a fall of 13 of 40 pairs alerts early, not late; a suite that
    comes in later is counted in the same sequence (the budget is the run's)."""
    early, late = RegressionMonitor(), RegressionMonitor()
    early.observe(0, {"t": outcomes(38)})
    for step in range(30):
        late.observe(step, {"t": outcomes(38), **({"suite": outcomes(38)} if step % 2 else {})})
    assert late.evaluations == 30
    assert [a.group for a in early.observe(1, {"t": outcomes(25)})] == ["overall", "a"]
    assert late.observe(30, {"t": outcomes(25)}) == []
    assert [a.group for a in late.observe(31, {"t": outcomes(5)})] == ["overall", "a"]  # 33 pairs: enough even there


def _nan_part(passed: int | None) -> str:
    return "-" * 40 if passed is None else "1" * passed + "0" * (40 - passed)


@pytest.mark.parametrize("mode", ["pooled", "per_run", "per_evaluation"])
def test_an_evaluation_without_finite_pairs_is_no_recovery_so_one_fall_alerts_once(mode):
    """#39: a falls 0.95 -> 0.50 at step 200, is all NaN at 300, still 0.50 at 400: one alert for a, one for
    overall (compared at 300 on b's pairs only, which is no recovery either)."""
    monitor = RegressionMonitor(mode=mode)
    seen = []
    for step, a in ((0, 38), (100, 38), (200, 20), (300, None), (400, 20), (500, 20)):
        text = _nan_part(a) + "1" * 30 + "0" * 10
        seen += [(alert.step, alert.group) for alert in monitor.observe(step, {"t": Outcomes(text, text, PHENOMENA)})]
    assert seen == [(200, "overall"), (200, "a")]


@pytest.mark.parametrize("mode", ["pooled", "per_run", "per_evaluation"])
def test_a_best_on_a_few_finite_pairs_does_not_hide_a_later_fall(mode):
    """#39's suspicion, real: a at 36/40, then 2 finite pairs passing (1.0), then 20/40: compared with those 2 pairs
    the fall was never significant; now the few-pair score does not become the best, and the fall alerts."""
    monitor = RegressionMonitor(mode=mode)
    few = "11" + "-" * 38 + "1" * 30 + "0" * 10
    monitor.observe(0, {"t": Outcomes(*[_nan_part(36) + "1" * 30 + "0" * 10] * 2, PHENOMENA)})
    monitor.observe(100, {"t": Outcomes(few, few, PHENOMENA)})
    fallen = _nan_part(20) + "1" * 30 + "0" * 10
    alerts = monitor.observe(200, {"t": Outcomes(fallen, fallen, PHENOMENA)})
    assert [(a.group, a.best_step, a.n) for a in alerts if a.group == "a"] == [("a", 0, 40)]


def test_replay_keeps_a_step_scored_twice_once():
    """#39's suspicion, real: a sweep step scored twice was replayed as two evaluations (one more earlier evaluation
    in the correction, and one more comparison of the run); now the last record of a step counts, as in
    evaluations_from_records."""

    def record(step, a):
        o = outcomes(a)
        runs = [["a", 40], ["b", 40]]
        share = o.acc.count("1") / 80
        return {
            "step": step,
            "acc": share,
            "acc_norm": share,
            "outcomes": {"acc": o.acc, "acc_norm": o.acc_norm, "phenomenon_runs": runs},
        }

    for mode in ("pooled", "per_run", "per_evaluation"):
        once = replay_alerts([record(0, 38), record(1, 38), record(2, 25)], mode=mode)
        twice = replay_alerts([record(0, 38), record(1, 36), record(1, 38), record(2, 25)], mode=mode)
        assert once and twice == once
    # per_evaluation by hand: 13 pairs only the best passes; 2 earlier evaluations; BH over overall, a, b
    (_, a) = once
    p = binomtest(0, 13, 0.5).pvalue
    assert a.q_value == pytest.approx(false_discovery_control([2 * p, 2 * p, 1.0], method="bh")[1])


def _rotating(step: int) -> Outcomes:
    """a's first 30 pairs pass at steps 0, 1, 2; from step 3 on, a different ten of them fail at each evaluation
    (0-9, then 10-19, then 20-29): each evaluation alone loses 10 of 30 against the one before, and regains the 10
    the one before lost; b stays at 30 of 40."""
    a = ["1"] * 30 + ["0"] * 10
    if step >= 3:
        start = 10 * ((step - 3) % 3)
        a[start : start + 10] = ["0"] * 10
    text = "".join(a) + "1" * 30 + "0" * 10
    return Outcomes(text, text, PHENOMENA)


def test_pooled_a_fall_spread_over_evaluations_alerts_on_two_pooled_evaluations_with_q_by_hand():
    """At step 4 the last 2 evaluations (3, 4) against the 2 before (1, 2): each of a's pairs 0-19 passes 2 of 2
    before and 1 of 2 after (d = 1), the others the same, so S = 20 with 20 pairs that differ: p = 2^-20 (the exact
    sign-flip test, here the sign test), weighted 0.025 / 0.275 (the tests that fit in 5 evaluations share the
    whole: the last evaluation against each of the 4 before, 0.05 each, this window, 0.025, and the best, 0.05),
    Holm over overall (the same 20 pairs), a and b, divided by the share of the 4th comparison. Against the previous
    evaluation it lost 10 and regained 10, against the best 10 of 40: the per-run mode never alerts."""
    pooled, per_run = RegressionMonitor(), RegressionMonitor(mode="per_run")
    seen = {"pooled": [], "per_run": []}
    for step in range(8):
        for name, monitor in (("pooled", pooled), ("per_run", per_run)):
            seen[name] += monitor.observe(step, {"t": _rotating(step)})
    assert seen["per_run"] == []
    assert [(a.step, a.key, a.reference, a.best_step, a.n) for a in seen["pooled"]] == [
        (4, "t/overall", "last 2", 1, 80),
        (4, "t/a", "last 2", 1, 40),
    ]  # once: a stays down
    a = seen["pooled"][1]
    p = binomtest(20, 20, 0.5, alternative="greater").pvalue
    share = 1 / (0.42515696619253746 * 14 * math.log(14) ** 2)
    assert a.p_value == pytest.approx(p) and a.q_value == pytest.approx(3 * (p / (0.025 / 0.275)) / share)
    assert (a.best_score, a.score) == (0.75, 0.5)  # pooled over steps 1-2 and 3-4 on a's 40 pairs
    assert "fell from 0.7500 over the 2 evaluations from step 1 to 0.5000 over the 2 up to step 4" in a.text
    assert "exact sign-flip test on 40 pairs" in a.text


def _tatblimp_like_history(rng, evaluations: int, fall_at: int | None = None, to: float = 0.7) -> list[dict]:
    """Records of a run on a TatBLiMP-like benchmark (15 phenomena of 78 pairs and one of 80, pass chances around
    0.7, the 80 pairs' around 0.9), every pair drawn again at each evaluation; from ``fall_at`` on, the 80 pairs'
    chances are scaled by to / 0.9 (0.90 -> 0.70 on average)."""
    names = [f"p{i}" for i in range(15) for _ in range(78)] + ["falls"] * 80
    runs = [[f"p{i}", 78] for i in range(15)] + [["falls", 80]]
    chance = np.concatenate([rng.beta(7, 3, 15 * 78), rng.beta(9, 1, 80)])
    records = []
    for e in range(evaluations):
        p = chance.copy()
        if fall_at is not None and e >= fall_at:
            p[-80:] *= to / 0.9
        text = encode_outcomes(bool(v) for v in rng.random(len(names)) < p)
        share = text.count("1") / len(names)
        outcomes = {"acc": text, "acc_norm": text, "phenomenon_runs": runs}
        records.append({"step": 10 * e, "acc": share, "acc_norm": share, "outcomes": outcomes})
    return records


@pytest.mark.slow
def test_a_replayed_fall_from_090_to_070_is_alerted_within_two_evaluations_pooled_and_rarely_per_run():
    """Twenty replayed histories of 24 evaluations, the 80 pairs falling 0.90 -> 0.70 at the 21st (step 200): the
    pooled mode alerts the phenomenon at step 200, 210 or 220 in all 20 (the benchmark, without a plan: 95.2% at the
    20th evaluation), never before; the per-run mode in 9 of 20 (benchmark: 37.2%)."""
    rng = np.random.default_rng(5)
    within = {"pooled": 0, "per_run": 0}
    for _ in range(20):
        records = _tatblimp_like_history(rng, 24, fall_at=20)
        for mode in within:
            steps = [a.step for a in replay_alerts(records, mode=mode) if a.group == "falls"]
            assert all(step >= 200 for step in steps)
            within[mode] += bool(steps) and steps[0] <= 220
    assert within == {"pooled": 20, "per_run": 9}


@pytest.mark.slow
def test_a_calm_replayed_history_of_1000_evaluations_is_never_alerted_pooled():
    """1,000 evaluations of a run that only fluctuates (every pair drawn again each time): no alert in the pooled
    mode, none per run; the per-evaluation rule alerts at 4 of the evaluations."""
    records = _tatblimp_like_history(np.random.default_rng(6), 1000)
    assert replay_alerts(records) == []
    assert replay_alerts(records, mode="per_run") == []
    assert len({alert.step for alert in replay_alerts(records, mode="per_evaluation")}) == 4
