"""How fast, and in how much memory, TatBLiMP is scored: this scorer against a naive loop and lm-eval.

In one process and one run, on one randomly initialised Llama, it times

  (a) a naive loop: one sentence a forward, full log-softmax over the vocabulary;
  (b) lm-evaluation-harness 0.4.13 ``HFLM.loglikelihood`` on the same 2,496 sentences with an
      empty context (batch size 64; ``pip install -e .[bench]``);
  (c) ``tatblimp_callback.Scorer``, after its method check, over a second call;

and measures the machine's floor, floor = body forward (measured) + LM-head matmul at the measured
throughput of a large square matmul + one softmax pass over the logits (``F.cross_entropy``, the
faster of a cache-sized and a large chunk, measured), twice:

- for every scored token (the workload as peers do it: body over packed rows, head on every
  position);
- for the distinct contexts only (the work this scorer does: body over prefix-tree rows, head on
  each distinct context once).

Per-sentence log-probs of (a), (b) and (c) are compared on the same token ids, so the comparison
is honest.

The tokenizer is the 48K SentencePiece model converted by transformers (``LlamaTokenizer`` on a
folder holding it as ``tokenizer.model``): the tokenizer lm-eval would load.

    python benchmarks/bench_scoring.py --model-shape tiny --json bench_tiny.json

``--suites``: TatBLiMP with 16,000 and with all 66,993 scorable pairs of BLiMP in one fused evaluation,
against lm-eval on the same sentences (see ``bench_suites.py``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from tatblimp_callback import Scorer, build_cache, load_benchmark  # noqa: E402

SHAPES = {
    # 1.5M parameters, nearly all the tied 48K x 32 embedding: the suites mode's model
    "1.5m": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # about 15M parameters, 12.3M of them the tied 48K x 256 embedding
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12),
    # the shape of TATlit (478M with the tied 48K embedding)
    "478m": dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- setup ------------------------------------------------------------------------------------------


def model_arguments(parser, shape: str, device: str) -> None:
    """The options every benchmark of one model shares: the benchmark file, the tokenizer, the shape, the device."""
    parser.add_argument("--data", type=Path, default=SHARED / "tatblimp" / "test.jsonl")
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default=shape)
    parser.add_argument("--device", default=device)


def load_converted_tokenizer(spm_model: Path):
    """The SentencePiece model as transformers (and so lm-eval) loads it from a model folder."""
    from transformers import LlamaTokenizer

    folder = tempfile.mkdtemp(prefix="tatblimp-bench-tok-")
    try:
        shutil.copy(spm_model, os.path.join(folder, "tokenizer.model"))
        return LlamaTokenizer.from_pretrained(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def make_model(shape: str, vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised Llama of the given shape, tied embeddings, sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        # Wider than the default 0.02 so that log-probs differ clearly between tokens.
        initializer_range=0.1,
        attn_implementation="sdpa",
        **SHAPES[shape],
    )
    with torch.device(device):  # initialised where it runs: a 478M model initialises in seconds on a GPU
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 1):
    """(result of the last call, min seconds over ``repeats`` calls, all times)."""
    times, result = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return result, min(times), times


def peak_extra_memory(fn, device: torch.device) -> int:
    """Peak bytes allocated by ``fn`` above what was allocated before it (tensors only).

    CUDA: ``max_memory_allocated`` delta. CPU: the running sum of the allocation events that the
    PyTorch profiler records for the CPU allocator.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    return peak


# -- the three scorers ------------------------------------------------------------------------------


