"""How often the regression alerts fire on runs that do not regress, how fast they find a real fall, and how often
the fitted acquisition intervals hold the true midpoint: all by simulation, with the defaults (alert_q 0.05, a
5-point drop; 200 bootstrap draws), for the three alert modes (pooled, the default; per_run, the default before
it; per_evaluation) and for the pooled mode planned for the run's own number of evaluations (pooled_planned:
``alert_budget.planned_share``, 0.9 of alert_q spread evenly, the reserve kept).

Runs have TatBLiMP's shape (its 16 phenomena with their real pair counts, 1,248 pairs, and the overall score).
Every pair has its own pass probability, drawn once from a Beta around 0.7, and a noise model says how the
outcomes change from one evaluation to the next:

- ``redraw_all``: every pair's outcome is drawn again at every evaluation (the harshest case);
- ``redraw_fifth``: a fifth of the pairs are drawn again, the others keep their outcome;
- ``drift``: as ``redraw_fifth``, but each phenomenon's pass probabilities drift slowly up and down (a sine in
  logit space, amplitude 0.12, period a third of the run, its own phase): its expected score moves by about
  2 points either way, less than the 5-point minimum.

False alarms: the share of runs of 20, 100 and 500 evaluations with at least one alert (95% Wilson interval).
Detection: a phenomenon of 80 pairs at 0.90 (pass probabilities from Beta(9, 1)) falls at evaluation F
(20, 100, 500) to 0.50 or 0.70 and stays there (each pass it had stays a pass with probability 0.50/0.90 or
0.70/0.90, and later draws use its pass probabilities scaled alike), or every pair's falls so that the overall
score loses 5 points; the delay is the number of evaluations from the fall to the alert of that group.

The alert arithmetic is the package's own (``results/alert_budget.py``, ``results/alert_windows.py`` and the
per-evaluation mode's BH), run on arrays of many runs at once; ``tests/test_alert_budget.py`` checks this
simulation against ``RegressionMonitor`` on the same outcomes, alert for alert. The pooled windows' exact
sign-flip p-value is computed where it can matter: where the normal approximation of the window's p-value is
below 100 times the most that any alert of that evaluation could need (elsewhere the exact p-value is far above
that level, and a p-value above it changes no alert, Holm's included); the test checks this too.

    python benchmarks/bench_alert_false_alarms.py --runs 1000 --json benchmarks/results/alert_false_alarms.json

On a busy machine a run can be stopped and started again with ``--reuse`` naming what the first printed (its
JSON lines) or wrote: each configuration has its own seeded generator, so the figures already measured are the
ones a run from the start would give, and the JSON names them under ``reused``. ``--modes`` measures some modes
only (the simulated outcomes do not depend on the modes), and ``--add-to`` keeps an earlier JSON's figures of the
other modes beside them, row by row:

    python benchmarks/bench_alert_false_alarms.py --modes pooled_planned --add-to benchmarks/results/alert_false_alarms.json --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: small products, cores shared with others

import numpy as np
from scipy.stats import binom, false_discovery_control, norm

from tatblimp_callback.reading.data import load_benchmark
from tatblimp_callback.results import alert_budget, alert_windows
from tatblimp_callback.results.learning import _curve, fit_acquisition
from tatblimp_callback.results.regressions import DEFAULT_ALERT_Q, DEFAULT_MIN_DROP
from tatblimp_callback.results.stats import encode_outcomes, wilson_interval

NOISE_MODELS = ("redraw_all", "redraw_fifth", "drift")
MODES = ("pooled", "per_run", "per_evaluation", "pooled_planned")  # the last: pooled, the run's length planned
SCREEN = 100  # the margin of the normal approximation's screen (see the module's docstring)


def phenomenon_of_each_pair(data: str | None) -> tuple[str, ...]:
    try:
        return tuple(pair.phenomenon for pair in load_benchmark(data).pairs)
    except Exception:  # no benchmark file here: 16 phenomena of 78 pairs
        return tuple(f"phenomenon_{i // 78}" for i in range(1248))


def membership(phenomena) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(pairs x groups indicator, the phenomenon index of each pair, group names): group 0 is overall."""
    names = list(dict.fromkeys(phenomena))
    index = np.array([names.index(name) for name in phenomena])
    groups = np.zeros((len(phenomena), len(names) + 1), np.int32)
    groups[:, 0] = 1
    groups[np.arange(len(phenomena)), index + 1] = 1
    return groups, index, ["overall", *names]


