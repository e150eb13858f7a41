"""What a plot of curves shows: integer steps, labelled reference lines, the benchmark's phenomenon order, every
run given (a single result as a marker at its step), and a legend."""

from __future__ import annotations

import json

import pytest

from tatblimp_callback.commands.compare import load_runs, plot_comparison
from tatblimp_callback.reading.data import OFFICIAL_ORDER, OFFICIAL_PHENOMENA


@pytest.fixture
def figures(monkeypatch):
    """The figures saved while the test runs (each is also written to its file)."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: saved.append(self) or original(self, *args, **kwargs))
    return saved


def record(value: float, **extra) -> dict:
    """A results record whose phenomena come in reverse alphabetical order (not the benchmark's)."""
    interval = [value - 0.1, value + 0.1]
    phenomena = {name: {"acc": value, "acc_norm": value, "acc_norm_ci": interval} for name in sorted(OFFICIAL_PHENOMENA)[::-1]}
    return {"acc": value, "acc_norm": value, "acc_norm_ci": interval, "phenomena": phenomena, **extra}


def test_a_sweep_compared_with_single_results(tmp_path, figures):
    sweep = tmp_path / "run" / "tatblimp.jsonl"
    sweep.parent.mkdir()
    sweep.write_text("".join(json.dumps(record(0.5 + step / 10, step=step)) + "\n" for step in (1, 2, 3)))
    at_step = tmp_path / "at-step.json"
    at_step.write_text(json.dumps(record(0.9, model="runs/other/checkpoint-2")))
    no_step = tmp_path / "final.json"
    no_step.write_text(json.dumps(record(0.6, model="runs/other/final-model")))
    plot_comparison(load_runs([sweep, at_step, no_step]), tmp_path / "c.png")
    (figure,) = figures
    panels = [axis for axis in figure.axes if axis.get_visible() and axis.axison]
    assert [axis.get_title() for axis in panels] == ["overall", *OFFICIAL_ORDER]
    for axis in panels:
        assert all(float(tick).is_integer() for tick in axis.get_xticks())  # steps 1, 2, 3: no 1.25 or 2.5
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == [
        "run",
        "at-step",
        "final (no step)",
        "threshold (0.75)",
        "chance (0.5)",
    ]
    assert figure.get_supylabel() == "acc_norm" and figure.get_supxlabel() == "step"
    overall = panels[0]
    (marker,) = overall.containers  # the single result with a step: a marker and its interval at step 2
    assert marker.get_label() == "at-step" and marker.lines[0].get_xydata().tolist() == [[2.0, 0.9]]
    (level,) = [line for line in overall.lines if line.get_label() == "final (no step)"]
    assert list(level.get_ydata()) == [0.6, 0.6]
    (curve,) = [line for line in overall.lines if line.get_label() == "run"]
    assert list(curve.get_xdata()) == [1, 2, 3]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_the_official_order_is_the_files(records):
    assert tuple(dict.fromkeys(r["phenomenon"] for r in records)) == OFFICIAL_ORDER
