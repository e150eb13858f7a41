"""The GPU targets in one call: evaluation time and memory, lm-eval in the same run, training overhead.

On the device machine (bf16, the 478M TATlit shape):

    python benchmarks/gpu_check.py --json $OUT/gpu_check.json

It measures, in one process:

1. one full TatBLiMP evaluation with ``tatblimp_callback.Scorer`` (after its one-time method
   check): min time over repeats and the peak extra memory (``max_memory_allocated`` delta); the LM
   head's method its first evaluation chose by timing (``head_choice.chosen``: each candidate's seconds
   per 1,000 contexts) and every candidate forced, a whole evaluation each (``head_choice.forced_seconds``); and
   the same on packed rows, for what the prefix-tree rows gain or cost on this device;
1b. the same evaluation four ways (issue #52, ``bench_graphs.py``): eager, CUDA graphs, compiled, compiled + graphs,
   each its best time, host time and kernel launches (``torch.profiler``) and its log-probs against eager's; one
   forward call against the calls the memory budget alone allows; from what count of evaluations the compile pays
   (``--skip-speed`` skips it; ``--speed-rows`` picks rows);
2. lm-evaluation-harness 0.4.13 ``HFLM.loglikelihood`` (batch size 64, float32 softmax) on the
   same sentences and model, its time, peak memory and per-sentence agreement with ours;
3. the engine's own costs (issue #31): the first call's plan and method check (in ``ours``), the host
   time of one evaluation (outside the model's forward and the head, device synchronised around them),
   the checks made at every evaluation that grow with the model's modules (``per_evaluation_checks_ms``), an
   evaluation on the CUDA graph path with replays that cost nothing (``graph_path_host``: its host time without the
   profiler's own cost per op, which part 1b's profiled figure carries), the model's body over tree rows with the
   boolean and the additive mask, rows of 128 and 512, and packed rows without a mask (each one's log-probs against
   the default's), and the attention alone with FlexAttention's block-sparse interval mask against SDPA's dense one
   (``--skip-masks`` skips these);
4. the overhead on training: ``--steps`` plain training steps (AdamW, random tokens), then the
   same number of steps with an evaluation every ``--steps // --evals`` steps; the time an
   evaluation adds, including any slowdown of the steps after it, over ``500 x step time`` is the
   overhead at one evaluation every 500 steps. It also reports whether scoring raised the
   training loop's peak memory.

4. with ``--vllm`` (vLLM installed): the same weights (saved before training) on ``backend="vllm"``: the
   engine's start, then its first and second evaluation apart, against ours per sentence; and
   lm-evaluation-harness's vLLM model type (``lm_eval.models.vllm_causallms.VLLM``) on the same sentences.
   ``--gpu-memory-utilization`` (default 0.5) is vLLM's share of the GPU.

For the card's largest models (not run here; each needs a node of GPUs), the same library command with
vLLM's tensor parallelism:

    tatblimp score meta-llama/Llama-4-Scout-17B-16E --backend vllm --dtype bfloat16 --tensor-parallel-size 8 --output scout.json
    tatblimp score openai/gpt-oss-120b --backend vllm --dtype auto --tensor-parallel-size 4 --output gpt-oss.json

(``--tensor-parallel-size 4`` for Llama-4-Scout on four 141 GB H200s too; ``results.json`` carries
``seconds`` and ``startup_seconds``.)

6. the harness model (issue #52): ``--model tatblimp`` against ``--model hf`` on multiple-choice requests of
   ``--mc-questions`` questions (``bench_lm_eval_model.py``; its text from ``--corpus``), the target at least 3x
   (``--skip-harness-mc`` skips it);
6b. the same requests scored with each context once and its choices after its KV cache, against the harness model's
   calls (``bench_context_cache.py``: host, body, head, the KV cache held; ``--skip-context-cache`` skips it): whether
   that design, which the CPU measured at about half the engine's host time, pays on the GPU.

It prints one JSON object (and writes it to ``--json``). A CPU smoke run of the same code:

    python benchmarks/gpu_check.py --device cpu --model-shape tiny --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scoring import (
    DTYPES,
    SHARED,
    LmEvalRunner,
    load_converted_tokenizer,
    make_model,
    measure_scorer,
    model_arguments,
    peak_extra_memory,
    synchronize,
    timed,
)

from tatblimp_callback import Scorer, ScoringMethod, build_cache, load_benchmark
from tatblimp_callback.engine.head_choice import candidates

TARGET_EVAL_SECONDS = 0.1
TARGET_SPEEDUP = 20.0
TARGET_OVERHEAD = 0.01
EVAL_EVERY = 500


def training_steps(model, optimizer, steps: int, batch: tuple[int, int], device, every: int = 0, scorer=None) -> float:
    """Seconds for ``steps`` training steps; with ``every``, a scoring call after every ``every``-th step."""
    vocab = model.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(1)
    synchronize(device)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        ids = torch.randint(0, vocab, batch, generator=generator).to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if every and step % every == 0:
            scorer.score()  # as the callback does: eval mode, no grad, back to train mode
    synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, shape="478m", device="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--repeats", type=int, default=5, help="timed evaluations (min is kept)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per timed loop")
    parser.add_argument("--evals", type=int, default=2, help="evaluations inside the second timed loop")
    parser.add_argument(
        "--train-batch", type=int, default=None, help="sequences per training step (default: 8 on a GPU, 2 on a CPU)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per training sequence (default: 2048 on a GPU, 128 on a CPU)"
    )
    parser.add_argument("--skip-lm-eval", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="4.: the same weights on backend='vllm', and lm-eval's vLLM model")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="with --vllm: vLLM's share of the GPU")
    parser.add_argument("--skip-masks", action="store_true", help="no host time, mask and FlexAttention comparisons")
    parser.add_argument("--skip-speed", action="store_true", help="1b.: no eager / graphs / compiled rows")
    parser.add_argument("--speed-rows", default="eager,graphs,compiled,compiled_graphs", help="1b.: which rows")
    parser.add_argument("--skip-precision", action="store_true", help="no bench_precision.py part (issue #54)")
    parser.add_argument("--skip-harness-mc", action="store_true", help="6.: no --model tatblimp against --model hf")
    parser.add_argument("--skip-context-cache", action="store_true", help="6b.: no bench_context_cache.py part")
    parser.add_argument("--corpus", type=Path, default=SHARED / "tatar-corpus" / "train.txt", help="6., 6b.: its text")
    parser.add_argument("--mc-questions", type=int, default=100, help="6.: questions of four choices")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    args.dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model_shape": args.model_shape,
        "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d"),
    }
    started = time.perf_counter()
    tokenizer = load_converted_tokenizer(args.tokenizer)
    benchmark = load_benchmark(args.data, allow_modified=True)
    cache = build_cache(tokenizer, benchmark, device=device)
    model = make_model(args.model_shape, len(tokenizer), device, dtype)
    tokens = sum(cache.lengths)
    full_logits = tokens * model.config.vocab_size * 4
    report.update(parameters=sum(p.numel() for p in model.parameters()), tokens=tokens, full_logits_bytes=full_logits)

    # 1. One evaluation.
    scorer = Scorer(model, cache)
    ours, report["ours"] = measure_scorer(scorer, device, args.repeats, full_logits)
    seconds, peak = report["ours"]["seconds"], report["ours"]["peak_extra_bytes"]

    # The LM head's method: what the first evaluation chose by timing, and each candidate forced, timed alike.
    report["head_choice"] = {"chosen": scorer.head_choice, "forced_seconds": {}, "max_abs_diff_vs_ours": {}}
    if scorer.head_method is not None:
        weight = scorer.lm.get_output_embeddings().weight
        largest = max(b.score_positions.numel() for b in scorer.layout().batches)
        for method in candidates(weight.device, weight.shape[0], weight.dtype, scorer.memory_budget, largest):
            forced = Scorer(model, cache, head_method=method)
            forced.score()  # its method check
            forced_scores, forced_seconds, _ = timed(forced.score, device, args.repeats)
            report["head_choice"]["forced_seconds"][str(method)] = forced_seconds
            report["head_choice"]["max_abs_diff_vs_ours"][str(method)] = float((forced_scores - ours).abs().max())
            del forced
    save(report, args.json)

    # The same evaluation on packed rows: what prefix trees gain (or cost, with sdpa's masked kernel) here.
    packed = Scorer(model, cache, method=ScoringMethod("packed", scorer.method.head))
    packed_scores, packed_seconds, _ = timed(packed.score, device, args.repeats)
    report["ours_packed_rows"] = {"seconds": packed_seconds, "max_abs_diff_vs_ours": float((packed_scores - ours).abs().max())}
    save(report, args.json)  # each part is kept as soon as it is measured, should a later one fail

    # 1b. Eager, CUDA graphs, compiled, compiled + graphs; one call against several (the rows that need CUDA skipped on a CPU).
    if not args.skip_speed:
        from bench_graphs import speed_rows

        report["speed"] = speed_rows(model, cache, device, args.repeats, args.speed_rows.split(","))
        save(report, args.json)

    # 2. lm-eval on the same model and sentences (optional: without it the rest is still measured).
    try:
        runner = None if args.skip_lm_eval else LmEvalRunner(model, tokenizer, batch_size=64)
    except ImportError as error:
        report["lm_eval"] = {"error": f"lm-eval could not be imported: {error}"}
        runner = None
    if runner is not None:
        sentences = [cache.sentence(s) for s in range(cache.num_sentences)]
        lm_scores, lm_seconds, _ = timed(lambda: runner(benchmark.sentences), device)
        lm_peak = peak_extra_memory(lambda: runner(benchmark.sentences), device)
        diff = (lm_scores - ours).abs()
        report["lm_eval"] = {
            "seconds": lm_seconds,
            "scoring_seconds": runner.scoring_seconds,
            "peak_extra_bytes": lm_peak,
            "same_token_ids": sum(a == b for a, b in zip(runner.token_requests, sentences)) == len(sentences),
            "max_abs_diff_vs_ours": float(diff.max()),
            "mean_abs_diff_vs_ours": float(diff.mean()),
            "ours_speedup": lm_seconds / seconds,
            "ours_speedup_vs_scoring_only": runner.scoring_seconds / seconds,
        }
        del runner

    save(report, args.json)
    folder = None
    if args.vllm:  # the weights as scored above, before training changes them
        import tempfile

        folder = tempfile.mkdtemp(prefix="tatblimp-gpu-check-vllm-")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    # 3. The engine's own costs: host time, the tree mask's options, FlexAttention.
    if not args.skip_masks:
        from bench_overhead import flex_against_sdpa, graph_path_host, host_seconds, mask_options, per_evaluation_checks

        # Without graphs: a replay calls no forward to time apart (part 1b's rows give each way's host time).
        eager = Scorer(model, cache, cuda_graphs=False)
        eager.score()
        report["host"] = host_seconds(eager, args.repeats)
        report["per_evaluation_checks_ms"] = per_evaluation_checks(model, args.repeats)
        # The graph path's host time without torch.profiler's own cost per op (part 1b's is profiled): replays free.
        report["graph_path_host"] = graph_path_host(model, cache, args.repeats)
        report["masks"] = mask_options(model, cache, args.repeats)
        save(report, args.json)
        try:
            report["flex"] = flex_against_sdpa(cache, model, args.repeats, dtype)
        except Exception as error:  # a compile failure is a finding, not the end of the run
            report["flex"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        save(report, args.json)

    # 4. Training overhead.
    model.train()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    on_gpu = device.type == "cuda"
    batch = (args.train_batch or (8 if on_gpu else 2), args.seq_len or (2048 if on_gpu else 128))
    training_steps(model, optimizer, 3, batch, device)  # warm-up: optimizer state, kernels
    # A scorer built now sees the memory left beside training, as the callback's would.
    train_scorer = Scorer(model, cache)
    train_scorer.score()  # its method check, outside the timed loops
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    plain = training_steps(model, optimizer, args.steps, batch, device)
    plain_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    every = max(1, args.steps // args.evals)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with_evals = training_steps(model, optimizer, args.steps, batch, device, every=every, scorer=train_scorer)
    evals_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    evaluations = args.steps // every
    step_seconds = plain / args.steps
    added = (with_evals - plain) / evaluations
    report["training"] = {
        "train_batch": list(batch),
        "steps": args.steps,
        "step_seconds": step_seconds,
        "evaluations_in_loop": evaluations,
        "seconds_added_per_evaluation": added,
        "train_scorer_memory_budget": train_scorer.memory_budget,
        "overhead_at_1_per_500_steps": added / (EVAL_EVERY * step_seconds),
        "overhead_from_eval_time": seconds / (EVAL_EVERY * step_seconds),
        "peak_bytes_training": plain_peak,
        "peak_bytes_training_with_evals": evals_peak,
    }

    report["targets"] = {
        "eval_seconds_at_most_0.1": seconds <= TARGET_EVAL_SECONDS,
        "speedup_vs_lm_eval_at_least_20": report.get("lm_eval", {}).get("ours_speedup", 0) >= TARGET_SPEEDUP,
        "overhead_at_most_1pct": max(report["training"]["overhead_at_1_per_500_steps"], 0) <= TARGET_OVERHEAD,
        "peak_at_most_eighth_of_full_logits": peak <= full_logits / 8,
        "host_at_most_20ms": report.get("host", {}).get("host_seconds", 1.0) <= 0.02,
        "graph_path_host_at_most_2ms": report.get("graph_path_host", {}).get("seconds", 1.0) <= 0.002,
        **speed_targets(report.get("speed", {}).get("rows", {}), report.get("lm_eval", {}).get("seconds")),
    }
    if folder is not None:
        del model, optimizer, scorer, packed, train_scorer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["vllm"] = vllm_part(folder, tokenizer, benchmark, ours, args)
        save(report, args.json)
    if not args.skip_precision:  # 5. precision: time, rescored share and flips vs float32 (bench_precision.py, issue #54)
        from bench_precision import main as bench_precision

        options = ["--device", args.device, "--model-shape", args.model_shape, "--data", str(args.data)]
        report["precision"] = bench_precision([*options, "--tokenizer", str(args.tokenizer)])
        save(report, args.json)
    if not args.skip_harness_mc:
        report["harness_mc"] = harness_mc(args)
        report["targets"]["harness_mc_at_least_3x_hf"] = report["harness_mc"].get("speedup", 0) >= 3
        save(report, args.json)
    if not args.skip_context_cache:
        report["context_cache"] = context_cache(args)
    report["wall_seconds"] = time.perf_counter() - started
    save(report, args.json)
    print(json.dumps(report, indent=2))
    return report


def harness_mc(args) -> dict:
    """6.: ``--model tatblimp`` against ``--model hf`` on multiple-choice requests (``bench_lm_eval_model.py``: 150-word
    contexts, four endings; the model's shape in the device's dtype), issue #52's target at least 3x; without lm-eval
    the error is recorded."""
    from bench_lm_eval_model import main as bench_lm_eval_model

    options = ["--device", args.device, "--shape", args.model_shape, "--tasks", "mc", "--rounds", "2"]
    options += ["--mc-questions", str(args.mc_questions), "--tokenizer", str(args.tokenizer), "--corpus", str(args.corpus)]
    try:
        return bench_lm_eval_model(options)["mc"]
    except ImportError as error:
        return {"error": f"lm-eval could not be imported: {error}"}


def context_cache(args) -> dict:
    """6b.: the harness model's calls against contexts once and their choices after their KV cache
    (``bench_context_cache.py``) on the same multiple-choice requests: host, body, head, KV held; without lm-eval the
    error is recorded."""
    from bench_context_cache import main as bench_context_cache

    options = ["--device", args.device, "--shape", args.model_shape, "--requests", str(4 * args.mc_questions)]
    options += ["--rounds", "2", "--tokenizer", str(args.tokenizer), "--corpus", str(args.corpus)]
    try:
        return bench_context_cache(options)
    except ImportError as error:
        return {"error": f"lm-eval could not be imported: {error}"}
    except Exception as error:  # a prototype's measure: its failure is recorded, never the whole call's
        return {"error": f"{type(error).__name__}: {error}"}


def vllm_part(folder: str, tokenizer, benchmark, ours: torch.Tensor, args) -> dict:
    """4.: ``backend="vllm"`` on the saved weights (start, first and second evaluation), and lm-eval's vLLM model."""
    try:
        from bench_vllm import compare, run_lm_eval, sentence_logprobs

        from tatblimp_callback import Evaluator
        from tatblimp_callback.engine.vllm_scoring import VllmOptions, import_vllm

        import_vllm()
    except ImportError as error:
        return {"error": f"vLLM could not be imported: {error}"}
    options = VllmOptions(dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization)
    evaluator = Evaluator(tokenizer, benchmark, backend="vllm", vllm_options=options)
    first, second = evaluator(folder), evaluator(folder)
    part = {
        "startup_seconds": first.run_info["startup_seconds"],
        "first_seconds": first.run_info["seconds"],
        "seconds": second.run_info["seconds"],
        **compare(sentence_logprobs(second), ours),
    }
    max_model_len = evaluator._scorer.llm.llm_engine.model_config.max_model_len
    evaluator._scorer.close()
    if not args.skip_lm_eval:
        try:
            lm_eval = run_lm_eval(folder, benchmark.sentences, max_model_len, args.dtype)
        except Exception as error:  # lm-eval's vLLM model missing or failing: the rest is still reported
            part["lm_eval_vllm"] = {"error": f"{type(error).__name__}: {error}"}
        else:
            values = lm_eval.pop("values")
            part["lm_eval_vllm"] = {**lm_eval, **compare(values, ours)}
    return part


def speed_targets(rows: dict, lm_eval_seconds: float | None) -> dict:
    """Issue #52's targets (H200, 478M, bf16): graphs at most 50 ms, compiled + graphs 40 ms, host 2 ms, 40x HFLM."""
    graphs, compiled = rows.get("graphs", {}), rows.get("compiled_graphs", {})
    best = min((r["seconds"] for r in (graphs, compiled) if "seconds" in r), default=None)
    return {
        "graphs_eval_at_most_50ms": graphs.get("seconds", 1.0) <= 0.05,
        "compiled_graphs_eval_at_most_40ms": compiled.get("seconds", 1.0) <= 0.04,
        "graphs_host_at_most_2ms": graphs.get("profile", {}).get("host_seconds", 1.0) <= 0.002,
        "graphs_bitwise_equal_to_eager": graphs.get("bitwise_equal_to_eager", False),
        "speedup_vs_lm_eval_at_least_40": bool(best and lm_eval_seconds and lm_eval_seconds / best >= 40),
    }


def save(report: dict, path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