def measure_scorer(scorer: Scorer, device: torch.device, repeats: int, full_logits_bytes: int) -> tuple[torch.Tensor, dict]:
    """Its scores and a report: the first call (with the method check), the best of ``repeats`` calls,
    one call's peak extra memory, and the layout it used."""
    _, first_seconds, _ = timed(scorer.score, device)
    first_setup = dict(scorer.setup_seconds)  # the plan's and the method check's share of the first call
    scores, seconds, times = timed(scorer.score, device, repeats)
    peak = peak_extra_memory(scorer.score, device)
    layout = scorer.layout()
    return scores, {
        "seconds": seconds,
        "times": times,
        "first_call_seconds": first_seconds,
        "first_call_plan_seconds": first_setup["plan"],
        "first_call_method_check_seconds": first_setup["method_check"],
        "plan_bytes": layout.plan_bytes,
        "scoring_method": str(scorer.method),
        "padding_share": layout.padding_share,
        "saved_by_prefix_sharing": layout.saved_by_prefix_sharing,
        "distinct_contexts": sum(b.score_positions.numel() for b in layout.batches),
        "forward_calls": len(layout.batches),
        "head_tile": scorer.head_tile,
        "memory_budget": scorer.memory_budget,
        "peak_extra_bytes": peak,
        "peak_fraction_of_full_logits": peak / full_logits_bytes,
    }


@torch.no_grad()
def naive_scores(model, sentences: list[list[int]], device: torch.device) -> torch.Tensor:
    """One sentence a forward, the model's full logits, float32 log-softmax, gather."""
    results = []
    for ids in sentences:
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        results.append(logits.log_softmax(-1).gather(-1, x[0, 1:, None]).sum())
    return torch.stack(results).double().cpu()


class LmEvalRunner:
    """lm-eval's ``HFLM.loglikelihood`` on sentences with an empty context, timed from inside.

    Wrapping ``_loglikelihood_tokens`` records the token ids lm-eval scores and the time it spends
    after tokenizing (the part comparable to a scorer whose tokenization is cached).
    """

    def __init__(self, model, tokenizer, batch_size: int):
        from lm_eval.models.huggingface import HFLM

        self.version = importlib.metadata.version("lm-eval")
        # softmax_dtype float32: exact scores for a half-precision model, as ours are.
        self.lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32)
        self.token_requests: list[list[int]] = []
        self.scoring_seconds = 0.0
        inner = self.lm._loglikelihood_tokens

        def recorded(requests, *args, **kwargs):
            self.token_requests = [list(context) + list(continuation) for _, context, continuation in requests]
            synchronize(model.device)
            start = time.perf_counter()
            result = inner(requests, *args, **kwargs)
            synchronize(model.device)
            self.scoring_seconds = time.perf_counter() - start
            return result

        self.lm._loglikelihood_tokens = recorded

    def __call__(self, texts: list[str]) -> torch.Tensor:
        from lm_eval.api.instance import Instance

        requests = [Instance("loglikelihood", doc={}, arguments=("", text), idx=i) for i, text in enumerate(texts)]
        return torch.tensor([logprob for logprob, _ in self.lm.loglikelihood(requests, disable_tqdm=True)], dtype=torch.float64)


def lm_eval_padding_share(token_requests: list[list[int]], batch_size: int) -> float:
    """lm-eval's batches: inputs (all but the last token) sorted longest first, right-padded per batch."""
    lengths = sorted((len(ids) - 1 for ids in token_requests), reverse=True)
    padded = sum(
        len(batch) * batch[0] - sum(batch) for batch in (lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size))
    )
    total = sum(len(batch) * batch[0] for batch in (lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)))
    return padded / total


# -- the floor --------------------------------------------------------------------------------------


