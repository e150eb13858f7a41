"""One in-loop evaluation with harness tasks: TatBLiMP and a BLiMP subset in one fused pass, against today's way before
it (TatBLiMP's pass, then the harness's own ``evaluate`` with ``--model tatblimp``, which builds, encodes and scores
the requests again in a pass of their own).

Both score one randomly initialised Llama (``bench_scoring.SHAPES``) with the shared 48K SentencePiece tokenizer on
TatBLiMP (1,248 pairs) and the harness task ``local_blimp`` (three BLiMP files, ``--blimp-docs`` pairs: two
requests each), or with ``--tasks local_mc`` multiple-choice questions whose four endings share a long context
(``--mc-questions``, ``--mc-context-words``). The first evaluation of each way (the method check, the encoding) is
left out; then each way's evaluation is timed ``--rounds`` times, alternated so that a shared machine's load falls on
both, and the best kept.
The metrics of both ways are compared.

    python benchmarks/bench_harness_in_loop.py --shape tiny --json benchmarks/results/harness-in-loop-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from bench_scoring import SHAPES, load_converted_tokenizer, machine_info, make_model  # noqa: E402

from harness_tasks import write_tasks  # noqa: E402

SHARED = Path(os.environ.get("TATBLIMP_SHARED", REPO.parent / "shared"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--blimp-docs", type=int, default=300)
    parser.add_argument("--tasks", default="local_blimp", help="local_blimp, local_mc or both (comma-separated)")
    parser.add_argument("--mc-questions", type=int, default=40, help="local_mc's questions")
    parser.add_argument("--mc-context-words", type=int, default=0, help="local_mc's context words (0: half a line)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from lm_eval.evaluator import evaluate

    from tatblimp_callback import Evaluator
    from tatblimp_callback.harness.in_training import HarnessTasks, flat_metrics

    data = SHARED / "tatblimp" / "test.jsonl"
    tokenizer = load_converted_tokenizer(SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    device = torch.device("cpu")
    model = make_model(args.shape, len(tokenizer), device, torch.float32)
    tasks = write_tasks(
        Path(tempfile.mkdtemp(prefix="tatblimp-bench-tasks-")),
        SHARED / "blimp" / "data",
        SHARED / "tatar-corpus" / "train.txt",
        questions=args.mc_questions,
        context_words=args.mc_context_words,
    )
    names, limit = args.tasks.split(","), args.blimp_docs

    harness = HarnessTasks(names, tokenizer, include_path=str(tasks), limit=limit)
    start = time.perf_counter()
    spans = harness.prepare(model)
    prepare_seconds = time.perf_counter() - start
    fused = Evaluator(tokenizer, data, spans=spans)
    separate = Evaluator(tokenizer, data)
    today = HarnessTasks(names, tokenizer, include_path=str(tasks), limit=limit)

    def fused_way():
        results = fused(model)
        return results, harness.metrics(fused.span_scores)

    def separate_way():  # the code of main before the fused pass: the harness's evaluate with --model tatblimp
        results = separate(model)
        out = evaluate(today._model_for(model), today.manager.load(names), limit=limit, bootstrap_iters=0, log_samples=False)
        return results, flat_metrics(out["results"])

    first = {}
    for name, way in (("fused", fused_way), ("separate", separate_way)):
        start = time.perf_counter()
        first[name] = (way(), time.perf_counter() - start)
    times = {"fused": [], "separate": []}
    for _ in range(args.rounds):
        for name, way in (("fused", fused_way), ("separate", separate_way)):
            start = time.perf_counter()
            out = way()
            times[name].append(time.perf_counter() - start)
            first[name] = (out, first[name][1])
    (fused_results, fused_metrics), _ = first["fused"]
    plan = fused._scorer.layout()
    (separate_results, separate_metrics), _ = first["separate"]
    report = {
        "shape": args.shape,
        "tatblimp_pairs": len(fused_results.pairs),
        "harness_requests": len(spans),
        # The fused pass's plan: rows as wide as the largest question's tree (a question's choices in one row).
        "fused_plan": {
            "row_length": fused._scorer.row_length,
            "positions": plan.total_positions,
            "rows": plan.batches.rows.num_rows,
            "forward_calls": len(plan.batches),
        },
        "prepare_seconds": prepare_seconds,
        "first_call_seconds": {name: value[1] for name, value in first.items()},
        "seconds": times,
        "best": {name: min(values) for name, values in times.items()},
        "speedup": min(times["separate"]) / min(times["fused"]),
        "metrics": {"fused": fused_metrics, "separate": separate_metrics},
        "largest_metric_difference": max(abs(fused_metrics[k] - separate_metrics[k]) for k in separate_metrics),
        "tatblimp_acc_norm": {"fused": fused_results.acc_norm, "separate": separate_results.acc_norm},
        "machine": machine_info(device),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "metrics"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
