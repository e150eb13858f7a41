"""``tatblimp sweep``: checkpoints found and scored in step order, resumable, watch mode, curves."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from conftest import tiny_llama
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.commands.compare import load_run, plot_comparison
from tatblimp_callback.commands.sweep import SweepError, SweepOptions, find_checkpoints, sweep
from tatblimp_callback.results.curves import plot_curves

STEPS = (10, 20, 30)


def save_checkpoint(folder, tokenizer, seed, trainer_state=True):
    tiny_llama(len(tokenizer), seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if trainer_state:  # the Trainer writes it last, after the weights
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": seed}))


@pytest.fixture(scope="module")
def run_template(tmp_path_factory, bpe_tokenizer):
    run = tmp_path_factory.mktemp("run")
    for step in STEPS:
        save_checkpoint(run / f"checkpoint-{step}", bpe_tokenizer, seed=step)
    (run / "runs").mkdir()  # a TensorBoard folder: not a checkpoint
    (run / "logs-2").mkdir()  # named with a number, but no config.json: not a checkpoint
    return run


@pytest.fixture
def run_dir(run_template, tmp_path):
    return shutil.copytree(run_template, tmp_path / "run")


def options(small_data, **extra):
    return SweepOptions(data=str(small_data), allow_modified=True, progress=False, **extra)


def test_sweep_scores_in_step_order_equal_to_evaluate_and_is_resumable(run_dir, small_data, bpe_tokenizer, monkeypatch):
    import tatblimp_callback.evaluation as evaluation

    builds = []
    original = evaluation.build_cache
    monkeypatch.setattr(evaluation, "build_cache", lambda *a, **k: builds.append(1) or original(*a, **k))

    report = sweep(run_dir, options(small_data))
    assert report.scored == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert len(builds) == 1  # one tokenizer (identical files in every checkpoint): tokenized once
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(STEPS)
    assert [line["checkpoint"] for line in lines] == [f"checkpoint-{s}" for s in STEPS]
    for line, step in zip(lines, STEPS):
        expected = evaluate(tiny_llama(len(bpe_tokenizer), seed=step), bpe_tokenizer, small_data, allow_modified=True).to_dict()
        for key in ("acc", "acc_norm", "bits_per_byte_good", "tokens_per_byte", "tokens", "bytes", "n"):
            assert line[key] == pytest.approx(expected[key], abs=1e-9), (step, key)
        assert {k: v["acc_norm"] for k, v in line["phenomena"].items()} == pytest.approx(
            {k: v["acc_norm"] for k, v in expected["phenomena"].items()}
        )
        assert "pairs" not in line and line["n"] == 48
    assert len({line["bits_per_byte_good"] for line in lines}) == 3  # three different models
    assert set(report.acquisition) == set(lines[0]["phenomena"])

    again = sweep(run_dir, options(small_data))
    assert again.scored == [] and again.skipped == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert len((run_dir / "tatblimp.jsonl").read_text().splitlines()) == 3
    assert [r["step"] for r in again.records] == list(STEPS)


def test_cli_sweep_adds_only_new_checkpoints_with_pairs(run_dir, small_data, bpe_tokenizer, capsys):
    sweep(run_dir, options(small_data))
    # Saved without trainer_state.json: scored once its files stay unchanged for an interval.
    save_checkpoint(run_dir / "step_40", bpe_tokenizer, seed=40, trainer_state=False)
    code = main(
        [
            "sweep",
            str(run_dir),
            "--data",
            str(small_data),
            "--allow-modified",
            "--interval",
            "0.2",
            "--include-pairs",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "1 checkpoint(s) scored, 3 already in" in out
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20, 30, 40]
    assert len(lines[3]["pairs"]) == 48 and "pairs" not in lines[0]


def test_find_checkpoints_names_and_errors(run_dir, bpe_tokenizer):
    assert [(c.step, c.name) for c in find_checkpoints(run_dir)] == [
        (10, "checkpoint-10"),
        (20, "checkpoint-20"),
        (30, "checkpoint-30"),
    ]
    save_checkpoint(run_dir / "ckpt_020", bpe_tokenizer, seed=1)
    with pytest.raises(
        SweepError, match=r"checkpoint-20 and ckpt_020 both claim step 20|ckpt_020 and checkpoint-20 both claim step 20"
    ):
        find_checkpoints(run_dir)
    with pytest.raises(SweepError, match=r"missing: no such folder$"):
        find_checkpoints(run_dir / "missing")


def test_bad_results_line_is_named(run_dir, small_data):
    (run_dir / "tatblimp.jsonl").write_text('{"step": 10, "checkpoint": "checkpoint-10", "acc": 1}\n{"step": 2\n')
    with pytest.raises(SweepError, match=r"tatblimp.jsonl:2: not a JSON line"):
        sweep(run_dir, options(small_data))


def test_watch_never_reads_a_checkpoint_being_written(run_dir, small_data, bpe_tokenizer, tmp_path):
    sweep(run_dir, options(small_data))
    source = tmp_path / "source"
    save_checkpoint(source, bpe_tokenizer, seed=60, trainer_state=False)
    weights = (source / "model.safetensors").read_bytes()
    stop = threading.Event()

    def write_forever():  # a checkpoint whose weights file keeps growing with garbage
        folder = run_dir / "checkpoint-50"
        folder.mkdir()
        shutil.copy(source / "config.json", folder)
        with open(folder / "model.safetensors", "wb") as handle:
            while not stop.is_set():
                handle.write(b"\0" * 512)
                handle.flush()
                time.sleep(0.05)

    def write_slowly():  # a real checkpoint written in pieces over about a second, then left alone
        folder = run_dir / "checkpoint-60"
        folder.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, folder)
        with open(folder / "model.safetensors", "wb") as handle:
            for start in range(0, len(weights), len(weights) // 20 + 1):
                handle.write(weights[start : start + len(weights) // 20 + 1])
                handle.flush()
                time.sleep(0.05)

    writers = [threading.Thread(target=write_forever), threading.Thread(target=write_slowly)]
    for writer in writers:
        writer.start()
    try:
        report = sweep(run_dir, options(small_data, watch=True, interval=0.5, max_wait=2.0))
    finally:
        stop.set()
        for writer in writers:
            writer.join()
    assert report.scored == ["checkpoint-60"]
    assert report.incomplete == ["checkpoint-50"]
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20, 30, 60]
    expected = evaluate(tiny_llama(len(bpe_tokenizer), seed=60), bpe_tokenizer, small_data, allow_modified=True)
    assert lines[3]["acc_norm"] == pytest.approx(expected.acc_norm)


@pytest.mark.slow
def test_curves_are_drawn_from_a_sweep_and_from_a_callback_history(run_dir, small_data, tmp_path):
    sweep(run_dir, options(small_data))
    run = load_run(run_dir / "tatblimp.jsonl")
    assert run.is_sweep and run.label == "run" and [e["step"] for e in run.history] == list(STEPS)
    plot_comparison([run], tmp_path / "sweep.png")
    history = [
        {"step": s, "tatblimp/acc_norm": 0.5 + s / 100, "tatblimp/a/acc_norm": s / 40, "tatblimp/b/acc_norm": 0.9} for s in STEPS
    ]
    plot_curves(history, tmp_path / "callback.png", title="demo")
    for name in ("sweep.png", "callback.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.summary, self.metrics, self.finished = init, [], {}, [], False

    def define_metric(self, name, **options):
        self.metrics.append((name, options.get("step_metric")))

    def log(self, values):
        self.logged.append(values)

    def finish(self):
        self.finished = True


def test_wandb_curves_over_the_checkpoint_step_into_an_existing_run(run_dir, small_data, monkeypatch):
    import sys
    import types

    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **init: runs.append(FakeRun(**init)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    report = sweep(run_dir, options(small_data, wandb_project="p", wandb_run_id="abc123", threshold=0.3))
    (run,) = runs
    assert run.init["id"] == "abc123" and run.init["resume"] == "allow" and run.init["project"] == "p"
    assert ("tatblimp/*", "train/global_step") in run.metrics
    assert [values["train/global_step"] for values in run.logged] == list(STEPS)
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    for values, line in zip(run.logged, lines):
        assert values["tatblimp/acc_norm"] == line["acc_norm"]
        assert values["tatblimp/binding/acc_norm"] == line["phenomena"]["binding"]["acc_norm"]
        assert values["tatblimp/tokens_per_byte"] == line["tokens_per_byte"]
    assert {k: v for k, v in run.summary.items()} == {
        f"tatblimp/acquisition/{name}": "never" if step is None else step for name, step in report.acquisition.items()
    }
    assert len(run.summary) == 16 and any(v != "never" for v in run.summary.values()) and run.finished


def test_sweep_records_carry_intervals_and_outcomes_and_compare_two_of_its_steps(run_dir, small_data, capsys):
    from tatblimp_callback.results.curves import acquisition_step

    report = sweep(run_dir, options(small_data, acquisition="lower-bound", threshold=0.2))
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    for line in lines:
        assert len(line["outcomes"]["acc_norm"]) == 48 and line["outcomes"]["acc_norm"].count("1") == round(48 * line["acc_norm"])
        assert line["acc_norm_ci"][0] < line["acc_norm"] < line["acc_norm_ci"][1]
        assert all(len(g["acc_ci"]) == 2 for g in [*line["phenomena"].values(), *line["subtypes"].values()])
    # Acquired when the lower bound (3 pairs a phenomenon: 2/3 passed -> 0.208) stays >= 0.2.
    expected = {
        name: acquisition_step([(line["step"], line["phenomena"][name]["acc_norm_ci"][0]) for line in lines], 0.2)
        for name in lines[0]["phenomena"]
    }
    assert report.acquisition == expected and set(expected.values()) - {None}

    code = main(
        [
            "compare",
            f"{run_dir}/tatblimp.jsonl@10",
            f"{run_dir}/tatblimp.jsonl@30",
            "--acquisition",
            "lower-bound",
            "--threshold",
            "0.2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "paired, acc_norm: run@30 against run@10 (baseline)" in out and "acquired (lower bound >= 0.2)" in out
    a, b = lines[0]["outcomes"]["acc_norm"], lines[2]["outcomes"]["acc_norm"]
    overall = next(line for line in out.split("paired, acc_norm")[1].splitlines() if line.startswith("overall")).split()
    assert overall[1:4] == ["48", str(sum(x > y for x, y in zip(a, b))), str(sum(x < y for x, y in zip(a, b)))]


@pytest.mark.slow
def test_curves_draw_a_band_where_the_history_has_intervals(run_dir, small_data, tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    bands = []
    original = Axes.fill_between
    monkeypatch.setattr(
        Axes,
        "fill_between",
        lambda self, x, low, high, **kw: bands.append((list(x), list(low), list(high))) or original(self, x, low, high, **kw),
    )
    sweep(run_dir, options(small_data))
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    plot_comparison([load_run(run_dir / "tatblimp.jsonl")], tmp_path / "sweep.png")
    assert len(bands) == 17  # overall and every phenomenon
    assert bands[0] == (list(STEPS), [line["acc_norm_ci"][0] for line in lines], [line["acc_norm_ci"][1] for line in lines])
    binding = [line["phenomena"]["binding"]["acc_norm_ci"] for line in lines]
    assert ([low for low, _ in binding], [high for _, high in binding]) in [(b[1], b[2]) for b in bands]
    # A callback history has the overall interval only: one band. Records (the history file) give all.
    bands.clear()
    history = [
        {
            "step": s,
            "tatblimp/acc_norm": 0.5,
            "tatblimp/acc_norm_ci_low": 0.4,
            "tatblimp/acc_norm_ci_high": 0.6,
            "tatblimp/a/acc_norm": 0.7,
        }
        for s in STEPS
    ]
    plot_curves(history, tmp_path / "callback.png")
    assert bands == [(list(STEPS), [0.4] * 3, [0.6] * 3)]
    bands.clear()
    plot_curves([{k: v for k, v in line.items() if k != "checkpoint"} for line in lines], tmp_path / "file.png")
    assert len(bands) == 17


def test_a_checkpoint_rotated_away_during_the_sweep_is_counted_and_the_sweep_goes_on(run_dir, small_data, monkeypatch, capsys):
    """The Trainer's ``save_total_limit`` deletes a checkpoint, its tokenizer files with it, while an earlier one is
    scored: the sweep stopped with "no tokenizer files ... pass --tokenizer" (exit 1), under ``--watch`` too."""
    from tatblimp_callback.commands.checkpoint_scoring import CheckpointScorer

    score = CheckpointScorer.score

    def rotating(scorer, checkpoint):
        if checkpoint.step == 10:
            shutil.rmtree(run_dir / "checkpoint-20")
        return score(scorer, checkpoint)

    monkeypatch.setattr(CheckpointScorer, "score", rotating)
    code = main(["sweep", str(run_dir), "--data", str(small_data), "--allow-modified", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 checkpoint(s) scored, 0 already in" in out and "1 deleted before scoring" in out
    assert [json.loads(line)["step"] for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()] == [10, 30]


def test_a_tokenizer_the_models_cannot_embed_stops_the_sweep_at_the_first_checkpoint(run_dir, small_data, capsys):
    """``--tokenizer`` (or ``--prefix-token-id``) is the run's: each checkpoint was loaded and failed alike, one
    FAILED line and one failures-file entry each."""
    from conftest import SPM_MODEL

    command = ["sweep", str(run_dir), "--data", str(small_data), "--allow-modified", "--no-progress"]
    assert main([*command, "--tokenizer", str(SPM_MODEL)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tatblimp sweep: error: checkpoint-10: tokenizer ") and err.count("\n") == 1
    assert err.rstrip().endswith(
        f"the tokenizer does not belong to this model (every checkpoint would fail alike: check --tokenizer {SPM_MODEL})"
    )
    assert not (run_dir / "tatblimp-failures.jsonl").exists()
    assert main([*command, "--prefix-token-id", "100000"]) == 1
    assert "(every checkpoint would fail alike: check --prefix-token-id)" in capsys.readouterr().err


def test_each_line_names_its_own_checkpoints_tokenizer(run_dir, small_data):
    """The checkpoints' tokenizer files are alike, so one tokenization serves them all; every line named the first
    checkpoint's folder as its tokenizer (checkpoint-30's said checkpoint-10, and the report showed that)."""
    sweep(run_dir, options(small_data))
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    assert [line["tokenizer"] for line in lines] == [str(run_dir / f"checkpoint-{step}") for step in STEPS]


def test_a_checkpoint_saved_again_in_place_is_scored_again_and_its_new_line_is_the_curves(
    run_dir, small_data, bpe_tokenizer, tmp_path, capsys
):
    """A new run into the same output folder writes checkpoint-20 again, with other weights: the sweep kept the old
    line ("0 scored, 3 already in") and the curve the old weights' score. A copy of the folder (new file times) is
    not taken for a new save."""
    from tatblimp_callback.results.runs import load_run

    command = ["sweep", str(run_dir), "--data", str(small_data), "--allow-modified", "--no-progress"]
    assert main(command) == 0
    shutil.rmtree(run_dir / "checkpoint-20")
    save_checkpoint(run_dir / "checkpoint-20", bpe_tokenizer, seed=99)
    capsys.readouterr()
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "1 checkpoint(s) scored, 2 already in" in out and "(1 saved again since, scored again: checkpoint-20)" in out
    now = evaluate(tiny_llama(len(bpe_tokenizer), seed=99), bpe_tokenizer, small_data, allow_modified=True)
    curve = [(r["step"], r["acc_norm"]) for r in load_run(run_dir / "tatblimp.jsonl").records_up_to_step]
    assert [step for step, _ in curve] == [10, 20, 30] and curve[1][1] == now.acc_norm
    copy = shutil.copytree(run_dir, tmp_path / "copied", copy_function=shutil.copy)  # new modification times
    assert main([*command[:1], str(copy), *command[2:]]) == 0
    assert "0 checkpoint(s) scored, 3 already in" in capsys.readouterr().out


def test_a_sweep_in_another_precision_does_not_join_the_curve(run_dir, small_data, bpe_tokenizer, capsys):
    """``--precision bfloat16`` on a rerun appended its lines to a float32 curve with no word: a jump that the
    precision made, read as the model's. Each line records its prefix token too."""
    command = ["sweep", str(run_dir), "--data", str(small_data), "--allow-modified", "--no-progress"]
    assert main(command) == 0
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    assert {(line["precision"], line["prefix_token_id"]) for line in lines} == {("float32", bpe_tokenizer.bos_token_id)}
    save_checkpoint(run_dir / "checkpoint-40", bpe_tokenizer, seed=40)
    capsys.readouterr()
    assert main([*command, "--precision", "bfloat16"]) == 1
    assert capsys.readouterr().err == (
        f"tatblimp sweep: error: {run_dir / 'tatblimp.jsonl'}: checkpoint-40 was scored in bfloat16, its lines in "
        "float32; one results file holds one curve: pass the same --dtype and --precision, or sweep into another file\n"
    )
    assert len((run_dir / "tatblimp.jsonl").read_text().splitlines()) == 3
    assert main(command) == 0  # the same precision: it joins
    assert len((run_dir / "tatblimp.jsonl").read_text().splitlines()) == 4