class Monitors:
    """The modes' monitors over ``runs`` runs at once, fed one evaluation (runs x pairs booleans) at a time; the
    same rules as ``RegressionMonitor`` for outcomes that are all finite."""

    def __init__(self, groups, runs, planned, modes=MODES, alpha=DEFAULT_ALERT_Q, min_drop=DEFAULT_MIN_DROP, reserve=None):
        self.groups, self.alpha, self.min_drop, self.modes = groups, alpha, min_drop, modes
        self.planned = planned  # the planned comparisons of pooled_planned (the run's evaluations - 1)
        self.reserve = alert_budget.PLAN_RESERVE if reserve is None else reserve
        self.matrix = groups.astype(np.float32)  # float sums of 0/1 and small integers: exact, and on BLAS
        self.sizes = groups.sum(0)
        self.phenomenon = groups[:, 1:].argmax(1)
        self.evaluations = 0
        self.best_score = np.full((runs, groups.shape[1]), -1.0)
        self.best_phenomena = self.best_overall = None  # outcomes of each group's best
        self.recent: list[np.ndarray] = []  # the last evaluations, oldest first
        self.fallen = {mode: np.zeros((runs, groups.shape[1]), bool) for mode in modes}

    def _sum(self, values: np.ndarray) -> np.ndarray:
        return np.rint(values.astype(np.float32) @ self.matrix).astype(np.int64)

    def _counts(self, reference_phenomena, reference_overall, passed):
        b, c = self._sum(reference_phenomena & ~passed), self._sum(~reference_phenomena & passed)
        b[:, 0] = (reference_overall & ~passed).sum(1)
        c[:, 0] = (~reference_overall & passed).sum(1)
        return b, c

    def _window_p_values(self, w: int, lag: int, level: float) -> np.ndarray:
        """The exact p-values of the last w evaluations against the w that end ``lag`` before them (1.0 without the
        minimum drop, or where the normal screen puts it far above ``level``, the most an alert can need)."""
        shape = self.best_score.shape
        if len(self.recent) < 2 * w + lag:
            return np.ones(shape)
        reference = self.recent[-2 * w - lag :][:w]
        d = sum(e.astype(np.int8) for e in reference) - sum(e.astype(np.int8) for e in self.recent[-w:])
        statistic = self._sum(d)
        magnitudes = [self._sum(np.abs(d) == m) for m in range(1, w + 1)]
        squares = sum(m * m * count for m, count in enumerate(magnitudes, 1))
        z = statistic / np.sqrt(np.maximum(squares, 1))
        wanted = (statistic >= self.min_drop * w * self.sizes) & (norm.sf(z) <= SCREEN * level)
        p = np.ones(shape)
        for r, g in zip(*np.nonzero(wanted)):
            p[r, g] = alert_windows.sign_flip_p_value(tuple(int(m[r, g]) for m in magnitudes), int(statistic[r, g]))
        return p

    def observe(self, passed: np.ndarray) -> dict[str, np.ndarray]:
        """The alerts of this evaluation (runs x groups booleans) of each mode."""
        earlier, self.evaluations = self.evaluations, self.evaluations + 1
        alerts = {mode: np.zeros(self.best_score.shape, bool) for mode in self.modes}
        self.recent = [*self.recent[-alert_windows.KEPT + 1 :], passed]
        if earlier:
            b, c = self._counts(self.best_phenomena, self.best_overall, passed)
            drop = (b - c) / self.sizes
            p_best = np.where(drop >= self.min_drop, alert_budget.fall_p_value(b, c), 1.0)
            previous = self.recent[-2]
            bp, cp = self._counts(previous, previous, passed)
            p_previous = np.where((bp - cp) / self.sizes >= self.min_drop, alert_budget.fall_p_value(bp, cp), 1.0)
            share = alert_budget.look_share(earlier)
            if "per_run" in self.modes:
                q = alert_budget.run_q_values(alert_budget.group_p_value(p_previous, p_best, earlier), share)
                alerts["per_run"] = q <= self.alpha
            planned_share = alert_budget.planned_share(earlier, self.planned, self.reserve)
            shares = {"pooled": share, "pooled_planned": planned_share}
            shares = {mode: value for mode, value in shares.items() if mode in self.modes}
            if shares:
                level = self.alpha * max(shares.values())  # the screen's: the most that any alert could need
                weights, _ = alert_budget.pooled_weights(earlier)
                windows = [
                    p_previous if (w, lag) == (1, 0) else self._window_p_values(w, lag, weight * level)
                    for (w, lag), weight in zip(alert_windows.WINDOW_TESTS, weights)
                ]
                pooled = alert_budget.pooled_group_p_value(windows, p_best, earlier)
                for mode, value in shares.items():
                    alerts[mode] = alert_budget.run_q_values(pooled, value) <= self.alpha
            if "per_evaluation" in self.modes:
                two_sided = np.where(b == c, 1.0, np.minimum(1.0, 2 * binom.cdf(np.minimum(b, c), b + c, 0.5)))
                q_bh = false_discovery_control(np.minimum(1.0, two_sided * earlier), axis=-1, method="bh")
                alerts["per_evaluation"] = (q_bh < self.alpha) & (drop >= self.min_drop)
            for mode in self.modes:
                fallen = self.fallen[mode]
                alerts[mode] &= ~fallen
                self.fallen[mode] = np.where(fallen, drop >= self.min_drop / 2, alerts[mode])
        score = self._sum(passed) / self.sizes
        better = score > self.best_score
        self.best_score = np.where(better, score, self.best_score)
        if self.best_phenomena is None:
            self.best_phenomena, self.best_overall = passed.copy(), passed.copy()
        else:
            self.best_phenomena = np.where(better[:, 1:][:, self.phenomenon], passed, self.best_phenomena)
            self.best_overall = np.where(better[:, :1], passed, self.best_overall)
        return alerts


