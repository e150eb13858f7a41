"""How often the callback's regression alerts fire on runs that do not regress, and how often the fitted
acquisition intervals hold the true midpoint: both by simulation, with the defaults (q < 0.05, a 5-point drop;
200 bootstrap draws).

False alarms: runs of ``--evaluations`` evaluations on TatBLiMP's shape (its 16 phenomena with their real pair
counts, 1,248 pairs, and the overall score) whose accuracy does not change: every pair has its own pass
probability (drawn once from a Beta around 0.7, kept through the run) and at each evaluation a share
``--redraw`` of the pairs have their outcome drawn again (1.0: every pair's outcome is new noise at every
evaluation, the harshest case; real runs change far fewer pairs between evaluations). The rate is the share of
runs with at least one alert.

Coverage: synthetic histories with a known midpoint (a logistic curve in log(1 + step) from chance to a plateau),
binomial noise on ``--pairs`` pairs a phenomenon; the rate is the share of fitted 95% intervals that hold the true
midpoint.

    python benchmarks/bench_alert_false_alarms.py --runs 200 --evaluations 20
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter

import numpy as np

from tatblimp_callback.reading.data import load_benchmark
from tatblimp_callback.results.learning import _curve, fit_acquisition
from tatblimp_callback.results.regressions import RegressionMonitor
from tatblimp_callback.results.stats import Outcomes, encode_outcomes


def phenomenon_of_each_pair(data: str | None) -> tuple[str, ...]:
    try:
        return tuple(pair.phenomenon for pair in load_benchmark(data).pairs)
    except Exception:  # no benchmark file here: 16 phenomena of 78 pairs
        return tuple(f"phenomenon_{i // 78}" for i in range(1248))


def false_alarm_rate(phenomena, runs: int, evaluations: int, redraw: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = len(phenomena)
    alarmed, alerts, alarmed_evaluations = 0, Counter(), 0
    for _ in range(runs):
        p = rng.beta(7, 3, n)  # each pair's own pass probability, mean 0.7
        passed = rng.random(n) < p
        monitor = RegressionMonitor()
        raised = 0
        for step in range(evaluations):
            if step:
                again = rng.random(n) < redraw
                passed = np.where(again, rng.random(n) < p, passed)
            text = encode_outcomes(bool(v) for v in passed)
            found = monitor.observe(step * 100, {"tatblimp": Outcomes(text, text, phenomena)})
            raised += len(found)
            alarmed_evaluations += bool(found)
            alerts.update(alert.group for alert in found)
        alarmed += raised > 0
    return {
        "runs": runs,
        "evaluations": evaluations,
        "redraw": redraw,
        "runs_with_an_alert": alarmed,
        "rate": alarmed / runs,
        "evaluation_rate": alarmed_evaluations / (runs * (evaluations - 1)),
        "groups": dict(alerts.most_common(5)),
    }


def coverage(histories: int, pairs: int, bootstrap: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    steps = [0, 10, 20, 50, 100, 200, 400, 700, 1000, 1500, 2000]
    inside = acquired = 0
    for k in range(histories):
        mid, plateau, slope = float(rng.uniform(80, 600)), float(rng.uniform(0.8, 0.97)), float(rng.uniform(2, 5))
        shares = _curve(np.log1p(steps), plateau, np.log1p(mid), slope)
        texts = [encode_outcomes(bool(v) for v in rng.random(pairs) < share) for share in shares]
        fit = fit_acquisition(steps, texts, bootstrap=bootstrap, seed=k)
        if fit.acquired:
            acquired += 1
            inside += fit.interval[0] <= mid <= fit.interval[1]
    return {"histories": histories, "pairs": pairs, "acquired": acquired, "inside": inside, "rate": inside / max(acquired, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--evaluations", type=int, default=20)
    parser.add_argument("--histories", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=78, help="pairs a phenomenon in the coverage histories")
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--data", help="the benchmark file (its phenomena and their sizes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    phenomena = phenomenon_of_each_pair(args.data)
    start = time.perf_counter()
    figures = {
        "machine": f"{platform.machine()} {platform.system()}",
        "false_alarms": [false_alarm_rate(phenomena, args.runs, args.evaluations, redraw, args.seed) for redraw in (1.0, 0.2)],
        "coverage": coverage(args.histories, args.pairs, args.bootstrap, args.seed),
    }
    figures["seconds"] = time.perf_counter() - start
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