def test_a_second_sweep_of_a_run_being_swept_is_refused(run_dir, small_data, capsys):
    """Two sweeps of one run folder at once (a ``--watch`` left running and a manual one) both scored and wrote every
    checkpoint: each line twice."""
    import os

    from tatblimp_callback.results.records_file import sole_writer

    results = run_dir / "tatblimp.jsonl"
    command = ["sweep", str(run_dir), "--data", str(small_data), "--allow-modified", "--no-progress"]
    with sole_writer(results) as busy:  # as the other sweep holds it
        assert busy is None
        assert main(command) == 1
        assert capsys.readouterr().err == (
            f"tatblimp sweep: error: {results}: process {os.getpid()} is writing it (another sweep of this run, a --watch "
            "left running?); wait for it to end\n"
        )
        assert not results.exists()
    assert main(command) == 0 and len(results.read_text().splitlines()) == 3  # let go: the next sweep writes


def test_a_checkpoint_saved_again_that_fails_is_not_tried_again_in_the_same_watch(run_dir, small_data):
    """A checkpoint saved again in place is scored again; if that fails, a watching sweep must not take it up again
    at every poll (its old line still differs from its files)."""
    from tatblimp_callback.commands.sweep import _RunFolder
    from tatblimp_callback.commands.sweep_options import SweepReport

    folder = _RunFolder(run_dir, options(small_data), "cpu")
    record = {"checkpoint": "checkpoint-20", "step": 20, "weights_files": "an-earlier-save"}
    report = SweepReport(results_path=run_dir / "tatblimp.jsonl", records=[record])
    todo, _, _ = folder.poll({"checkpoint-20"}, True, report)
    assert [c.name for c in todo] == ["checkpoint-10", "checkpoint-20", "checkpoint-30"] and report.rewritten == ["checkpoint-20"]
    report.failed["checkpoint-20"] = "checkpoint-20: RuntimeError: boom"
    todo, _, _ = folder.poll({"checkpoint-10", "checkpoint-20", "checkpoint-30"}, True, report)
    assert todo == []
