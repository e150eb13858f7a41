"""How fast ``tatblimp sweep`` gets through a run's checkpoints with one and with several processes.

It saves ``--checkpoints`` randomly initialised Llamas (``bench_scoring.SHAPES``, the 48K
SentencePiece tokenizer as transformers converts it) as ``checkpoint-<step>`` folders, then, for each
process count in ``--processes``, sweeps a fresh copy of the run under ``torchrun --nproc-per-node N``
over the whole benchmark and reports:

- checkpoints per minute, of the launch's wall time (process start, imports, loading, scoring) and of
  the sweep alone (process 0's time inside ``sweep()``);
- the peak resident memory of each process (``ru_maxrss``).

On a CPU each process gets ``cores / N`` threads (``--threads`` to fix it). The sweep's file is checked: each checkpoint once.

    python benchmarks/bench_sweep.py --checkpoints 4 --processes 1 2 --json bench_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))


def make_run(folder: Path, checkpoints: int, shape: str, spm_model: Path) -> None:
    """``checkpoints`` checkpoints of one shape, each with its weights, tokenizer and trainer_state.json."""
    import torch
    from bench_scoring import load_converted_tokenizer, make_model

    tokenizer = load_converted_tokenizer(spm_model)
    for index in range(checkpoints):
        step = 100 * (index + 1)
        checkpoint = folder / f"checkpoint-{step}"
        make_model(shape, len(tokenizer), torch.device("cpu"), torch.float32, seed=step).save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def worker(run_dir: str, data: str, out_dir: str) -> None:
    """One process of the launch: sweep, then write its time in ``sweep()`` and its peak memory."""
    from tatblimp_callback.commands.sweep import SweepOptions, sweep

    start = time.perf_counter()
    report = sweep(run_dir, SweepOptions(data=data, allow_modified=True, progress=False))
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", 0))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    record = {"rank": rank, "sweep_seconds": seconds, "peak_rss_mib": round(peak_mib), "scored": len(report.scored)}
    if not report.scored:
        raise RuntimeError("the sweep scored nothing")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def launch(processes: int, run_dir: Path, data: Path, out_dir: Path, threads: int | None = None) -> dict:
    threads = threads or max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(processes)]
    command = [*torchrun, __file__, "--worker", str(run_dir), str(data), str(out_dir)]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    ranks = sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    lines = [json.loads(line) for line in (run_dir / "tatblimp.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    if steps != sorted(set(steps)):
        raise RuntimeError(f"{processes} processes: the results file holds steps {steps}, not each once in order")
    return {
        "processes": processes,
        "threads_per_process": threads,
        "checkpoints": len(lines),
        "wall_seconds": round(wall, 1),
        "checkpoints_per_minute_wall": round(60 * len(lines) / wall, 2),
        "sweep_seconds": round(ranks[0]["sweep_seconds"], 1),
        "checkpoints_per_minute_sweep": round(60 * len(lines) / ranks[0]["sweep_seconds"], 2),
        "peak_rss_mib_per_process": [r["peak_rss_mib"] for r in ranks],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED / "tatblimp" / "test.jsonl", help="TatBLiMP test.jsonl")
    parser.add_argument("--spm-model", type=Path, default=SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    parser.add_argument("--model-shape", default="tiny", help="a shape of bench_scoring.SHAPES")
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, help="threads per process (default: cores / processes)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--worker", nargs=3, metavar=("RUN_DIR", "DATA", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return {}

    import torch

    with tempfile.TemporaryDirectory(prefix="tatblimp-bench-sweep-") as tmp:
        template = Path(tmp) / "template"
        make_run(template, args.checkpoints, args.model_shape, args.spm_model)
        runs = []
        for processes in args.processes:
            run_dir, out_dir = Path(tmp) / f"run-{processes}", Path(tmp) / f"out-{processes}"
            shutil.copytree(template, run_dir)
            out_dir.mkdir()
            runs.append(launch(processes, run_dir, args.data, out_dir, args.threads))
            print(json.dumps(runs[-1]))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "model_shape": args.model_shape,
        "runs": runs,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
