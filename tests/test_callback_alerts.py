"""Regression alerts in a real Trainer run with offline wandb (read back with ``wandb leet inspect --json``).

A tiny Llama learns three made-up phenomena of a benchmark written here: after "a<i> b<j>" comes "z" (not "w"),
after "c<i> b<j>" "x" (not "y"), after "d<i> b<j>" "u" (not "v"). At step 24 a callback swaps the LM head's rows of
"z" and "w": every other token's log-prob stays exactly what it was (the same logits, permuted), but the first
phenomenon's good and bad sentences trade places, so it falls from its best to near zero at that step. Its
learning rate then drops to 1e-4, so the weights keep changing (every later evaluation is scored again) but the
fall stays. The same run without the swap is the control.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tatblimp_callback.results import alert_budget
from tatblimp_callback.results.learning import AcquisitionFit
from tatblimp_callback.results.regressions import RegressionAlert, recorded_alerts, replay_alerts
from trainer_utils import run_wandb_script, wandb_records

SCRIPT = r"""
import json, logging, sys
sys.path.insert(0, {tests!r})
import torch, wandb
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainerCallback, TrainingArguments
from tatblimp_callback import TatBLiMPCallback

PERTURB, OUT = {perturb!r}, {out!r}
groups = [("target", "a", 6, 4, "z", "w"), ("other", "c", 25, 10, "x", "y"), ("third", "d", 25, 10, "u", "v")]
pairs = [
    {{"good": f"{{w}}{{i}} b{{j}} {{g}}", "bad": f"{{w}}{{i}} b{{j}} {{b}}", "phenomenon": name}}
    for name, w, many, contexts, g, b in groups for i in range(many) for j in range(contexts)
]
with open(OUT + "/pairs.jsonl", "w") as handle:
    handle.writelines(json.dumps(pair) + "\n" for pair in pairs)
words = sorted({{word for pair in pairs for s in (pair["good"], pair["bad"]) for word in s.split()}})
vocab = {{token: index for index, token in enumerate(["<pad>", "<s>", "</s>", *words])}}
core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
ids = [[1, *tokenizer(pair["good"], add_special_tokens=False)["input_ids"], 2] for pair in pairs]
train = [{{"input_ids": s, "labels": s}} for s in ids * 8]

class Perturb(TrainerCallback):
    # At step 24: the rows of "z" and "w" swapped in the LM head; then a learning rate of 1e-4.
    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step >= 24:
            for group in optimizer.param_groups:
                group["lr"] = 1e-4
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if PERTURB and state.global_step == 24:
            z, w = vocab["z"], vocab["w"]
            with torch.no_grad():
                head = model.lm_head.weight
                head[[z, w]] = head[[w, z]].clone()