def matmul_gflops(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Throughput of a large square matmul in the model's dtype (float32 on a CPU)."""
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    _, seconds, _ = timed(lambda: torch.mm(a, b), device, repeats)
    return 2 * size**3 / seconds / 1e9


def forward_flops(config, input_lengths: list[int]) -> dict[str, float]:
    """Matmul FLOPs of one forward over sentences of these input lengths, head on every position."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    per_token_weights = layers * (
        hidden * heads * head_dim * 2  # q and o projections
        + 2 * hidden * kv_heads * head_dim  # k and v
        + 3 * hidden * config.intermediate_size  # gate, up, down
    )
    tokens = sum(input_lengths)
    # Causal attention: position p attends p + 1 positions, QK^T and AV each 2 FLOPs per element.
    attended = sum(n * (n + 1) // 2 for n in input_lengths)
    body = 2 * tokens * per_token_weights + 4 * layers * heads * head_dim * attended
    head = 2 * tokens * hidden * config.vocab_size
    return {"body": float(body), "head": float(head), "total": float(body + head)}


@torch.no_grad()
def softmax_seconds_per_row(vocab: int, device: torch.device, repeats: int) -> float:
    """Seconds per row of one ``F.cross_entropy(reduction='none')`` pass over float32 logits.

    The faster of a cache-sized chunk (64 rows) and a large one (2048 rows): on a CPU the pass is
    bound by memory traffic unless its logits stay in the cache.
    """
    best = float("inf")
    for rows in (64, 2048):
        logits = torch.randn(rows, vocab, device=device)
        targets = torch.randint(0, vocab, (rows,), device=device)
        F.cross_entropy(logits, targets, reduction="none")
        _, seconds, _ = timed(
            lambda logits=logits, targets=targets: F.cross_entropy(logits, targets, reduction="none"), device, repeats
        )
        best = min(best, seconds / rows)
    return best


@torch.no_grad()
def body_seconds(model, layout, device: torch.device, repeats: int) -> float:
    """The model body (no head) over the layout's rows: the forward the workload cannot avoid."""

    def run():
        for batch in layout.batches:
            model.model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask, use_cache=False
            )

    return timed(run, device, repeats)[1]


# -- the run ----------------------------------------------------------------------------------------


