"""Flips: lost and learned pairs between two results, never-learned and unstable pairs across a sweep,
``compare --flips`` / ``compare --json`` and ``compare FILE@STEP``, against lists computed here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.results.flips import Flips, flips, sweep_flips
from tatblimp_callback.results.runs import load_run
from tatblimp_callback.results.stats import Outcomes, paired_counts

DEMO = Path(__file__).parent / "data" / "demo_history.jsonl"  # the demo run's history file (examples/train_tiny_tatar.py)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()]


def as_array(outcomes: str) -> np.ndarray:
    return np.frombuffer(outcomes.encode(), dtype=np.uint8) - ord("0")  # 1 passed, 0 failed, '-' gives -3


def expected_flips(a: str, b: str) -> tuple[list[int], list[int]]:
    x, y = as_array(a), as_array(b)
    return np.flatnonzero((x == 1) & (y == 0)).tolist(), np.flatnonzero((x == 0) & (y == 1)).tolist()


def test_lost_and_learned_between_every_two_steps_of_the_demo(records):
    assert len(records) >= 3
    first, last = records[0]["outcomes"], records[-1]["outcomes"]
    for metric in ("acc_norm", "acc"):
        for a, b in [(first, last), (records[1]["outcomes"], last), (last, first)]:
            found = flips(a[metric], b[metric])
            assert (found.lost, found.learned) == expected_flips(a[metric], b[metric])
            counts = paired_counts(a[metric], b[metric])  # the paired test's own counting agrees
            assert (len(found.lost), len(found.learned)) == (counts.baseline_only, counts.run_only)
    found = flips(first["acc_norm"], last["acc_norm"])
    assert found.lost and found.learned  # the demo run both learns and forgets pairs


def test_non_finite_pairs_are_neither_lost_nor_learned():
    found = flips("1-01", "0-10")
    assert (found.lost, found.learned) == ([0, 3], [2])
    assert flips("10-", "-11") == Flips(lost=[], learned=[1])
    with pytest.raises(ValueError, match="different lengths"):
        flips("10", "1")


def test_never_learned_and_unstable_pairs_across_the_demo_sweep(records):
    outcomes = [Outcomes.from_record(r) for r in records]
    matrix = np.stack([as_array(o.acc_norm) for o in outcomes])  # [steps x pairs]
    changes = (np.diff(matrix, axis=0) != 0).sum(0)
    phenomena = np.array(outcomes[0].phenomena)
    found = sweep_flips(outcomes)
    assert list(found) == list(dict.fromkeys(outcomes[0].phenomena))
    for name, result in found.items():
        in_group = phenomena == name
        assert result.never_learned == np.flatnonzero(in_group & (matrix == 0).all(0)).tolist()
        assert result.unstable == np.flatnonzero(in_group & (changes > 2)).tolist()
        assert all(result.changes[i] == changes[i] for i in result.unstable)
    assert sum(len(r.never_learned) for r in found.values()) > 0


def test_unstable_counts_changes_over_finite_steps_only():
    runs = [("a",) * 4]
    steps = ["1", "0", "-", "1", "0"]  # a pair: changes 1->0, (skip), 0->1, 1->0: three changes
    outcomes = [Outcomes(acc=s + "0", acc_norm=s + "0", phenomena=runs[0][:2]) for s in steps]
    found = sweep_flips(outcomes)["a"]
    assert (found.unstable, found.changes, found.never_learned) == ([0], {0: 3}, [1])
    with pytest.raises(ValueError, match="no results"):
        sweep_flips([])


def test_compare_json_lists_the_pairs_of_every_paired_count(records, tmp_path, capsys):
    first = records[0]["step"]
    out = tmp_path / "cmp.json"
    assert main(["compare", f"{DEMO}@{first}", str(DEMO), "--json", str(out)]) == 0
    paired = json.loads(out.read_text(encoding="utf-8"))["paired"]
    before, after = Outcomes.from_record(records[0]), Outcomes.from_record(records[-1])
    groups = before.groups()
    assert len(paired) == 2 * (1 + len(groups))
    for entry in paired:
        a, b = getattr(before, entry["metric"]), getattr(after, entry["metric"])
        indices = np.arange(len(a)) if entry["group"] == "overall" else np.array(groups[entry["group"]])
        lost, learned = expected_flips(a, b)
        assert entry["baseline_only_pairs"] == [i for i in lost if i in set(indices.tolist())]
        assert entry["run_only_pairs"] == [i for i in learned if i in set(indices.tolist())]
        assert (len(entry["baseline_only_pairs"]), len(entry["run_only_pairs"])) == (entry["baseline_only"], entry["run_only"])


def test_compare_flips_prints_the_lost_and_learned_pairs_with_sentences(records, capsys):
    first = records[0]["step"]
    assert main(["compare", f"{DEMO}@{first}", str(DEMO), "--flips", "--data", str(DATA)]) == 0
    out = capsys.readouterr().out
    lost, learned = expected_flips(records[0]["outcomes"]["acc_norm"], records[-1]["outcomes"]["acc_norm"])
    header = re.search(r"flips, acc_norm: (\S+) against (\S+): (\d+) lost, (\d+) learned", out)
    assert header and (int(header.group(3)), int(header.group(4))) == (len(lost), len(learned))
    pairs = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    section = out[header.start() : out.index("flips, acc:")]
    listed = [int(n) for n in re.findall(r"^    #(\d+)  ", section, flags=re.M)]
    assert listed == lost + learned
    assert f"good: {pairs[lost[0]]['good']}" in section and f"bad:  {pairs[learned[-1]]['bad']}" in section
    never = sum(len(f.never_learned) for f in sweep_flips([Outcomes.from_record(r) for r in records]).values())
    assert re.search(r"across demo_history \(acc_norm\)", out)
    assert sum(int(n) for n in re.findall(r"never learned (\d+):", out)) == never


def test_compare_at_a_step_uses_the_history_up_to_that_step(records, tmp_path, capsys):
    middle = records[len(records) // 2]["step"]
    run = load_run(DEMO, step=middle)
    assert [entry["step"] for entry in run.history] == [r["step"] for r in records if r["step"] <= middle]
    full = load_run(DEMO)
    assert len(full.history) == len(records)
    # Acquisition up to the step: a phenomenon acquired only later reads "never" at the step.
    from tatblimp_callback.results.curves import acquisition_steps, history_from_records

    expected = acquisition_steps(history_from_records([r for r in records if r["step"] <= middle]))
    assert run.acquisition() == expected
    # --plot draws the picked run's curve through its step only: count the points drawn per panel (SVG markers).
    plot = tmp_path / "curves.svg"
    assert main(["compare", f"{DEMO}@{middle}", str(DEMO), "--plot", str(plot), "--no-paired"]) == 0
    svg = plot.read_text(encoding="utf-8")
    panels = 1 + len(records[0]["phenomena"])

    def points(label: str, key: str) -> int:  # the vertices of a curve's line (its <g id="curve:LABEL:KEY">)
        group = re.search(rf'<g id="curve:{re.escape(label)}:{re.escape(key)}">\s*<path d="([^"]*)"', svg)
        return len(re.findall(r"[ML] ", group.group(1)))

    keys = ["tatblimp/acc_norm", *(f"tatblimp/{name}/acc_norm" for name in records[0]["phenomena"])]
    for key in keys:
        assert points(f"demo_history@{middle}", key) == len(run.history)
        assert points("demo_history", key) == len(full.history)
    assert len(records[0]["phenomena"]) + 1 == panels