seen = []
class Seen(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("tatblimp_callback").addHandler(Seen(level=logging.WARNING))

args = TrainingArguments(output_dir=OUT, max_steps=40, per_device_train_batch_size=32, learning_rate=1e-2,
                         lr_scheduler_type="constant", logging_steps=4, report_to=["wandb"], save_strategy="no",
                         seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[Perturb()])
run = wandb.init(project="tatblimp-test")
sent = []
original = run.alert
def alert(*a, **k):
    sent.append(k)
    return original(*a, **k)
run.alert = alert
callback = TatBLiMPCallback.attach(trainer, data=OUT + "/pairs.jsonl", allow_modified=True, eval_steps=4)
trainer.train()
with open(OUT + "/seen.json", "w") as handle:
    json.dump({{"warnings": seen, "sent": sent, "learning": callback.learning.to_dict(),
               "log_history": [e for e in trainer.state.log_history if "tatblimp/acc" in e]}}, handle, default=str)
print("RUN_DIR=" + wandb.run.dir.rsplit("/files", 1)[0])
wandb.finish()
"""


def run(tmp_path: Path, perturb: bool) -> tuple[dict, list[dict], list[dict], str]:
    out = tmp_path / ("perturbed" if perturb else "control")
    out.mkdir()
    (run_dir,) = run_wandb_script(SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), perturb=perturb), tmp_path)
    seen = json.loads((out / "seen.json").read_text(encoding="utf-8"))
    history = [json.loads(line) for line in (out / "tatblimp_history.jsonl").read_text(encoding="utf-8").splitlines()]
    return seen, history, wandb_records(run_dir), run_dir


@pytest.mark.slow
def test_a_phenomenon_made_to_fall_at_step_24_alerts_there_once_and_the_control_never(tmp_path):
    seen, history, records, run_dir = run(tmp_path, perturb=True)
    steps = [r["step"] for r in history]
    assert steps == list(range(0, 41, 4))
    score = {r["step"]: r["phenomena"]["target"]["acc_norm"] for r in history}
    assert max(score[s] for s in steps if s < 24) >= 0.9 and score[24] <= 0.1  # learned, then made to fall
    # The history file: one alert, at step 24, for the phenomenon that fell (the overall fell by under 5 points).
    assert all("alerts" in r for r in history)
    alerts = [a for r in history for a in r["alerts"]]
    assert len(alerts) == 1 and [a["step"] for r in history for a in r["alerts"]] == [24]
    (alert,) = alerts
    # Every pair of the phenomenon passes at steps 4 to 20 and fails at 24, so the last evaluation against the
    # previous one and the last 3 against the 3 before them (steps 4-12 against 16-24) have the same p-value,
    # 2^-24, and the pooled window, with the larger weight (0.1625 against 0.05 of base weight), names the alert.
    assert all(score[s] == 1.0 for s in steps[1:6]) and score[24] == 0.0
    assert (alert["benchmark"], alert["group"], alert["reference"], alert["best_step"]) == ("tatblimp", "target", "last 3", 4)
    assert alert["best_score"] == 1.0 and alert["score"] == pytest.approx(2 / 3) and alert["p_value"] == pytest.approx(2.0**-24)
    assert alert["q_value"] < 1e-2, alert
    assert alert["mode"] == "pooled"  # the default: a false-alarm budget for the whole run
    # The report's replay of the history file gives the alerts the callback raised, to the last digit, under the
    # plan every record names: the run's 11 evaluations (0, 4, ..., 40), from max_steps and eval_steps.
    assert [r["alert_plan"] for r in history] == [11] * len(history) == [11] * 11
    assert replay_alerts(history) == recorded_alerts(history) == [RegressionAlert.from_dict(alert)]
    # Its q is that of the plan's share (0.9 / 10 of alert_q at each comparison), not the unknown-length one.
    unplanned = replay_alerts([{k: v for k, v in r.items() if k != "alert_plan"} for r in history])
    assert [a.p_value for a in unplanned] == [alert["p_value"]]
    assert unplanned[0].q_value == pytest.approx(alert["q_value"] * 0.09 / alert_budget.look_share(6))
    # The warning line names the phenomenon, both steps, both scores and q.
    (line,) = [w for w in seen["warnings"] if "REGRESSION" in w]
    for part in ("target", "from 1.0000 over the 3 evaluations from step 4", "to 0.6667 over the 3 up to step 24", "q = "):
        assert part in line
    # The count, logged from the first alert on (as failures): 1 from step 24.
    counts = {e["step"]: e["tatblimp/alerts"] for e in seen["log_history"] if "tatblimp/alerts" in e}
    assert counts == {s: 1.0 for s in steps if s >= 24}
    wandb_counts = {
        r["history"]["item"]["train/global_step"]: r["history"]["item"]["tatblimp/alerts"]
        for r in records
        if r["type"] == "history" and "tatblimp/alerts" in r["history"]["item"]
    }
    assert wandb_counts == counts
    # wandb.run.alert, recorded by offline wandb as an alert record: once, WARN, with the alert's text.
    sent = [r["alert"] for r in records if r["type"] == "alert"]
    assert len(sent) == 1 and sent[0]["level"] == "WARN" and sent[0]["title"] == "tatblimp: target fell"
    assert sent[0]["text"] == line.split("REGRESSION: ")[1]
    assert len(seen["sent"]) == 1  # the call itself, seen by wrapping the run's method
    # The end-of-training table has the fitted acquisition step and the trend.
    (table,) = [
        r["history"]["item"] for r in records if r["type"] == "history" and "tatblimp/results.path" in r["history"]["item"]
    ]
    logged = json.loads((Path(run_dir) / "files" / table["tatblimp/results.path"]).read_text(encoding="utf-8"))
    columns = logged["columns"]
    assert columns[-3:] == ["acquired (threshold)", "acquired (fit) [95%]", "trend"]
    rows = {row[0]: dict(zip(columns, row)) for row in logged["data"]}
    trends, fits = seen["learning"]["trends"], seen["learning"]["acquisition_fits"]
    assert rows["target"]["trend"] == "flat (+0.000 since step 28)"  # fallen at 24, and it stays there
    for name in ("target", "other", "third"):
        assert rows[name]["trend"].split()[0] == trends[name]["direction"]
        fit = AcquisitionFit(**{**fits[name], "interval": tuple(fits[name]["interval"] or ()) or None})
        assert rows[name]["acquired (fit) [95%]"] == fit.describe()
    assert rows["overall"]["trend"] == "-"

    seen, history, records, _ = run(tmp_path, perturb=False)
    assert [a for r in history for a in r["alerts"]] == [] and not [r for r in records if r["type"] == "alert"]
    assert not [e for e in seen["log_history"] if "tatblimp/alerts" in e]
    assert min(r["phenomena"]["target"]["acc_norm"] for r in history[6:]) >= 0.9  # the same run, not made to fall


@pytest.mark.slow
def test_a_resumed_run_compares_with_the_evaluations_before_its_checkpoint(bpe_tokenizer, small_data, tmp_path):
    """The kept lines of the history file go through the monitor again: the trend at the end of the resumed run
    reaches back to step 0 (before the checkpoint), as in the run without a break."""
    from conftest import tiny_llama
    from tatblimp_callback import TatBLiMPCallback
    from trainer_utils import make_trainer

    options = dict(max_steps=6, save_strategy="steps", save_steps=3)
    whole = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=2)
    make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [whole], **options).train()
    resumed = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=2)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path / "run", [resumed], **options)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert [step for step, _ in resumed._monitor.alerts.evaluations] == [0, 2, 4, 6]
    # The per-run budget's sequence went on from the evaluations before the checkpoint (0 and 2), not from 0.
    assert resumed._monitor.alerts.monitor.evaluations == whole._monitor.alerts.monitor.evaluations == 4
    assert {t.from_step for t in resumed.learning.trends.values()} == {0}
    assert resumed.learning.trends == whole.learning.trends and resumed.learning.fits == whole.learning.fits


def _record(step: int, a_passed: int) -> dict:
    text = "1" * a_passed + "0" * (40 - a_passed) + "1" * 30 + "0" * 10
    share = text.count("1") / 80
    outcomes = {"acc": text, "acc_norm": text, "phenomenon_runs": [["a", 40], ["b", 40]]}
    return {"step": step, "acc": share, "acc_norm": share, "outcomes": outcomes}


def test_a_resumed_run_goes_on_with_its_sequence_and_an_unreadable_record_is_said_and_counted(tmp_path, caplog):
    """The per-run budget's count of evaluations continues on resume (from the history file, else from the restored
    log history), so the first alert after it has the q of the run without a break; an unreadable record is left out
    of the comparisons, named, and still counted (before, restore stopped there, half-filled, saying it started afresh)."""
    from tatblimp_callback.results.regressions import RegressionMonitor
    from tatblimp_callback.results.stats import Outcomes
    from tatblimp_callback.training.alerts import RegressionAlerts

    records = [_record(step, 38) for step in range(0, 100, 10)]
    lines = [json.dumps(r) for r in records]
    lines[4] = '{"step": 40, "acc": 0.85}'  # no outcomes
    path = tmp_path / "tatblimp_history.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    logged = [{"step": r["step"], "tatblimp/acc": r["acc"]} for r in records]
    resumed = RegressionAlerts(True, 0.05, 0.05, "tatblimp", restored=logged)
    assert resumed.monitor.evaluations == 10  # from the log history alone (another process, or no history file)
    with caplog.at_level("WARNING"):
        resumed.restore(path)
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert "1 record(s)" in warning and "record 5" in warning and "no per-pair outcomes" in warning
    assert resumed.monitor.evaluations == 10 and [s for s, _ in resumed.evaluations] == [0, 10, 20, 30, 50, 60, 70, 80, 90]
    from_the_file_alone = RegressionAlerts(True, 0.05, 0.05, "tatblimp")
    from_the_file_alone.restore(path)
    assert from_the_file_alone.monitor.evaluations == 10  # the unreadable record counted too
    # The run without a break (the unreadable evaluation seen as one that cannot be read).
    whole = RegressionMonitor()
    for r in records:
        whole.observe(r["step"], {"tatblimp": Outcomes.from_record(r)} if r["step"] != 40 else {})
    fallen = Outcomes.from_record(_record(100, 20))
    (expected_overall, expected) = whole.observe(100, {"tatblimp": fallen})
    got = resumed.monitor.observe(100, {"tatblimp": fallen})
    assert got == [expected_overall, expected] and expected.q_value < 0.05
    # A run whose comparisons restarted at the resume would spend the 1st comparison's share, not the 10th's.
    restarted = RegressionMonitor()
    restarted.observe(90, {"tatblimp": Outcomes.from_record(records[-1])})
    assert restarted.observe(100, {"tatblimp": fallen})[1].q_value < expected.q_value / 2


def _rotating_record(step: int) -> dict:
    """a's first 30 of 40 pairs pass up to step 2; from step 3 on a different ten of them fail at each evaluation."""
    a = ["1"] * 30 + ["0"] * 10
    if step >= 3:
        a[10 * ((step - 3) % 3) : 10 * ((step - 3) % 3) + 10] = ["0"] * 10
    text = "".join(a) + "1" * 30 + "0" * 10
    share = text.count("1") / 80
    outcomes = {"acc": text, "acc_norm": text, "phenomenon_runs": [["a", 40], ["b", 40]]}
    return {"step": step, "acc": share, "acc_norm": share, "outcomes": outcomes}


