"""Whether the row length changes what an evaluation costs on this machine: one fresh ``Scorer`` per row length.

For each shape (``bench_head_choice.SHAPES``: the same models and token ids), scorers at each row length, the
LM head forced to one method (so that only the rows differ), are warmed by a first evaluation, then timed
alternately (``--repeats`` rounds, best of each): longer rows mean fewer forward calls and more prefix sharing
in a tree row, but the attention mask's work grows with the square of the row. The large square matmul's
GFLOP/s and the load average are taken before and after, to say how much of the CPU the run had.

    python benchmarks/bench_row_length.py --json benchmarks/results/2026-12-02-cpu-row-length.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_head_choice import SHAPES, log, make_model, shape_cache, shape_tokenizers
from bench_scoring import machine_info, matmul_gflops

from tatblimp_callback import Scorer


def run_shape(name: str, tokenizers: dict, args, log) -> dict:
    vocab, hidden, layers, heads, *_ = SHAPES[name]
    cache = shape_cache(name, tokenizers)
    model = make_model(vocab, hidden, layers, heads)
    lengths = [int(n) for n in args.row_lengths.split(",")]
    scorers, row = {}, {"sentences": cache.num_sentences, "head_method": args.head_method, "row_lengths": {}}
    for length in lengths:
        scorer = Scorer(model, cache, row_length=length, head_method=args.head_method)
        start = time.perf_counter()
        scorer.score()
        layout = scorer.layout()
        scorers[length] = scorer
        row["row_lengths"][length] = {
            "first_evaluation_seconds": time.perf_counter() - start,
            "scoring_method": str(scorer.method),
            "forward_calls": len(layout.batches),
            "positions": layout.total_positions,
            "padded_positions": layout.padded_positions,
            "times": [],
        }
    for _ in range(args.repeats):  # alternated: a load on the machine falls on every row length alike
        for length in lengths:
            start = time.perf_counter()
            scorers[length].score()
            row["row_lengths"][length]["times"].append(time.perf_counter() - start)
            log(f"{name} row {length}: {row['row_lengths'][length]['times'][-1]:.2f} s")
    base = min(row["row_lengths"][256]["times"]) if 256 in lengths else None
    for length, r in row["row_lengths"].items():
        r["best_seconds"] = min(r["times"])
        r["over_256"] = r["best_seconds"] / base if base else None
        log(
            f"{name} row {length}: best {r['best_seconds']:.2f} s of {', '.join(f'{t:.2f}' for t in r['times'])} "
            f"({r['forward_calls']} forward calls, {r['positions']} positions, {r['padded_positions']} padding)"
        )
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4k-byte,48k", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--row-lengths", default="128,256,512,1024")
    parser.add_argument("--head-method", default="chunks:256", help="the LM head for every scorer (only the rows differ)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    names = args.shapes.split(",")
    tokenizers = shape_tokenizers(names)
    report = {
        **machine_info(torch.device("cpu")),
        "started_utc": time.strftime("%H:%M", time.gmtime()),
        "load_average_start": os.getloadavg(),
        "matmul_gflops_start": matmul_gflops(torch.device("cpu"), torch.float32, 10),
        "shapes": {},
    }
    for name in names:
        report["shapes"][name] = run_shape(name, tokenizers, args, log)
        if args.json:  # after each shape: a run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    report.update(
        finished_utc=time.strftime("%H:%M", time.gmtime()),
        load_average_end=os.getloadavg(),
        matmul_gflops_end=matmul_gflops(torch.device("cpu"), torch.float32, 10),
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