def simulate(groups, index, runs, evaluations, noise, rng, fall=None, modes=MODES) -> dict[str, np.ndarray]:
    """Each mode's alerts of ``runs`` runs (evaluations x runs x groups booleans). ``fall``: (group, at, to):
    that group (0: overall) falls at evaluation ``at`` to ``to`` times its mean, as the module's docstring says.
    ``pooled_planned`` plans the run's ``evaluations``."""
    n = groups.shape[0]
    base = rng.beta(7, 3, (runs, n))
    falling = np.ones(n, bool) if fall and fall[0] == 0 else None
    if fall and fall[0]:
        falling = groups[:, fall[0]].astype(bool)
        base[:, falling] = rng.beta(9, 1, (runs, int(falling.sum())))
    phase = rng.uniform(0, 2 * np.pi, (runs, groups.shape[1] - 1))
    logit = np.log(base / (1 - base))
    passed = rng.random((runs, n)) < base
    monitors = Monitors(groups, runs, evaluations - 1, modes)
    found = {mode: np.zeros((evaluations, runs, groups.shape[1]), bool) for mode in modes}
    for e in range(evaluations):
        if e:
            p = base
            if noise == "drift":
                p = 1 / (1 + np.exp(-(logit + 0.12 * np.sin(2 * np.pi * e / max(evaluations / 3, 6) + phase)[:, index])))
            kept = 1.0
            if fall and e >= fall[1]:
                kept = fall[2]
                p = np.where(falling, p * kept, p)
            again = rng.random((runs, n)) < (1.0 if noise == "redraw_all" else 0.2)
            if fall and e == fall[1]:  # the fall: passes turn into fails
                passed = np.where(falling & ~again, passed & (rng.random((runs, n)) < kept), passed)
            passed = np.where(again, rng.random((runs, n)) < p, passed)
        for mode, alerts in monitors.observe(passed).items():
            found[mode][e] = alerts
    return found


