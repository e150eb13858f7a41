"""A revision is a (name, commit) pair whose name can move; a record belongs to a commit (issue #51, defects 4, 5).

A real huggingface_hub client against the local Hub of ``hub_server``, as in ``test_sweep_revisions.py``: ``main``
moves on to a newer checkpoint between two sweeps (its older line stays: ``step1`` still names that commit), a real
re-upload still replaces, and a sweep of ``'step*,main'`` runs again offline from the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_llama
from hub_server import FakeHub
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.commands.revisions import plan_revisions
from tatblimp_callback.commands.sweep import sweep
from tatblimp_callback.results.runs import load_run, without_replaced
from test_sweep_revisions import REPO, assert_scores, hub_results, lines, options, publish, serve

SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory, bpe_tokenizer):
    """Tiny random Llamas saved with the tokenizer (``seed<N>``), as a revision's files are uploaded."""
    root = tmp_path_factory.mktemp("models")
    for seed in SEEDS:
        tiny_llama(len(bpe_tokenizer), seed=seed).save_pretrained(root / f"seed{seed}")
        bpe_tokenizer.save_pretrained(root / f"seed{seed}")
    return root


@pytest.fixture(scope="module")
def expected(model_folders, bpe_tokenizer, small_data):
    """Each model folder scored locally, by ``evaluate`` on the model loaded from it."""
    from transformers import AutoModelForCausalLM

    def score(seed):
        return evaluate(
            AutoModelForCausalLM.from_pretrained(model_folders / f"seed{seed}"), bpe_tokenizer, small_data, allow_modified=True
        )

    return {seed: score(seed) for seed in SEEDS}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = FakeHub().start()
    serve(monkeypatch, server.endpoint, tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)
    yield server
    server.stop()


def test_main_moving_on_keeps_the_older_checkpoints_line_and_a_reupload_still_replaces(
    hub, model_folders, expected, small_data, caplog, capsys
):
    first = publish(hub, model_folders, {"step1": 1, "main": 1})
    sweep(REPO, options(small_data), revisions="step*,main")
    # A newer checkpoint, and main moved on to it: step1 still names the first commit.
    second = publish(hub, model_folders, {"step2": 2, "main": 2})
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        report = sweep(REPO, options(small_data), revisions="step*,main")
    assert report.scored == ["step2"] and report.skipped == ["step1"] and report.replaced == {}
    assert "tatblimp: main moved on from the commit of step1, whose line stays; its new commit is scored" in caplog.text
    assert "scored again" not in caplog.text
    written = lines(hub_results())
    assert [(r["checkpoint"], r["revisions"], r["commit"]) for r in written] == [
        ("step1", ["step1", "main"], first["step1"]),
        ("step2", ["step2", "main"], second["step2"]),
    ]
    assert written[1]["replaces"] == {"main": first["step1"]}
    # The sweep, compare and the report see both checkpoints; main names the newer one only.
    assert [(r["step"], r["revisions"]) for r in report.records] == [(1, ["step1"]), (2, ["step2", "main"])]
    run = load_run(hub_results())
    assert [(r["step"], r["commit"], r["revisions"]) for r in run.records] == [
        (1, first["step1"], ["step1"]),
        (2, second["step2"], ["step2", "main"]),
    ]
    assert_scores(run.records[0], expected[1])
    assert_scores(run.records[1], expected[2])
    capsys.readouterr()
    assert main(["compare", f"{hub_results()}@step1", f"{hub_results()}@main", "--json", "compare.json"]) == 0
    compared = json.loads(Path("compare.json").read_text(encoding="utf-8"))
    assert [(run["label"], run["acc"], run["acc_norm"]) for run in compared["runs"]] == [
        ("org--tiny-series@step1", expected[1].acc, expected[1].acc_norm),
        ("org--tiny-series@main", expected[2].acc, expected[2].acc_norm),
    ]
    assert main(["report", str(hub_results()), "--output", "report.html"]) == 0
    page = Path("report.html").read_text(encoding="utf-8")
    assert "org--tiny-series: step 1 (step1) against step 2 (step2)" in page

    # A real re-upload: step1 now names other files, and no name is left on its first commit: that line leaves.
    third = publish(hub, model_folders, {"step1": 3})
    report = sweep(REPO, options(small_data), revisions="step*,main")
    assert report.scored == ["step1"] and report.replaced == {"step1": first["step1"]}
    assert lines(hub_results())[2]["replaces"] == {"step1": first["step1"]}
    assert [(r["step"], r["commit"]) for r in load_run(hub_results()).records] == [(1, third["step1"]), (2, second["step2"])]
    assert_scores(load_run(hub_results()).records[0], expected[3])