def machine_info(device: torch.device, **versions: str) -> dict:
    """Where a benchmark ran: platform, processor, threads, device, torch (and ``versions``), date."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **versions,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED / "tatblimp" / "test.jsonl", help="TatBLiMP test.jsonl")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=SHARED / "tokenizers" / "kypchak_unigram_48k.model",
        help="SentencePiece .model, loaded as transformers converts it",
    )
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--batch-size", type=int, default=64, help="lm-eval batch size")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of our scorer and of the floor parts (min is kept)")
    parser.add_argument("--lm-eval-repeats", type=int, default=1)
    parser.add_argument("--naive-limit", type=int, default=None, help="time the naive loop on this many sentences and scale up")
    parser.add_argument("--skip-lm-eval", action="store_true")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--suites", action="store_true", help="TatBLiMP + 16,000 / all BLiMP pairs in one pass (bench_suites.py)")
    parser.add_argument("--lm-eval-workload", help="--suites: the workloads lm-eval scores, by commas (default: the last)")
    parser.add_argument("--skip-in-use", action="store_true", help="--suites: no child process for the memory in use")
    parser.add_argument("--rounds", type=int, default=1, help="--suites: ours and lm-eval timed alternately, the best of each")
    parser.add_argument("--suite-pairs", help="--suites: BLiMP pairs added to TatBLiMP, per workload (default: 0,16000,all)")
    parser.add_argument("--layout-memory", action="store_true", help="--suites: the layouts' tensor bytes only, no scoring")
    parser.add_argument("--method", default="tree", help="--suites: the scoring method the Evaluator is given (default: tree)")
    parser.add_argument("--in-use-child", action="store_true", help=argparse.SUPPRESS)  # bench_suites.in_use_figures' child
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    report: dict = {
        "machine": machine_info(device),
        "model_shape": args.model_shape,
        "dtype": str(dtype).replace("torch.", ""),
    }
    log = lambda *parts: print(*parts, flush=True)  # noqa: E731
    if args.suites:
        from bench_suites import run_suites

        report["load"] = os.getloadavg()
        run_suites(args, report, log)
        report["load_after"] = os.getloadavg()
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return report

    tokenizer = load_converted_tokenizer(args.tokenizer)
    benchmark = load_benchmark(args.data, allow_modified=True)
    texts = benchmark.sentences
    cache = build_cache(tokenizer, benchmark, device=device)
    sentences = [cache.sentence(s) for s in range(cache.num_sentences)]
    model = make_model(args.model_shape, len(tokenizer), device, dtype)
    config = model.config
    tokens = sum(cache.lengths)
    scored = tokens - cache.num_sentences
    vocab = config.vocab_size
    report.update(
        parameters=sum(p.numel() for p in model.parameters()),
        sentences=cache.num_sentences,
        tokens=tokens,
        scored_tokens=scored,
        vocab=vocab,
        full_logits_bytes=tokens * vocab * 4,
    )
    log(
        f"{args.model_shape}: {report['parameters'] / 1e6:.1f}M parameters, {report['dtype']}, {device}; "
        f"{cache.num_sentences} sentences, {tokens} tokens ({scored} scored), vocabulary {vocab}"
    )

    # (c) ours: the method check, then timed calls.
    scorer = Scorer(model, cache)
    ours, report["ours"] = measure_scorer(scorer, device, args.repeats, report["full_logits_bytes"])
    layout = scorer.layout()
    ours_seconds = report["ours"]["seconds"]
    report["ours"]["tokens_per_s"] = tokens / ours_seconds
    log(
        f"ours: {ours_seconds:.3f} s (first call with the method check {report['ours']['first_call_seconds']:.2f} s), {scorer.method}"
    )

    # The floors, measured in the same run.
    gflops = matmul_gflops(device, dtype, max(args.repeats, 10))  # the best of many: a peak, not a typical figure
    softmax_per_row = softmax_seconds_per_row(vocab, device, args.repeats)

    def floor_of(rows_layout, positions: int) -> dict:
        body = body_seconds(model, rows_layout, device, args.repeats)
        head = 2 * positions * config.hidden_size * vocab / (gflops * 1e9)
        softmax = softmax_per_row * positions
        return {
            "positions": positions,
            "body_seconds": body,
            "head_matmul_seconds": head,
            "softmax_seconds": softmax,
            "seconds": body + head + softmax,
            "ours_over_floor": ours_seconds / (body + head + softmax),
        }

    flops = forward_flops(config, [n - 1 for n in cache.lengths])
    report["floor"] = {
        "matmul_gflops": gflops,
        "forward_flops": flops,
        "ours_fraction_of_peak": flops["total"] / ours_seconds / (gflops * 1e9),
        "every_token": floor_of(scorer.layout("packed"), scored),
    }
    if layout.kind == "tree":
        report["floor"]["distinct_contexts"] = floor_of(layout, report["ours"]["distinct_contexts"])
    for name in ("every_token", "distinct_contexts"):
        if name in report["floor"]:
            f = report["floor"][name]
            log(
                f"floor ({name}, {f['positions']} positions): {f['seconds']:.3f} s = body {f['body_seconds']:.3f} + head matmul "
                f"{f['head_matmul_seconds']:.3f} ({gflops:.0f} GFLOP/s) + softmax {f['softmax_seconds']:.3f}; ours / floor = {f['ours_over_floor']:.2f}"
            )

    # (a) naive.
    if not args.skip_naive:
        # With --naive-limit, sentences spread evenly over the file, the time scaled by tokens.
        step = max(1, len(sentences) // (args.naive_limit or len(sentences)))
        chosen = list(range(0, len(sentences), step))
        subset = [sentences[s] for s in chosen]
        naive, naive_seconds, _ = timed(lambda: naive_scores(model, subset, device), device)
        naive_seconds *= tokens / sum(map(len, subset))
        naive_peak = peak_extra_memory(lambda: naive_scores(model, subset[:64], device), device)
        report["naive"] = {
            "seconds": naive_seconds,
            "timed_sentences": len(subset),
            "tokens_per_s": tokens / naive_seconds,
            "padding_share": 0.0,
            "peak_extra_bytes": naive_peak,
            "max_abs_diff_vs_ours": float((naive - ours[chosen]).abs().max()),
            "ours_speedup": naive_seconds / ours_seconds,
        }
        log(f"naive: {naive_seconds:.3f} s; ours is {naive_seconds / ours_seconds:.2f}x faster")

    # (b) lm-eval.
    if not args.skip_lm_eval:
        runner = LmEvalRunner(model, tokenizer, args.batch_size)
        lm_scores, lm_total, _lm_times = timed(lambda: runner(texts), device, args.lm_eval_repeats)
        lm_compute = runner.scoring_seconds
        # lm-eval hands the requests to _loglikelihood_tokens in our order (it reorders inside).
        same_ids = sum(theirs == mine for theirs, mine in zip(runner.token_requests, sentences))
        lm_peak = peak_extra_memory(lambda: runner(texts), device)
        diff = (lm_scores - ours).abs()
        report["lm_eval"] = {
            "version": runner.version,
            "batch_size": args.batch_size,
            "seconds": lm_total,
            "scoring_seconds": lm_compute,
            "tokens_per_s": tokens / lm_total,
            "padding_share": lm_eval_padding_share(runner.token_requests, args.batch_size),
            "peak_extra_bytes": lm_peak,
            "same_token_ids": same_ids == len(sentences),
            "sentences_with_same_ids": same_ids,
            "max_abs_diff_vs_ours": float(diff.max()),
            "max_abs_diff_per_token": float((diff / torch.tensor(cache.lengths)).max()),
            "ours_speedup": lm_total / ours_seconds,
            "ours_speedup_vs_scoring_only": lm_compute / ours_seconds,
        }
        log(
            f"lm-eval: {lm_total:.3f} s ({lm_compute:.3f} s after tokenizing); ours is {lm_total / ours_seconds:.2f}x faster "
            f"({lm_compute / ours_seconds:.2f}x against its scoring alone); max |diff| {diff.max():.2e} nats"
        )

    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def print_table(report: dict) -> None:
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    rows = [("scorer", "seconds", "tokens/s", "padding", "peak extra memory", "ours is faster by")]
    for name, key in (
        ("naive loop", "naive"),
        ("lm-eval HFLM (bs {})".format(report.get("lm_eval", {}).get("batch_size", "")), "lm_eval"),
        ("tatblimp Scorer", "ours"),
    ):
        if key in report:
            r = report[key]
            speedup = f"{r['ours_speedup']:.2f}x" if "ours_speedup" in r else ""
            rows.append(
                (
                    name,
                    f"{r['seconds']:.3f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{100 * r['padding_share']:.1f}%",
                    mib(r["peak_extra_bytes"]),
                    speedup,
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    floor, ours = report["floor"], report["ours"]
    print(
        f"\n{ours['scoring_method']}: {ours['distinct_contexts']} distinct contexts computed for {report['scored_tokens']} scored tokens "
        f"({100 * ours['saved_by_prefix_sharing']:.1f}% of the positions shared)"
    )
    for name in ("every_token", "distinct_contexts"):
        if name in floor:
            f = floor[name]
            print(
                f"floor over {name.replace('_', ' ')} ({f['positions']} positions): {f['seconds']:.3f} s (body {f['body_seconds']:.3f} "
                f"+ head matmul {f['head_matmul_seconds']:.3f} + softmax {f['softmax_seconds']:.3f}); ours / floor = {f['ours_over_floor']:.2f}"
            )
    print(
        f"matmul {floor['matmul_gflops']:.0f} GFLOP/s; the forward of every scored token is {floor['forward_flops']['total'] / 1e9:,.0f} GFLOP; "
        f"ours does that workload at {100 * floor['ours_fraction_of_peak']:.0f}% of the matmul peak\n"
        f"full float32 logits {mib(report['full_logits_bytes'])}; our peak is {ours['peak_fraction_of_full_logits']:.3f} of it "
        f"(1/{1 / max(ours['peak_fraction_of_full_logits'], 1e-12):.0f})"
    )
    if "lm_eval" in report:
        r = report["lm_eval"]
        print(
            f"lm-eval {r['version']} scored the same token ids: {r['same_token_ids']}; max |lm-eval - ours| = {r['max_abs_diff_vs_ours']:.2e} nats a sentence"
        )


if __name__ == "__main__":
    main()
