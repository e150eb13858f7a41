"""One evaluation four ways (issue #52): eager, CUDA graphs, compiled, compiled + graphs; and one call against several.

Each row is a fresh ``Scorer`` on the same model and cache, run to its steady state (the first call: method check
and head timing; the second: the graphs' capture, or the compile's first shapes), then timed: the best of
``repeats`` evaluations, their host time and kernel launches (``torch.profiler``, one evaluation), and its
log-probs against the eager row's (graph replays bit for bit; the compiled body within the method check's
tolerance). ``calls`` compares the default sizing of the forward calls (one call where a quarter of the free GPU
memory holds every position, ``memory_budget.one_call_budget``) with the calls the memory budget alone allowed
before (three for the 478M shape on an H200). On a CPU the rows that need CUDA are skipped with the reason.

Run by ``gpu_check.py`` (part 1b); alone:

    python benchmarks/bench_graphs.py --device cpu --model-shape 1.5m --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scoring import DTYPES, load_converted_tokenizer, make_model, model_arguments, synchronize, timed

from tatblimp_callback import Scorer, build_cache, load_benchmark

ROWS = {  # name -> Scorer options
    "eager": {"cuda_graphs": False},
    "graphs": {"cuda_graphs": True},
    "compiled": {"cuda_graphs": False, "compile": True},
    "compiled_graphs": {"cuda_graphs": True, "compile": True},
}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def profiled(scorer: Scorer, device: torch.device) -> dict:
    """One evaluation under ``torch.profiler``: kernel launches (graph launches apart), the time the host spent
    waiting for the device (synchronisations and copies), and the host time: the evaluation's wall time less that."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        scorer.score()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCHES and e.key != "cudaGraphLaunch")
    graph_launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    waiting = sum(e.self_cpu_time_total for e in events if e.key in SYNCS) / 1e6
    return {
        "kernel_launches": launches,
        "graph_launches": graph_launches,
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "seconds_under_profiler": wall,
        "waiting_for_device_seconds": waiting,
        "host_seconds": wall - waiting,
    }


def run_row(model, cache, device: torch.device, repeats: int, reference: torch.Tensor | None, **options) -> tuple:
    scorer = Scorer(model, cache, **options)
    first = timed(scorer.score, device)[1]
    second = timed(scorer.score, device)[1]  # the graphs' capture (from the plan's second evaluation)
    scores, seconds, times = timed(scorer.score, device, repeats)
    row = {
        "seconds": seconds,
        "times": times,
        "first_call_seconds": first,
        "second_call_seconds": second,
        "scoring_method": str(scorer.method),
        "head_method": str(scorer.head_method),
        "forward_calls": len(scorer.layout().batches),
        "memory_budget": scorer.memory_budget,
        "call_budget": scorer.call_budget,
        "graphs": {"captures": scorer.graphs.captures, "replays": scorer.graphs.replays, "reason": scorer.graphs.reason},
        "compiled": {"enabled": scorer.compiled.enabled, "calls": scorer.compiled.calls, "reason": scorer.compiled.reason},
        "profile": profiled(scorer, device),
    }
    if reference is not None:
        row["max_abs_diff_vs_eager"] = float((scores - reference).abs().max())
        row["bitwise_equal_to_eager"] = bool(torch.equal(scores, reference))
    return scores, row


def speed_rows(model, cache, device: torch.device, repeats: int = 5, rows=tuple(ROWS)) -> dict:
    """The rows of ``ROWS`` (those that can run on ``device``), ``calls``, and what the compile pays back."""
    report: dict = {"rows": {}, "skipped": {}}
    eager = None
    for name in rows:
        options = ROWS[name]
        if options["cuda_graphs"] and device.type != "cuda":
            report["skipped"][name] = f"CUDA graphs need a CUDA device (this run: {device.type})"
            continue
        if options.get("compile"):
            torch._dynamo.reset()  # each compiled row starts from nothing, as a new process would
        try:
            scores, report["rows"][name] = run_row(model, cache, device, repeats, eager, **options)
        except Exception as error:  # a row that fails is a finding; the others are still measured
            report["rows"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            continue
        eager = scores if name == "eager" else eager
    # One call where memory allows (the default now) against the calls the memory budget alone allows.
    if "eager" in report["rows"] and "seconds" in report["rows"]["eager"]:
        budget = report["rows"]["eager"]["memory_budget"]
        _, by_budget = run_row(model, cache, device, repeats, eager, cuda_graphs=False, memory_budget=budget)
        report["calls"] = {
            "default": {k: report["rows"]["eager"][k] for k in ("forward_calls", "seconds", "call_budget")},
            "by_memory_budget": {k: by_budget[k] for k in ("forward_calls", "seconds", "max_abs_diff_vs_eager")},
        }
        if device.type == "cuda":  # with graphs, where launches cost nothing, do fewer calls still help?
            _, graphs = run_row(model, cache, device, repeats, eager, memory_budget=budget)
            report["calls"]["by_memory_budget_graphs"] = {k: graphs[k] for k in ("forward_calls", "seconds")}
    report["compile_pays_after_evaluations"] = compile_break_even(report["rows"])
    return report


def compile_break_even(rows: dict) -> dict | None:
    """From what count of evaluations the compile's first calls are paid back by its faster evaluations: compiled +
    graphs against graphs where both ran, else compiled against eager."""
    pairs = [("compiled_graphs", "graphs"), ("compiled", "eager")]
    for compiled, base in pairs:
        if "seconds" in rows.get(compiled, {}) and "seconds" in rows.get(base, {}):
            c, b = rows[compiled], rows[base]
            extra = c["first_call_seconds"] + c["second_call_seconds"] - b["first_call_seconds"] - b["second_call_seconds"]
            saved = b["seconds"] - c["seconds"]
            return {
                "rows": [compiled, base],
                "first_calls_extra_seconds": extra,
                "saved_per_evaluation_seconds": saved,
                "evaluations": max(extra, 0.0) / saved if saved > 0 else None,  # 0: it pays at once
            }
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, shape="1.5m", device="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    tokenizer = load_converted_tokenizer(args.tokenizer)
    cache = build_cache(tokenizer, load_benchmark(args.data, allow_modified=True), device=device)
    model = make_model(args.model_shape, len(tokenizer), device, dtype)
    report = {"device": str(device), "model_shape": args.model_shape, "date": time.strftime("%Y-%m-%d")}
    report.update(speed_rows(model, cache, device, args.repeats, args.rows.split(",")))
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