def test_a_sweep_of_step_and_main_runs_again_offline_from_the_cache(hub, model_folders, expected, small_data, monkeypatch):
    from huggingface_hub import constants

    shas = publish(hub, model_folders, {"step1": 1, "step2": 2, "main": 2})
    assert sweep(REPO, options(small_data), revisions="step*,main").scored == ["step1", "step2"]
    refs = Path(constants.HF_HUB_CACHE) / f"models--{REPO.replace('/', '--')}" / "refs"
    assert {p.name: p.read_text() for p in refs.iterdir()} == shas  # every name's ref, main's too
    hub.stop()
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    again = sweep(REPO, options(small_data), revisions="step*,main")
    assert again.scored == [] and sorted(again.skipped) == ["main", "step1", "step2"]
    # Offline into a new results file: both commits scored from the cache, main named beside step2.
    fresh = sweep(REPO, options(small_data, results="offline.jsonl"), revisions="step*,main")
    assert fresh.scored == ["step1", "step2"] and len(hub.requests) == asked  # the Hub was not asked
    written = lines(Path("offline.jsonl"))
    assert [(r["revisions"], r["commit"]) for r in written] == [(["step1"], shas["step1"]), (["step2", "main"], shas["main"])]
    assert_scores(written[0], expected[1])
    assert_scores(written[1], expected[2])


def test_a_commit_pointed_at_again_after_its_line_was_replaced_is_scored_again():
    # step2 re-uploaded (c2 -> c2b), then the re-upload undone (back to c2): c2's first line left the curve, so c2 is
    # scored again, and its new line replaces c2b's.
    records = [
        {"checkpoint": "step1", "step": 1, "commit": "c1", "revisions": ["step1", "main"]},
        {"checkpoint": "step2", "step": 2, "commit": "c2", "revisions": ["step2"]},
        {"checkpoint": "step2", "step": 2, "commit": "c2b", "revisions": ["step2"], "replaces": {"step2": "c2"}},
    ]
    plan = plan_revisions({"step1": "c1", "step2": "c2", "main": "c2"}, records, None)
    assert [(r.name, r.names, r.replaces, r.reuploads) for r in plan.todo] == [
        ("step2", ("step2", "main"), {"step2": "c2b", "main": "c1"}, {"step2": "c2b"})
    ]
    assert plan.moved == {"main": "step1"} and plan.skipped == ["step1"]
    written = {
        "checkpoint": "step2",
        "step": 2,
        "commit": "c2",
        "revisions": ["step2", "main"],
        "replaces": plan.todo[0].replaces,
    }
    assert [(r["commit"], r["revisions"]) for r in without_replaced([*records, written])] == [
        ("c1", ["step1"]),
        ("c2", ["step2", "main"]),
    ]
    assert records[0]["revisions"] == ["step1", "main"]  # the records read are not changed
    # A name of the old line outside the pattern (main), known to point elsewhere: it leaves that line too.
    again = plan_revisions({"step1": "c1b"}, records[:1], None, refs={"step1": "c1b", "main": "c9"})
    assert again.todo[0].replaces == {"step1": "c1", "main": "c1"} and again.todo[0].reuploads == {"step1": "c1"}
