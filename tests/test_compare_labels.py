"""``tatblimp compare`` labels runs by the shortest ending of their paths that tells them apart (the JSON keeps the
path), and reads a file named twice once: one warning for a partial last line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tatblimp_callback.cli import main
from tatblimp_callback.results.runs import load_runs
from test_compare import result


def ablation_runs(root):
    """Three runs of the tokenizer ablation's layout: <root>/vocab-N/tiny-tatar/tatblimp_history.jsonl."""
    paths = []
    for vocab, value in (("vocab-1000", 0.4), ("vocab-4000", 0.6), ("vocab-8000", 0.7)):
        folder = root / "very" / "long" / "experiments" / "ablation" / vocab / "tiny-tatar"
        folder.mkdir(parents=True)
        lines = [result(0.5, {"p": 0.3}, step=0), result(0.6, {"p": value}, step=100)]
        (folder / "tatblimp_history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(folder / "tatblimp_history.jsonl")
    return paths


def test_absolute_paths_are_labelled_by_the_part_that_differs(tmp_path, capsys):
    paths = ablation_runs(tmp_path)
    assert all(path.is_absolute() for path in paths)
    runs = load_runs(paths)
    assert [run.label for run in runs] == ["vocab-1000/tiny-tatar", "vocab-4000/tiny-tatar", "vocab-8000/tiny-tatar"]
    assert [run.path for run in runs] == paths
    # Picked steps keep their @STEP; a step of one file against another file's is told apart the same way.
    runs = load_runs([f"{paths[0]}@0", f"{paths[0]}@100", paths[1]])
    assert [run.label for run in runs] == ["tiny-tatar@0", "tiny-tatar@100", "tiny-tatar"]
    runs = load_runs([f"{paths[0]}@0", f"{paths[1]}@0"])
    assert [run.label for run in runs] == ["vocab-1000/tiny-tatar@0", "vocab-4000/tiny-tatar@0"]

    out = tmp_path / "out"
    code = main(["compare", *map(str, paths), "--json", str(out / "c.json"), "--markdown", str(out / "c.md")])
    assert code == 0
    table = capsys.readouterr().out
    table = [line for line in table.splitlines() if not line.startswith("wrote ")]
    assert not any(str(tmp_path) in line for line in table) and str(tmp_path) not in (out / "c.md").read_text()
    accuracies = table[: table.index("")]  # the first table: a column a run
    assert accuracies[0].split() == ["metric", "(phenomena:", "acc_norm)", *(f"vocab-{n}/tiny-tatar" for n in (1000, 4000, 8000))]
    assert max(map(len, accuracies)) < 100
    written = json.loads((out / "c.json").read_text())
    assert [(run["label"], run["path"]) for run in written["runs"]] == [
        (f"vocab-{n}/tiny-tatar", str(path)) for n, path in zip((1000, 4000, 8000), paths)
    ]
    assert {test["run"] for test in written["paired"]} == {"vocab-4000/tiny-tatar", "vocab-8000/tiny-tatar"}


def test_a_file_named_twice_is_read_once_and_warned_about_once(tmp_path, caplog):
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / "tatblimp.jsonl"
    lines = "".join(json.dumps(result(0.5, {"p": v}, step=s)) + "\n" for s, v in ((0, 0.3), (100, 0.6)))
    path.write_text(lines + json.dumps(result(0.5, {"p": 0.9}, step=200))[:40])  # a line being written
    with caplog.at_level(logging.WARNING):
        assert main(["compare", f"{path}@0", str(path)]) == 0
    warnings = [r.getMessage() for r in caplog.records if "partial line" in r.getMessage()]
    assert warnings == [f"tatblimp: {path}:3 is a partial line (still being written?); left out"]
    runs = load_runs([f"{path}@0", path])
    assert [(run.label, run.record["step"]) for run in runs] == [("run@0", 0), ("run", 100)]
    assert runs[0].records is runs[1].records and runs[0] is not runs[1]


def test_the_sweep_and_the_history_of_one_run_get_labels_of_their_own(tmp_path, capsys):
    """runs/X/tatblimp.jsonl (sweep) beside runs/X/tatblimp_history.jsonl (the callback's): both labelled X before,
    the fits table and the JSON's learning kept one, and --baseline could not choose."""
    demo = Path(__file__).parent / "data" / "demo_history.jsonl"
    lines = demo.read_text(encoding="utf-8").splitlines(keepends=True)
    folder = tmp_path / "runs" / "tiny-tatar"
    folder.mkdir(parents=True)
    (folder / "tatblimp_history.jsonl").write_text("".join(lines))
    (folder / "tatblimp.jsonl").write_text("".join(lines[: len(lines) // 2 + 1]))  # a sweep of the first checkpoints
    sweep, history = str(folder / "tatblimp.jsonl"), str(folder / "tatblimp_history.jsonl")
    labels = ["tiny-tatar/tatblimp.jsonl", "tiny-tatar/tatblimp_history.jsonl"]

    out = tmp_path / "c.json"
    assert main(["compare", sweep, history, "--json", str(out), "--baseline", labels[1]]) == 0
    table = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert [run["label"] for run in written["runs"]] == labels
    assert sorted(written["learning"]) == labels  # both curves fitted, none dropped
    assert [(t["baseline"], t["run"]) for t in written["learning_order"]] == [(labels[1], labels[0])]
    assert {test["run"] for test in written["paired"]} == {labels[0]}
    assert table.count("tiny-tatar/tatblimp.jsonl") >= 2 and "tiny-tatar/tatblimp_history.jsonl" in table

    report = tmp_path / "r.html"
    assert main(["report", sweep, history, "--output", str(report)]) == 0
    page = report.read_text(encoding="utf-8")
    assert f'data-run="{labels[1]}"' in page and f"{labels[1]} against {labels[0]}" in page


def test_the_same_file_at_the_same_step_twice_is_numbered(tmp_path):
    path = tmp_path / "run" / "tatblimp.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(result(0.5, {"p": v}, step=s)) + "\n" for s, v in ((0, 0.3), (100, 0.6))))
    assert [run.label for run in load_runs([path, path])] == ["run#1", "run#2"]