def rate(count: int, total: int) -> dict:
    low, high = wilson_interval(count, total)
    return {"count": int(count), "of": int(total), "rate": count / total, "interval": [low, high]}


def false_alarms(groups, index, runs, evaluations, noise, seed, chunk, modes=MODES) -> dict:
    rng = np.random.default_rng([seed, evaluations, NOISE_MODELS.index(noise)])
    alarmed = dict.fromkeys(modes, 0)
    evaluation_alarms = dict.fromkeys(modes, 0)
    for start in range(0, runs, chunk):
        found = simulate(groups, index, min(chunk, runs - start), evaluations, noise, rng, modes=modes)
        for mode in modes:
            alarmed[mode] += int(found[mode].any(axis=(0, 2)).sum())
            evaluation_alarms[mode] += int(found[mode].any(axis=2).sum())
    return {
        "noise": noise,
        "evaluations": evaluations,
        **{
            mode: {
                "runs_with_an_alert": rate(alarmed[mode], runs),
                "evaluations_with_an_alert": rate(evaluation_alarms[mode], runs * (evaluations - 1)),
            }
            for mode in modes
        },
    }


def detection(groups, index, names, runs, at, what, noise, seed, chunk, modes=MODES, after=3) -> dict:
    """Delays of the alert of a fall at evaluation ``at``: ``what`` is "0.5" or "0.7" (a phenomenon of 80 pairs
    from 0.90) or "overall -5" (every pair's pass probability scaled so that the overall mean loses 5 points)."""
    sizes = groups.sum(0)
    group = 0 if what == "overall -5" else int(np.flatnonzero(sizes[1:] == 80)[0]) + 1
    to = (1 - 0.05 / 0.7) if group == 0 else float(what) / 0.9
    rng = np.random.default_rng([seed, at, NOISE_MODELS.index(noise), group])
    delays = {mode: [] for mode in modes}
    for start in range(0, runs, chunk):
        found = simulate(groups, index, min(chunk, runs - start), at + after + 1, noise, rng, (group, at, to), modes)
        for mode in modes:
            alerted = found[mode][:, :, group]
            before = alerted[:at].any(0)
            first = np.where(alerted[at:].any(0), alerted[at:].argmax(0), -1)
            delays[mode] += [-2 if b else int(f) for b, f in zip(before, first)]  # -2: alerted before the fall
    out = {"fall": what, "group": names[group], "pairs": int(sizes[group]), "at": at, "noise": noise}
    for mode in modes:
        d = np.array(delays[mode])
        out[mode] = {
            "at_the_fall": rate(int((d == 0).sum()), runs),
            "within_2": rate(int(((d >= 0) & (d <= 2)).sum()), runs),
            f"missed_within_{after}": rate(int((d == -1).sum()), runs),
            "alerted_before": rate(int((d == -2).sum()), runs),
            "median_delay": float(np.median(np.where(d >= 0, d, after + 1))),
        }
    return out


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


def reusable(paths: list[str]) -> dict:
    """Figures an earlier run with the same code and seed printed (its JSON lines) or wrote (its --json file), by
    what they measure: each configuration has its own seeded generator, so a figure does not depend on the others."""
    found = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        try:
            whole = json.loads(text)
            rows = [*whole.get("false_alarms", []), *whole.get("detection", []), whole.get("coverage")]
        except json.JSONDecodeError:  # printed lines (a run stopped before the end)
            rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        for row in filter(None, rows):
            found[_key(row)] = row
    return found


