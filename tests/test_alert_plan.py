"""Spending the run's false-alarm budget over its planned evaluations (alert_budget.Spending, ``alert_plan`` in the
history file's records, the callbacks' count of their evaluations): the arithmetic, a resume whose plan changes, a
late fall found with the plan that the unknown-length spending misses, and a calm planned run never alerted."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tatblimp_callback.results import alert_budget
from tatblimp_callback.results.alert_budget import Spending, look_share, planned_share
from tatblimp_callback.results.regressions import RegressionMonitor, record_plan, replay_alerts
from tatblimp_callback.results.stats import Outcomes
from tatblimp_callback.training import callback_options
from tatblimp_callback.training.alerts import RegressionAlerts


def test_a_plan_spreads_nine_tenths_evenly_and_keeps_a_tenth_for_comparisons_beyond_it():
    spending = Spending()
    planned = [spending.share(499) for _ in range(499)]  # a run of 500 evaluations: 499 comparisons
    assert planned == pytest.approx([0.9 / 499] * 499, rel=1e-12) and spending.total == pytest.approx(0.9)
    beyond = [spending.share(499) for _ in range(10_000)]  # run on past its plan
    assert beyond[:2] == pytest.approx([0.1 * look_share(1), 0.1 * look_share(2)])
    assert 0.9 + 0.1 * 0.6 < spending.total <= 1.0  # look_share(1..10000) adds up to about 0.75
    # The benchmark's arithmetic for a plan never changed is the same, share for share.
    assert planned_share(np.arange(1, 10_500), 499).tolist() == pytest.approx(planned + beyond, rel=1e-12)
    # Without a plan: the unknown-length spending, look_share(j) at the j-th comparison.
    unknown = Spending()
    assert [unknown.share(None) for _ in range(300)] == pytest.approx(look_share(np.arange(1, 301)).tolist(), rel=1e-12)
    # A plan seen late (a run resumed by a version that plans): the pool left after the unplanned spending.
    spent = float(np.sum(look_share(np.arange(1, 301))))
    assert unknown.share(400) == pytest.approx((0.9 - spent) / 100)
    with pytest.raises(ValueError, match=r"reserve kept beyond a plan must be between 0 and 1, got 1\.0"):
        Spending(1.0)


def test_a_plan_that_changes_spreads_what_is_left_so_the_run_never_spends_more_than_its_budget():
    """A run planned for 101 evaluations (100 comparisons) resumed after 60 with a plan of 501: the 59 comparisons
    spent 59 x 0.9 / 100 = 0.531, the 441 still planned share the 0.369 left (8.37e-4 each), and the run ends with
    0.9 of alert_q spent plus its reserve. Taking the new plan as if nothing had been spent would spend
    0.531 + 441 x 0.9 / 500 = 1.325 of alert_q; a plan that shrinks below the comparisons made sends the rest to the
    reserve."""
    spending = Spending()
    for _ in range(59):
        spending.share(100)
    assert spending.total == pytest.approx(0.531)
    assert spending.share(500) == pytest.approx(0.369 / 441)
    for _ in range(440):
        spending.share(500)
    assert spending.total == pytest.approx(0.9)
    for _ in range(5000):
        spending.share(500)
    assert spending.total <= 1.0
    shrunk = Spending()
    for _ in range(80):
        shrunk.share(100)
    assert shrunk.share(50) == pytest.approx(0.1 * look_share(1)) and shrunk.total == pytest.approx(0.72 + 0.1 * look_share(1))


def _calm(step: int, rng) -> dict:
    text = "".join("1" if v else "0" for v in rng.random(80) < 0.8)
    outcomes = {"acc": text, "acc_norm": text, "phenomenon_runs": [["a", 40], ["b", 40]]}
    return {"step": step, "acc": text.count("1") / 80, "acc_norm": text.count("1") / 80, "outcomes": outcomes}


def test_a_resumed_run_with_a_larger_plan_accounts_what_it_spent_and_a_replay_of_its_file_agrees(tmp_path):
    """The history file's lines carry each evaluation's plan: restored, the monitor has spent what the run spent
    (0.531 after 60 evaluations planned as 101), goes on under the new plan (501), and writes it; a fall then alerts
    with the q of that share, as the replay of the whole file does. A resumed run without its history file does not
    know what was spent: it spends only the reserve."""
    rng = np.random.default_rng(0)
    records = [{**_calm(10 * e, rng), "alert_plan": 101} for e in range(60)]
    path = tmp_path / "tatblimp_history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    logged = [{"step": r["step"], "tatblimp/acc": r["acc"]} for r in records]
    resumed = RegressionAlerts(True, 0.05, 0.05, "tatblimp", restored=logged)
    resumed.restore(path)
    assert resumed.monitor.evaluations == 60 and resumed.monitor.spending.total == pytest.approx(0.531)
    resumed.plan = 501
    assert resumed.fields(600) == {"alerts": [], "alert_plan": 501}
    fall = "1" * 8 + "0" * 32 + "1" * 32 + "0" * 8  # a: 8 of 40 pass (0.2), b: 32 (0.8)
    fallen = {
        "step": 600,
        "acc": 0.5,
        "acc_norm": 0.5,
        "outcomes": {"acc": fall, "acc_norm": fall, "phenomenon_runs": [["a", 40], ["b", 40]]},
    }
    alerts = resumed.monitor.observe(600, {"tatblimp": Outcomes.from_record(fallen)}, resumed.plan)
    assert "a" in [a.group for a in alerts] and resumed.monitor.spending.total == pytest.approx(0.531 + 0.369 / 441)
    replayed = replay_alerts([*records, {**fallen, "alert_plan": 501}])
    assert replayed == alerts
    assert record_plan(records[0]) == 101 and record_plan(fallen) is None
    # The same records without their plans: the spending of a run of unknown length, look_share(60) at the 61st.
    (a,) = [x for x in alerts if x.group == "a"]
    without = [{k: v for k, v in r.items() if k != "alert_plan"} for r in records]
    (unplanned,) = [x for x in replay_alerts([*without, fallen]) if x.group == "a"]
    assert unplanned.p_value == a.p_value
    assert unplanned.q_value == pytest.approx(a.q_value * (0.369 / 441) / look_share(60))
    # Or told the plan: every record taken as planned for 501 evaluations from the start.
    (told,) = [x for x in replay_alerts([*without, fallen], evaluations=501) if x.group == "a"]
    assert told.q_value == pytest.approx(a.q_value * (0.369 / 441) / (0.9 / 500))
    # No history file: 60 evaluations of which the spending is unknown; the 61st spends the reserve only.
    blind = RegressionAlerts(True, 0.05, 0.05, "tatblimp", restored=logged)
    blind.plan = 501
    blind.monitor.observe(600, {"tatblimp": Outcomes.from_record(fallen)}, blind.plan)
    assert blind.monitor.spending.unplanned == 60  # the reserve's look_share(60)
    with pytest.raises(ValueError, match="the record of step 0: alert_plan must be a whole number of at least 1, got 0"):
        replay_alerts([{**records[0], "alert_plan": 0}])


@pytest.mark.parametrize("start", [True, False])
@pytest.mark.parametrize("end", [True, False])
def test_the_planned_evaluations_are_the_steps_the_schedule_scores(start, end):
    """Counted against the steps themselves: step 0, every multiple of ``every`` and of the Trainer's own
    evaluation interval, the last step, each step once."""
    for max_steps in (1, 5, 12, 40, 97):
        for every in (1, 2, 4, 7):
            for also in (None, 3, 4, 10):
                steps = {0} if start else set()
                steps |= {s for s in range(1, max_steps + 1) if s % every == 0 or (also and s % also == 0)}
                steps |= {max_steps} if end else set()
                assert callback_options.planned_evaluations(max_steps, every, start, end, also) == len(steps)
    for unknown in (-1, 0, math.inf, None, float("nan")):
        assert callback_options.planned_evaluations(unknown, 2, True, True) is None


def test_the_callbacks_plan_from_max_steps_and_the_trainers_evaluations_or_as_told():
    from transformers import TrainingArguments

    from tatblimp_callback import TatBLiMPCallback

    callback = TatBLiMPCallback(eval_steps=2)
    # As test_callback_reporters' run: ours at 0, 2, 4 and the end (5), the Trainer's at 3: five evaluations.
    args = TrainingArguments(output_dir="unused", max_steps=5, eval_strategy="steps", eval_steps=3, report_to="none")
    assert callback._planned_evaluations(args, 5) == 5
    assert TatBLiMPCallback(eval_steps=2, eval_on_evaluate=False)._planned_evaluations(args, 5) == 4
    for bad in (1, 0, 2.5, True, "500"):
        with pytest.raises(ValueError, match="alert_evaluations must be the run's planned number of evaluations"):
            TatBLiMPCallback(alert_evaluations=bad)
    assert alert_budget.PLAN_RESERVE == 0.1


@pytest.mark.slow
def test_a_calm_history_of_500_planned_evaluations_is_never_alerted():
    """500 evaluations of a run that only fluctuates on a TatBLiMP-like benchmark (every pair drawn again each
    time), each record naming its plan of 500: no alert, pooled or per run."""
    from test_regressions import _tatblimp_like_history

    records = [{**r, "alert_plan": 500} for r in _tatblimp_like_history(np.random.default_rng(7), 500)]
    assert replay_alerts(records) == []
    assert replay_alerts(records, mode="per_run") == []


def test_an_unplanned_evaluation_after_the_first_is_counted_so_replay_and_callback_spend_alike():
    monitor = RegressionMonitor()
    monitor.observe(0, {}, 10)  # the first evaluation: nothing to compare, nothing spent
    assert monitor.spending.comparisons == 0
    monitor.observe(1, {}, 10)  # unreadable, but the run's second evaluation: its share is spent
    assert monitor.spending.comparisons == 1 and monitor.spending.total == pytest.approx(0.1)


@pytest.mark.slow
def test_a_late_fall_from_090_to_070_is_alerted_within_two_evaluations_with_15_times_the_margin_with_the_plan():
    """A TatBLiMP-like history of 484 evaluations (every pair drawn again each time), the 80 pairs falling
    0.90 -> 0.70 at the 481st (step 4800): the pooled mode alerts the phenomenon at step 4810, on the last 2
    evaluations against the 2 that end 2 before them (from step 4740), and nothing else, planned for its 484
    evaluations or not; the plan's q is smaller by the ratio of the shares, 0.9 / 483 against look_share(481)
    (15 times). The benchmark: 92.6% against 76.7% of such runs alerted within 2 evaluations at the 500th."""
    from test_regressions import _tatblimp_like_history

    records = _tatblimp_like_history(np.random.default_rng(10), 484, fall_at=480)
    planned = replay_alerts([{**r, "alert_plan": 484} for r in records])
    assert [(a.step, a.group, a.reference, a.best_step) for a in planned] == [(4810, "falls", "last 2", 4740)]
    assert planned[0].q_value <= 0.05 and replay_alerts(records, evaluations=484) == planned
    unplanned = replay_alerts(records)
    assert [(a.step, a.group, a.reference, a.p_value) for a in unplanned] == [
        (a.step, a.group, a.reference, a.p_value) for a in planned
    ]
    ratio = (0.9 / 483) / alert_budget.look_share(481)  # the 481st comparison
    assert ratio == pytest.approx(14.9, abs=0.05)
    assert unplanned[0].q_value == pytest.approx(planned[0].q_value * ratio)
