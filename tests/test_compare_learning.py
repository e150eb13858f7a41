"""``tatblimp compare`` of two sweeps: fitted acquisition steps, trends and the learning order (Kendall's tau)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import kendalltau

from tatblimp_callback.cli import main
from tatblimp_callback.results.learning import _curve
from tatblimp_callback.results.stats import encode_outcomes

STEPS = [0, 10, 20, 50, 100, 200, 400, 700, 1000, 1500, 2000]
NAMES = ("early", "middle", "late", "later", "never")


def sweep(path, midpoints: dict[str, float], seed: int):
    """A sweep file whose phenomena rise at ``midpoints`` (60 pairs each, binomial noise)."""
    rng = np.random.default_rng(seed)
    texts = {
        name: [
            encode_outcomes(bool(v) for v in rng.random(60) < p)
            for p in _curve(np.log1p(STEPS), 0.95 if midpoints[name] else 0.5, np.log1p(midpoints[name] or 1), 4)
        ]
        for name in NAMES
    }
    lines = []
    for i, step in enumerate(STEPS):
        text = "".join(texts[name][i] for name in NAMES)
        share = text.count("1") / len(text)
        phenomena = {n: {"acc": texts[n][i].count("1") / 60, "acc_norm": texts[n][i].count("1") / 60, "n": 60} for n in NAMES}
        lines.append(
            {
                "step": step,
                "acc": share,
                "acc_norm": share,
                "phenomena": phenomena,
                "benchmark": {"md5": "x", "release": "test"},
                "outcomes": {"acc": text, "acc_norm": text, "phenomenon_runs": [[n, 60] for n in NAMES]},
            }
        )
    path.parent.mkdir()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_compare_reports_fits_trends_and_kendalls_tau_of_two_sweeps(tmp_path, capsys):
    a = sweep(tmp_path / "a" / "tatblimp.jsonl", {"early": 30, "middle": 150, "late": 400, "later": 900, "never": None}, 0)
    b = sweep(tmp_path / "b" / "tatblimp.jsonl", {"early": 40, "middle": 600, "late": 200, "later": 1200, "never": None}, 1)
    assert main(["compare", str(a), str(b), "--json", str(tmp_path / "c.json"), "--markdown", str(tmp_path / "c.md")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "c.json").read_text())
    fits = {label: result["learning"][label]["acquisition_fits"] for label in ("a", "b")}
    assert fits["a"]["never"]["status"] == "not acquired" and fits["a"]["early"]["status"] == "acquired"
    (order,) = result["learning_order"]
    both = [n for n in NAMES if fits["a"][n]["status"] == fits["b"][n]["status"] == "acquired"]
    expected = kendalltau([fits["a"][n]["step"] for n in both], [fits["b"][n]["step"] for n in both])
    assert order["phenomena"] == both and len(both) == 4
    assert (order["tau"], order["p_value"]) == pytest.approx((expected.statistic, expected.pvalue))
    assert order["order_a"] == ["early", "middle", "late", "later"] and order["order_b"] == ["early", "late", "middle", "later"]
    assert f"learning order, b against a: Kendall's tau {expected.statistic:+.3f}" in out
    assert "  a: early < middle < late < later" in out and "### Learning order" in (tmp_path / "c.md").read_text()
    trends = result["learning"]["a"]["trends"]
    assert trends["never"]["direction"] == "flat" and trends["never"]["from_step"] == 700