def test_a_resumed_run_pools_the_evaluations_before_its_checkpoint_with_those_after(tmp_path):
    """The pooled windows reach back over a resume: resumed after step 3, the run alerts at step 4 on the last 2
    evaluations (3, restored, and 4) against steps 1 and 2 (restored), as the run without a break and the replay of
    its records do; a monitor that started afresh at the resume would not."""
    from tatblimp_callback.results.regressions import RegressionMonitor
    from tatblimp_callback.results.stats import Outcomes
    from tatblimp_callback.training.alerts import RegressionAlerts

    records = [_rotating_record(step) for step in range(6)]
    path = tmp_path / "tatblimp_history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:4]), encoding="utf-8")
    resumed = RegressionAlerts(True, 0.05, 0.05, "tatblimp", restored=[{"step": s, "tatblimp/acc": 0.6} for s in range(4)])
    resumed.restore(path)
    after = [a for r in records[4:] for a in resumed.monitor.observe(r["step"], {"tatblimp": Outcomes.from_record(r)})]
    whole = replay_alerts(records)
    assert after == whole and [(a.step, a.group, a.reference, a.best_step) for a in whole] == [
        (4, "overall", "last 2", 1),
        (4, "a", "last 2", 1),
    ]
    afresh = RegressionMonitor()
    assert [a for r in records[4:] for a in afresh.observe(r["step"], {"tatblimp": Outcomes.from_record(r)})] == []