def _key(row: dict) -> tuple:
    if "histories" in row:
        return ("coverage", row["histories"], row["pairs"])
    counts = next(row[mode] for mode in MODES if mode in row)
    if "fall" in row:
        return ("detection", row["fall"], row["noise"], row["at"], counts["at_the_fall"]["of"])
    return ("false_alarms", row["noise"], row["evaluations"], counts["runs_with_an_alert"]["of"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="null runs of each length and noise model")
    parser.add_argument("--runs-late", type=int, default=1000, help="null runs of 500 evaluations or more")
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 100, 500])
    parser.add_argument("--detection-runs", type=int, default=1000, help="runs of each fall (fewer for a fall at 500)")
    parser.add_argument("--detection-runs-late", type=int, default=1000, help="runs of each fall at the 500th evaluation")
    parser.add_argument("--noises", nargs="+", default=list(NOISE_MODELS), choices=NOISE_MODELS)
    parser.add_argument("--falls", nargs="+", default=["0.5", "0.7", "overall -5"], help="the falls detected")
    parser.add_argument("--no-false-alarms", action="store_true", help="the detection figures only")
    parser.add_argument("--no-detection", action="store_true", help="the false-alarm figures only")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="the modes measured")
    parser.add_argument("--reserve", type=float, help="pooled_planned's reserve (default: the package's)")
    parser.add_argument("--histories", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=78, help="pairs a phenomenon in the coverage histories")
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=250, help="runs simulated at once")
    parser.add_argument("--data", help="the benchmark file (its phenomena and their sizes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--reuse", nargs="+", default=[], help="take the figures of the same configuration from these earlier outputs"
    )
    parser.add_argument(
        "--add-to", help="an earlier --json file: its figures of the other modes are kept, row by row, beside these"
    )
    args = parser.parse_args()
    if args.reserve is not None:
        alert_budget.PLAN_RESERVE = args.reserve  # Monitors reads it (a measurement of the split, not a default)
    modes = tuple(args.modes)
    earlier = reusable(args.reuse)
    base = reusable([args.add_to]) if args.add_to else {}
    groups, index, names = membership(phenomenon_of_each_pair(args.data))
    start = time.perf_counter()
    figures = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "date": datetime.date.today().isoformat(),
        "load_before": os.getloadavg()[0],
        "settings": {
            "alert_q": DEFAULT_ALERT_Q,
            "min_drop": DEFAULT_MIN_DROP,
            "seed": args.seed,
            "pooled_window_tests": [list(test) for test in alert_windows.WINDOW_TESTS],
            "pooled_width_weights": list(alert_budget.WIDTH_WEIGHTS),
            "pooled_best_weight": alert_budget.BEST_WEIGHT,
            "planned_reserve": alert_budget.PLAN_RESERVE,
        },
        "modes_measured": list(modes),
        "false_alarms": [],
        "detection": [],
        "reused": [],
    }
    if args.add_to:
        with open(args.add_to, encoding="utf-8") as handle:
            old = json.load(handle)
        figures["other_modes_from"] = {
            "file": args.add_to,
            **{k: old.get(k) for k in ("date", "seconds", "machine", "load_before", "load_after")},
        }

    def measured(key, compute, *arguments):
        if key in earlier and all(mode in earlier[key] for mode in modes):
            figures["reused"].append(list(key))
            row = earlier[key]
        else:
            row = compute(*arguments)
            print(json.dumps(row), flush=True)
        return {**base.get(key, {}), **row}

    for noise in args.noises if not args.no_false_alarms else ():
        for length in args.lengths:
            runs = args.runs_late if length >= 500 else args.runs
            key = ("false_alarms", noise, length, runs)
            arguments = (groups, index, runs, length, noise, args.seed, args.chunk, modes)
            figures["false_alarms"].append(measured(key, false_alarms, *arguments))
    for noise in [noise for noise in args.noises if noise != "drift" and not args.no_detection]:
        for what in args.falls:
            for at in args.lengths:
                runs = args.detection_runs_late if at >= 500 else args.detection_runs
                key = ("detection", what, noise, at, runs)
                arguments = (groups, index, names, runs, at, what, noise, args.seed, args.chunk, modes)
                figures["detection"].append(measured(key, detection, *arguments))
    coverage_key = ("coverage", args.histories, args.pairs)
    if coverage_key in base:
        figures["coverage"] = base[coverage_key]
    elif args.histories:
        figures["coverage"] = measured(coverage_key, coverage, args.histories, args.pairs, args.bootstrap, args.seed)
    figures["seconds"] = time.perf_counter() - start
    figures["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
