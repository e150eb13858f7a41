"""Where one warmed-up evaluation's time goes: a cProfile of ``Scorer.score()`` on one of ``bench_head_choice``'s shapes.

The scorer's first evaluation (which chooses the head's method) runs unprofiled; the second runs under
cProfile. The split printed and written: the body (``model_output``), the head (``method_logprobs``), writing the
cells, the rest; and the calls of torch that took longest (the matmuls, attention, ``log_softmax``), by their own time.

    python benchmarks/profile_evaluation.py --shape 48k --json benchmarks/results/2026-12-02-cpu-profile-48k.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_head_choice import SHAPES, byte_level_tokenizer, make_model, shape_cache
from bench_scoring import SHARED, load_converted_tokenizer, machine_info, matmul_gflops

from tatblimp_callback import Scorer

SPLIT = {"body": ("forward.py", "model_output"), "head": ("head_choice.py", "method_logprobs"), "cells": ("cells.py", "write")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="48k", help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    vocab, hidden, layers, heads, _, byte_level, _ = SHAPES[args.shape]
    if byte_level:
        tokenizers = {"byte": byte_level_tokenizer(4096)}
    else:
        tokenizers = {"spm": load_converted_tokenizer(SHARED / "tokenizers" / "kypchak_unigram_48k.model")}
    cache = shape_cache(args.shape, tokenizers)
    scorer = Scorer(make_model(vocab, hidden, layers, heads), cache)
    scorer.score()  # the first evaluation: the method check and the head's choice
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(scorer.score)
    seconds = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    cumulative = {part: 0.0 for part in SPLIT}
    for (file, _, function), (_, _, _, cum, _) in stats.items():
        for part, name in SPLIT.items():
            if (Path(file).name, function) == name:
                cumulative[part] += cum
    cumulative["other"] = seconds - sum(cumulative.values())  # laying out the batches read, the reduction, Python
    own = sorted(((tt, f"{Path(f).name}:{function}") for (f, _, function), (_, _, tt, _, _) in stats.items()), reverse=True)
    report = {
        **machine_info(torch.device("cpu")),
        "shape": args.shape,
        "head_method": str(scorer.head_method),
        "head_choice": scorer.head_choice,
        "load_average": os.getloadavg(),
        "matmul_gflops": matmul_gflops(torch.device("cpu"), torch.float32, 3),
        "profiled_seconds": seconds,
        "cumulative_seconds": cumulative,
        "own_seconds": [{"function": name, "seconds": tt} for tt, name in own[: args.top]],
    }
    print(f"{args.shape}: head {report['head_method']}, one evaluation {seconds:.2f} s under cProfile")
    for part, value in cumulative.items():
        print(f"  {part:5} {value:7.2f} s ({value / seconds:.0%})")
    for entry in report["own_seconds"]:
        print(f"  {entry['seconds']:7.2f} s  {entry['function']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