def _count_on(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from tatblimp_callback.training.alerts import RegressionAlerts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    alerts = RegressionAlerts(True, 0.05, 0.05, "tatblimp")
    alerts.count = 2 if rank == 0 else 0  # only rank 0 compared a resumed run with its history file, and alerted
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(alerts.agreed_count(main_process=rank == 0)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_process_logs_the_main_processs_alert_count(tmp_path):
    """#39's suspicion, real: only rank 0 restores the monitor from the history file, so after a resume the ranks'
    ``tatblimp/alerts`` (in Lightning's callback_metrics on every rank) could differ; now all take rank 0's.
    Two real gloo processes."""
    import torch.multiprocessing as mp

    mp.start_processes(_count_on, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)] == [{"tatblimp/alerts": 2.0}] * 2


def test_the_alert_mode_reaches_the_monitor_and_an_unknown_one_is_refused_when_the_callback_is_built():
    from tatblimp_callback import TatBLiMPCallback

    assert TatBLiMPCallback()._monitor.alerts.monitor.mode == "pooled"
    for mode in ("per_run", "per_evaluation"):
        assert TatBLiMPCallback(alert_mode=mode)._monitor.alerts.monitor.mode == mode
    with pytest.raises(ValueError, match="alert mode must be one of 'pooled', 'per_run', 'per_evaluation', got 'per-run'"):
        TatBLiMPCallback(alert_mode="per-run")


def test_a_run_without_log_prob_evaluations_says_no_trend(capsys):
    """``protocol="forced-choice"``: the end of training said "trend: fewer than two evaluations" right after three."""
    from tatblimp_callback.training.alerts import RegressionAlerts

    alerts = RegressionAlerts(True, 0.05, 0.05, "tatblimp")
    assert alerts.summary(main_process=True) is not None and capsys.readouterr().out == ""
