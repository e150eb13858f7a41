"""The suites mode of ``bench_scoring.py``: TatBLiMP with more and more of BLiMP in one fused evaluation.

    python benchmarks/bench_scoring.py --suites --model-shape 1.5m --json bench_suites.json

In one process, on one randomly initialised Llama and the 48K tokenizer as transformers converts it, for
TatBLiMP alone, TatBLiMP + 16,000 BLiMP pairs and TatBLiMP + all of BLiMP (66,993 pairs), it measures one
evaluation of an ``Evaluator`` already prepared (tokenized once, as in training; the scoring method is
the one the scorer chooses on TatBLiMP for a Llama, tree rows and tiled head, given so that one call is
the evaluation measured):
seconds, positions computed (rows x width of every forward call), seconds per 1,000 positions, the cache's
size, and memory, as anonymous resident memory (``RssAnon``: what the process allocated; pages of the
libraries' code are not counted) sampled every millisecond above its level before the call:

- ``peak_extra_rss_bytes``: the peak, with glibc's malloc as a process leaves it. Freed blocks below
  glibc's adaptive threshold (up to 32 MiB) stay mapped for reuse, so this counts memory that was used
  and freed as well as memory in use; ``extra_rss_after_bytes``: what is left after the call, once the
  scorer has handed freed memory back (``memory_budget.release_freed_memory``).
- ``peak_in_use_bytes``: the same evaluation in a child process with ``MALLOC_MMAP_THRESHOLD_=131072``,
  where glibc unmaps every freed block of 128 KiB or more at once, so that the peak is the memory in use
  (and ``seconds_in_use_child``: the time it costs to fault those pages in again).

Then lm-evaluation-harness's ``HFLM.loglikelihood`` (``pip install -e '.[bench]'``) scores the
sentences of the largest workload (or ``--lm-eval-workload``) in the same process, and the two are
compared: time, and decisions pair by pair (we count a tie as a failure, lm-eval's argmax as a pass).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_scoring import SHARED, LmEvalRunner, load_converted_tokenizer, make_model

from tatblimp_callback import Evaluator, load_benchmark
from tatblimp_callback.reading.data import Pair
from tatblimp_callback.reading.suites import Suite, load_suite

PAIRS = "0,16000,all"  # BLiMP pairs added to TatBLiMP in each workload (--suite-pairs); "corpus:N": N corpus pairs
CORPUS = SHARED / "tatar-corpus" / "train.txt"


def corpus_suite(pairs: int, path: Path = CORPUS) -> Suite:
    """``pairs`` minimal pairs whose sentences share little: distinct corpus sentences of three words or more,
    each against itself with its middle word swapped with the next (file order; sentences the swap leaves
    unchanged are skipped)."""
    seen, made = set(), []
    for line in path.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) < 3 or line in seen:
            continue
        seen.add(line)
        i = len(words) // 2 - 1
        swapped = [*words[:i], words[i + 1], words[i], *words[i + 2 :]]
        if swapped != words:
            made.append(Pair(" ".join(words), " ".join(swapped), "word_swap"))
        if len(made) == pairs:
            break
    if len(made) < pairs:
        raise ValueError(f"{path} gives only {len(made)} pairs, not {pairs}")
    return Suite(pairs=tuple(made), source=str(path), md5="word-swaps", name="corpus")


# glibc unmaps every freed block of at least this size at once: RSS is then the memory in use.
IN_USE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def rss_bytes() -> int:
    """Anonymous resident memory: what the process allocated (not the pages of the libraries' code)."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("RssAnon:"))


def peak_rss_during(fn):
    """(fn(), peak RSS above the level before it, RSS left above it after, in bytes): a thread samples RSS every millisecond."""
    gc.collect()
    base = rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    after = rss_bytes()
    return result, max(peak[0], after) - base, after - base


def in_use_figures(args, log) -> dict:
    """The same workloads in a child process where glibc unmaps freed blocks at once (``IN_USE_ENV``):
    {workload: its row}, whose peak is the memory in use."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "in_use.json"
        command = [sys.executable, str(Path(__file__).with_name("bench_scoring.py")), "--suites", "--in-use-child"]
        command += ["--model-shape", args.model_shape, "--device", args.device, "--method", args.method]
        command += ["--data", str(args.data), "--tokenizer", str(args.tokenizer), "--skip-lm-eval", "--json", str(out)]
        command += ["--suite-pairs", args.suite_pairs or PAIRS]
        log(f"the same workloads with {IN_USE_ENV} in a child process")
        subprocess.run(command, check=True, env={**os.environ, **IN_USE_ENV})
        return json.loads(out.read_text())["workloads"]


def layout_memory(scorer) -> dict:
    """Bytes of the tensors of every batch of the scorer's layout, built one by one: what a layout holding all its
    batches (as before) kept for the whole run, and the largest one batch (all that is built at a time now)."""
    layout = scorer.layout()
    sizes = []
    for batch in layout.batches:
        sizes.append(sum(v.nbytes for v in vars(batch).values() if isinstance(v, torch.Tensor)))
    return {
        "sentences": scorer.cache.num_sentences,
        "positions": layout.total_positions,
        "forward_calls": len(sizes),
        "all_batches_bytes": sum(sizes),
        "largest_batch_bytes": max(sizes),
        "cache_bytes": scorer.cache.nbytes,
        "memory_budget": scorer.memory_budget,
    }


def run_suites(args, report: dict, log) -> dict:
    device = torch.device(args.device)
    tokenizer = load_converted_tokenizer(args.tokenizer)
    tatblimp = load_benchmark(args.data, allow_modified=True)
    blimp = load_suite("blimp", SHARED / "blimp" / "data")
    model = make_model(args.model_shape, len(tokenizer), device, torch.float32)
    report.update(parameters=sum(p.numel() for p in model.parameters()), left_out=list(blimp.left_out), workloads={})
    log(
        f"{args.model_shape}: {report['parameters'] / 1e6:.2f}M parameters; BLiMP {len(blimp)} pairs, {len(blimp.left_out)} left out"
    )
    evaluators = {}
    for count in (args.suite_pairs or PAIRS).split(","):
        if count.startswith("corpus:"):
            name, suites = f"tatblimp+corpus{count[7:]}", {"corpus": corpus_suite(int(count[7:]))}
        else:
            pairs = len(blimp) if count == "all" else int(count)
            name = "tatblimp" if not pairs else ("tatblimp+blimp" if pairs == len(blimp) else f"tatblimp+{pairs}")
            suites = {"blimp": replace(blimp, pairs=blimp.pairs[:pairs])} if pairs else {}
        evaluator = Evaluator(tokenizer, tatblimp, suites=suites, method=args.method)
        start = time.perf_counter()
        evaluator.prepare(model)  # tokenizes
        first_seconds = time.perf_counter() - start
        if args.layout_memory:
            report["workloads"][name] = layout_memory(evaluator._scorer)
            log(f"{name}: {report['workloads'][name]}")
            continue
        results, peak, after = peak_rss_during(lambda evaluator=evaluator: evaluator(model))
        seconds = results.run_info["seconds"]
        layout = evaluator._scorer.layout()
        row = {
            "pairs": len(results.pairs) + sum(len(s.pairs) for s in results.suites.values()),
            "sentences": evaluator.cache.num_sentences,
            "seconds": seconds,
            "tokenize_seconds": first_seconds,
            "positions": layout.total_positions,
            "seconds_per_1000_positions": 1000 * seconds / layout.total_positions,
            "padding_share": layout.padding_share,
            "saved_by_prefix_sharing": layout.saved_by_prefix_sharing,
            "peak_extra_rss_bytes": peak,
            "extra_rss_after_bytes": after,
            "memory_budget": evaluator._scorer.memory_budget,
            "cache_bytes": evaluator.cache.nbytes,
            "scoring_method": results.run_info["scoring_method"],
            "acc_norm": {"tatblimp": results.acc_norm, **{n: s.acc_norm for n, s in results.suites.items()}},
        }
        report["workloads"][name] = row
        evaluators[name] = (evaluator, results)
        log(
            f"{name}: {row['pairs']} pairs, {row['sentences']} sentences: {seconds:.1f} s, {row['positions']} positions, "
            f"{row['seconds_per_1000_positions']:.3f} s per 1,000, peak extra RSS {peak / 2**20:.0f} MiB "
            f"({after / 2**20:.0f} MiB after), cache {row['cache_bytes'] / 2**20:.1f} MiB"
        )

    if not args.in_use_child and not args.layout_memory and not args.skip_in_use:
        for name, child in in_use_figures(args, log).items():
            row = report["workloads"][name]
            row["peak_in_use_bytes"] = child["peak_extra_rss_bytes"]
            row["seconds_in_use_child"] = child["seconds"]
            log(f"{name}: peak in use {row['peak_in_use_bytes'] / 2**20:.0f} MiB ({child['seconds']:.1f} s in the child)")

    for name in (args.lm_eval_workload or list(evaluators)[-1]).split(","):
        if args.skip_lm_eval or args.layout_memory:
            break
        evaluator, results = evaluators[name]
        parts = [results, *results.suites.values()]
        benchmarks = [tatblimp, *evaluator.suites.values()]
        texts = [s for b in benchmarks for s in b.sentences]
        runner = LmEvalRunner(model, tokenizer, args.batch_size)
        start = time.perf_counter()
        theirs, lm_peak, _ = peak_rss_during(lambda runner=runner, texts=texts: runner(texts))
        lm_seconds = time.perf_counter() - start
        ours_seconds = report["workloads"][name]["seconds"]
        # On a shared machine the load changes between the two timings: with --rounds R, ours and lm-eval
        # are timed again alternately, R times each in all, and each keeps its best.
        for _ in range(args.rounds - 1):
            ours_seconds = min(ours_seconds, evaluator(model).run_info["seconds"])
            start = time.perf_counter()
            runner(texts)
            lm_seconds = min(lm_seconds, time.perf_counter() - start)
        ours = torch.tensor([[p.good_logprob, p.bad_logprob] for r in parts for p in r.pairs], dtype=torch.float64)
        theirs = theirs.view(-1, 2)
        ours_pass, lm_pass = ours[:, 0] > ours[:, 1], theirs[:, 0] >= theirs[:, 1]  # argmax puts gold (index 0) first
        differ = ours_pass != lm_pass
        ours_ties = ours[:, 0] == ours[:, 1]
        same_ids = sum(t == s for t, s in zip(runner.token_requests, (evaluator.cache.sentence(i) for i in range(len(texts)))))
        report.setdefault("lm_eval_by_workload", {})[name] = report["lm_eval"] = {
            "version": runner.version,
            "workload": name,
            "batch_size": args.batch_size,
            "seconds": lm_seconds,
            "scoring_seconds": runner.scoring_seconds,
            "peak_extra_rss_bytes": lm_peak,
            "sentences_with_same_ids": same_ids,
            "max_abs_diff_vs_ours": float((theirs.flatten() - ours.flatten()).abs().max()),
            "rounds": args.rounds,
            "ours_seconds": ours_seconds,
            "ours_speedup": lm_seconds / ours_seconds,
            "ours_speedup_vs_scoring_only": runner.scoring_seconds / ours_seconds,
            "pairs_deciding_differently": int(differ.sum()),
            "of_them_ties_in_ours": int((differ & ours_ties).sum()),
            "ties_in_ours": int(ours_ties.sum()),
        }
        r = report["lm_eval"]
        log(
            f"lm-eval {r['version']} on {name}: {lm_seconds:.1f} s ({r['scoring_seconds']:.1f} s after tokenizing), "
            f"peak extra RSS {lm_peak / 2**20:.0f} MiB; ours is {r['ours_speedup']:.2f}x faster; "
            f"{r['pairs_deciding_differently']} pairs decided differently ({r['of_them_ties_in_ours']} of them ties: "
            f"a failure for us, a pass for argmax); max |diff| {r['max_abs_diff_vs_ours']:.2e} nats"
        )
    return report
