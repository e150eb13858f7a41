"""How long the command takes to answer ``--version`` and ``--help``: wall time of whole processes.

    python benchmarks/bench_startup.py [--runs 10] [--baseline OTHER_CHECKOUT]

Each case is ``python -m tatblimp_callback ARGS`` in a fresh process with this checkout first on ``PYTHONPATH``
(run in that checkout, as ``-m`` puts the working directory first; with ``--baseline``, another checkout's ``--version`` too, the runs interleaved so that both see the same load).
Prints the median, minimum and maximum per case, the modules the process loaded of torch and transformers, and
the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = (["--version"], ["--help"], ["score", "--help"], ["sweep", "--help"], ["report", "--help"])
LOADED = "import runpy, sys; sys.argv = ['tatblimp', *sys.argv[1:]]\ntry: runpy.run_module('tatblimp_callback', run_name='__main__')\nexcept SystemExit: pass\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)"


def seconds(root: Path, arguments: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tatblimp_callback", *arguments], env=env, cwd=root, stdout=subprocess.DEVNULL, check=True
    )
    return time.perf_counter() - start


def heavy_modules(root: Path, arguments: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    completed = subprocess.run(
        [sys.executable, "-c", LOADED, *arguments], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    return completed.stderr.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--baseline", type=Path, help="another checkout, whose --version is timed in the same runs")
    args = parser.parse_args()
    times: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for case in CASES:
            times.setdefault(" ".join(case), []).append(seconds(REPO, case))
        if args.baseline:
            times.setdefault("--version (baseline)", []).append(seconds(args.baseline, ["--version"]))
    for name, values in times.items():
        print(
            f"{name:22} median {statistics.median(values):.3f} s  min {min(values):.3f}  max {max(values):.3f}  (n={len(values)})"
        )
    for case in (["--version"], ["score", "--help"]):
        print(f"{' '.join(case):22} loads of torch, transformers: {heavy_modules(REPO, case)}")
    if args.baseline:
        print(f"{'--version (baseline)':22} loads of torch, transformers: {heavy_modules(args.baseline, ['--version'])}")
    print("load average (1, 5, 15 min):", ", ".join(f"{x:.1f}" for x in os.getloadavg()), f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
