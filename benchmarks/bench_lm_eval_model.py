"""lm-evaluation-harness's ``--model hf`` against ``--model tatblimp`` on the same requests: time, agreement, memory.

Both models wrap one randomly initialised Llama (``bench_scoring.SHAPES``) with the shared 48K SentencePiece
tokenizer, converted as transformers loads it, and get the same ``Instance`` lists, built as the harness's tasks
build them:

- BLiMP: every pair of ``shared/blimp/data`` (or the first ``--blimp-per-file`` of each of its 67 files), both
  sentences as continuations of an empty context after the harness's target delimiter (" "), as its ``blimp``
  task asks;
- multiple choice with long shared contexts (HellaSwag-like): ``--mc-questions`` passages of Tatar corpus text
  (``--mc-context-words`` words) as the question, and four endings of eight words each.

Each ``loglikelihood`` call is timed (the best of ``--rounds``, the two models alternated so that the load of
a shared machine falls on both; ``tatblimp``'s first call, which chooses the scoring method, is reported apart),
every request's log-prob and ``is_greedy`` compared, and the peak extra memory
of one call measured (CPU: tensor allocations recorded by the profiler; CUDA: ``max_memory_allocated``) on the
first ``--memory-requests`` requests, since a call's peak is one batch's, whatever the number of requests. Beside
them, the head's matmul alone over every distinct scored context (``head_floor``), and each model's time as a
multiple of it: no exact scorer can be faster than that floor, so ``hf``'s multiple bounds the possible speed-up.

    python benchmarks/bench_lm_eval_model.py --shape 1.5m --json benchmarks/results/lm-eval-model-1.5m.json

``--host-profile 400,4000`` measures instead where ``--model tatblimp``'s calls spend their time apart from the model
(issue #52): a near-free model (``--shape free``: 1 layer, hidden 8), the multiple-choice requests, each call split
into the harness's encoding (``TemplateLM.loglikelihood`` before ``_loglikelihood_tokens``), the model's body (its
``base_model`` forward), the head (the greedy reader) and the rest: planning, caches and Python per request, the
host time (also in the process's CPU seconds, ``host_cpu``, which the waits of a loaded machine do not add to), and
of it the CPU tree mask (``tree_mask``: rows x width x width booleans, the attention's input, which a GPU makes itself),
the requests' token ids read into arrays (``reading``) and the plan (``plan``: rows laid out, batches prepared).
Best of ``--rounds`` warm calls (after one that chooses the scoring method) as for new requests (the
harness model's latest plan dropped first), and of as many with the same requests again.

``--calls-in-a-row N`` times N calls of ``--model tatblimp`` on the same ``--mc-questions`` with the weights frozen, as
``lm_eval`` makes them, and counts the scoring-method checks among them (each a plain forward of the check's sample).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_scoring import (  # noqa: E402
    SHAPES,
    load_converted_tokenizer,
    machine_info,
    make_model,
    peak_extra_memory,
    synchronize,
    timed,
)

# The near-free model of the host-time profile: its body costs next to nothing, so what a call costs beyond the head's
# 48K-vocabulary normalisation is host work.
SHAPES["free"] = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
SHARED = Path(os.environ.get("TATBLIMP_SHARED", REPO.parent / "shared"))


def blimp_requests(folder: Path, per_file: int | None):
    from lm_eval.api.instance import Instance

    requests = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines()[:per_file]:
            pair = json.loads(line)
            for sentence in (pair["sentence_good"], pair["sentence_bad"]):
                requests.append(Instance("loglikelihood", pair, ("", " " + sentence), len(requests)))
    return requests


def mc_requests(corpus: Path, questions: int, context_words: int):
    from lm_eval.api.instance import Instance

    words = corpus.read_text(encoding="utf-8").split()
    rng = random.Random(0)
    requests = []
    for q in range(questions):
        # Past the corpus's end (133K words: 841 questions of 150 words) the passages start over, shifted, not empty.
        start = q * (context_words + 8) % (len(words) - context_words - 8)
        context = " ".join(words[start : start + context_words])
        endings = [" ".join(words[start + context_words : start + context_words + 8])]
        for _ in range(3):
            other = rng.randrange(len(words) - 8)
            endings.append(" ".join(words[other : other + 8]))
        for ending in endings:
            requests.append(Instance("loglikelihood", {}, (context, " " + ending), len(requests)))
    return requests


def compare(theirs, ours) -> dict:
    diffs = [abs(a[0] - b[0]) for a, b in zip(theirs, ours, strict=True)]
    return {
        "requests": len(theirs),
        "max_abs_logprob_diff": max(diffs),
        "is_greedy_differs": sum(a[1] != b[1] for a, b in zip(theirs, ours, strict=True)),
        "greedy_requests": sum(bool(a[1]) for a in theirs),
    }


def head_floor(requests, lm, device) -> dict:
    """What any exact scorer pays at least: the head's matmul (no normalisation) for each distinct scored context.

    A continuation token's context is every token before it; requests that share one (a pair's common prefix, a
    question's context) need its logits once. The matmul runs in the CPU head's 2,048 x 2,048 tiles, best of two.
    """
    contexts = set()
    for request in requests:
        context, continuation = request.args
        if context:
            context_tokens, continuation_tokens = lm._encode_pair(context, continuation)
        else:
            context_tokens, continuation_tokens = [lm.prefix_token_id], lm.tok_encode(continuation)
        tokens = tuple(context_tokens + continuation_tokens)
        contexts.update(tokens[: len(context_tokens) + j] for j in range(len(continuation_tokens)))
    weight = lm.model.get_output_embeddings().weight.detach()
    hidden = torch.randn(len(contexts), weight.shape[1], dtype=weight.dtype, device=device)

    def matmuls():
        for start in range(0, hidden.shape[0], 2048):
            for first in range(0, weight.shape[0], 2048):
                torch.nn.functional.linear(hidden[start : start + 2048], weight[first : first + 2048])

    seconds = min(timed(matmuls, device)[1] for _ in range(2))
    return {"contexts": len(contexts), "seconds": seconds}


def measure(name, requests, models, device, rounds: int, memory_requests: int, log) -> dict:
    """hf's best of ``rounds`` calls; tatblimp's first call (with its one-time method check) and best of ``rounds`` more."""
    times = {label: [] for label in models}
    answers = {}
    first = None
    for _ in range(rounds):
        for label, lm in models.items():
            calls = 2 if label == "tatblimp" and first is None else 1
            for _ in range(calls):
                answers[label], seconds, _ = timed(lambda lm=lm: lm.loglikelihood(requests, disable_tqdm=True), device)
                if label == "tatblimp" and first is None:
                    first = seconds
                else:
                    times[label].append(seconds)
    report = {label: {"seconds": min(t), "times": t} for label, t in times.items()}
    report["tatblimp"]["first_call_seconds"] = first
    for label, lm in models.items():
        subset = requests[:memory_requests]
        report[label]["peak_extra_bytes"] = peak_extra_memory(
            lambda lm=lm, subset=subset: lm.loglikelihood(subset, disable_tqdm=True), device
        )
    report["agreement"] = compare(answers["hf"], answers["tatblimp"])
    report["speedup"] = report["hf"]["seconds"] / report["tatblimp"]["seconds"]
    report["speedup_first_call"] = report["hf"]["seconds"] / first
    floor = report["head_floor"] = head_floor(requests, models["hf"], device)
    for label in models:
        report[f"{label}_over_floor"] = report[label]["seconds"] / floor["seconds"]
    log(
        f"{name}: {len(requests):,} requests, hf {report['hf']['seconds']:.1f} s, tatblimp {report['tatblimp']['seconds']:.1f} s "
        f"({report['speedup']:.2f}x; first call {first:.1f} s, {report['speedup_first_call']:.2f}x); max |diff| "
        f"{report['agreement']['max_abs_logprob_diff']:.2e} nats, is_greedy differs {report['agreement']['is_greedy_differs']}; "
        f"peak extra MiB hf {report['hf']['peak_extra_bytes'] / 2**20:.0f}, "
        f"tatblimp {report['tatblimp']['peak_extra_bytes'] / 2**20:.0f}; head matmul floor {floor['seconds']:.1f} s "
        f"({floor['contexts']:,} distinct contexts): hf {report['hf_over_floor']:.2f}x, tatblimp {report['tatblimp_over_floor']:.2f}x"
    )
    return report


def host_profile(lm, requests, rounds: int, device) -> dict:
    """Seconds of a warm ``loglikelihood`` call spent encoding, in the model's body, in the head, and on the host
    otherwise (the best call of ``rounds``, by its host time)."""
    import tatblimp_callback.engine.packing as packing_module
    import tatblimp_callback.engine.scored_spans as spans_module
    import tatblimp_callback.harness.fused as fused_module

    spent = {"body": 0.0, "head": 0.0, "scoring": 0.0, "tree_mask": 0.0, "reading": 0.0}
    cpu = dict(spent)  # the same in the process's CPU seconds: on a loaded machine, without the waits for a core

    def clocked(name, fn):
        def run(*args, **kwargs):
            synchronize(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            synchronize(device)
            spent[name] += time.perf_counter() - start
            cpu[name] += time.process_time() - start_cpu
            return out

        return run

    body = lm.model.get_base_model() if hasattr(lm.model, "get_base_model") else lm.model.base_model
    originals = [(body, "forward", body.forward), (lm, "_loglikelihood_tokens", lm._loglikelihood_tokens)]
    reader = ("greedy_logprobs", spans_module) if hasattr(spans_module, "greedy_logprobs") else None
    if reader is None:  # the engine before the one greedy reader (issue #51): the harness model read its own
        import tatblimp_callback.harness.fused as reader_module

        reader = ("head_logprobs_and_greedy", reader_module)
    originals.append((reader[1], reader[0], getattr(reader[1], reader[0])))
    if hasattr(packing_module, "interval_mask"):  # the CPU tree mask: part of the host time, the attention's input
        originals.append((packing_module, "interval_mask", packing_module.interval_mask))
        packing_module.interval_mask = clocked("tree_mask", packing_module.interval_mask)
    if hasattr(fused_module, "request_tokens"):  # the requests' token ids read into arrays
        originals.append((fused_module, "request_tokens", fused_module.request_tokens))
        fused_module.request_tokens = clocked("reading", fused_module.request_tokens)
    body.forward = clocked("body", body.forward)
    lm._loglikelihood_tokens = clocked("scoring", lm._loglikelihood_tokens)
    setattr(reader[1], reader[0], clocked("head", getattr(reader[1], reader[0])))
    try:
        lm.loglikelihood(requests, disable_tqdm=True)  # the first call: the scoring method chosen
        calls = []
        for k in range(2 * rounds):
            if k % 2 == 0 and hasattr(lm.request_scorer, "_scorer"):
                lm.request_scorer._scorer = None  # as for requests it has not seen: the plan made again
            spent.update(body=0.0, head=0.0, scoring=0.0, tree_mask=0.0, reading=0.0)
            cpu.update(spent)
            _, seconds, _ = timed(lambda: lm.loglikelihood(requests, disable_tqdm=True), device)
            host = spent["scoring"] - spent["body"] - spent["head"]
            # The plan (rows laid out, batches prepared): what the call's scorer timed, where it times it.
            plan = getattr(getattr(lm.request_scorer, "_scorer", None), "setup_seconds", {}).get("plan")
            calls.append(
                {
                    "same_requests_again": k % 2 == 1,
                    "total": seconds,
                    "encoding": seconds - spent["scoring"],
                    "body": spent["body"],
                    "head": spent["head"],
                    "host": host,
                    "host_cpu": cpu["scoring"] - cpu["body"] - cpu["head"],
                    "tree_mask": spent["tree_mask"],
                    "reading": spent["reading"],
                    "plan": plan,
                }
            )
    finally:
        for owner, name, original in originals:
            if name == "forward" or name == "_loglikelihood_tokens":
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, original)
    best = min((c for c in calls if not c["same_requests_again"]), key=lambda c: c["host"])
    again = min((c for c in calls if c["same_requests_again"]), key=lambda c: c["host"])
    return {
        **best,
        "requests": len(requests),
        "host_per_1000_requests": 1000 * best["host"] / len(requests),
        "encoding_per_1000_requests": 1000 * best["encoding"] / len(requests),
        # What is left without the CPU tree mask (rows x width x width booleans, made where the model runs).
        "host_without_tree_mask_per_1000_requests": 1000 * (best["host"] - best["tree_mask"]) / len(requests),
        "same_requests_again_host_per_1000_requests": 1000 * again["host"] / len(requests),
        # The host's CPU seconds (the best call by them): what the load of other processes does not add to.
        "host_cpu_per_1000_requests": 1000 * min(c["host_cpu"] for c in calls if not c["same_requests_again"]) / len(requests),
        "same_requests_again_host_cpu_per_1000_requests": 1000
        * min(c["host_cpu"] for c in calls if c["same_requests_again"])
        / len(requests),
        "calls": calls,
    }


def calls_in_a_row(lm, requests, calls: int, device) -> dict:
    """``calls`` warm ``loglikelihood`` calls on the same requests with the weights frozen (as ``lm_eval`` calls the
    harness model): seconds in all after the first, and the method checks among them (each a plain forward of the
    check's sample, one sequence a row; counted where ``MethodCheck`` computes that reference)."""
    from tatblimp_callback.engine.method_check import MethodCheck

    checks = []
    reference = MethodCheck._reference

    def counted(check):
        start = time.perf_counter()
        out = reference(check)
        checks.append(time.perf_counter() - start)
        return out

    MethodCheck._reference = counted
    try:
        seconds = [timed(lambda: lm.loglikelihood(requests, disable_tqdm=True), device)[1] for _ in range(calls)]
    finally:
        MethodCheck._reference = reference
    return {
        "calls": calls,
        "seconds_after_the_first": sum(seconds[1:]),
        "method_checks": len(checks),
        "method_check_seconds": sum(checks),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blimp-per-file", type=int, help="the first N pairs of each BLiMP file (default: all 1,000)")
    parser.add_argument("--mc-questions", type=int, default=200)
    parser.add_argument("--mc-context-words", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64, help="HFLM's batch size")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory-requests", type=int, default=2000)
    parser.add_argument("--tasks", default="blimp,mc")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (on a loaded machine 1 keeps small ops from waiting)")
    parser.add_argument("--host-profile", help="request counts (e.g. 400,4000): profile tatblimp's calls only (see above)")
    parser.add_argument(
        "--calls-in-a-row", type=int, help="time N calls of tatblimp on the same multiple-choice requests, frozen weights"
    )
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    parser.add_argument("--corpus", type=Path, default=SHARED / "tatar-corpus" / "train.txt", help="the multiple-choice text")
    args = parser.parse_args(argv)
    log = lambda *parts: print(*parts, flush=True)  # noqa: E731

    from lm_eval.models.huggingface import HFLM

    from tatblimp_callback.harness import register

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = load_converted_tokenizer(args.tokenizer)
    model = make_model(args.shape, len(tokenizer), device, torch.float32 if device.type == "cpu" else torch.bfloat16)
    common = dict(pretrained=model, tokenizer=tokenizer, max_length=2048)
    models = {"hf": HFLM(batch_size=args.batch_size, **common), "tatblimp": register()(**common)}
    report = {
        "machine": {
            **machine_info(device, lm_eval=__import__("lm_eval").__version__),
            "load_before": list(os.getloadavg()),
        },
        "shape": args.shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hf_batch_size": args.batch_size,
        "rounds": args.rounds,
    }
    if args.host_profile:
        for count in map(int, args.host_profile.split(",")):
            requests = mc_requests(args.corpus, count // 4, args.mc_context_words)
            profile = report[f"host_profile_{count}"] = host_profile(models["tatblimp"], requests, args.rounds, device)
            log(
                f"{count:,} multiple-choice requests: call {profile['total']:.3f} s = encoding {profile['encoding']:.3f} + body "
                f"{profile['body']:.3f} + head {profile['head']:.3f} + host {profile['host']:.3f} s "
                f"(per 1,000 requests: host {profile['host_per_1000_requests']:.3f} s, encoding "
                f"{profile['encoding_per_1000_requests']:.3f} s; the same requests again: host "
                f"{profile['same_requests_again_host_per_1000_requests']:.3f} s; host CPU seconds per 1,000 requests "
                f"{profile['host_cpu_per_1000_requests']:.3f}, again {profile['same_requests_again_host_cpu_per_1000_requests']:.3f}; "
                f"without the tree mask {profile['host_without_tree_mask_per_1000_requests']:.3f} s)"
            )
        args.tasks = ""
    if args.calls_in_a_row:
        requests = mc_requests(args.corpus, args.mc_questions, args.mc_context_words)
        calls = report["calls_in_a_row"] = calls_in_a_row(models["tatblimp"], requests, args.calls_in_a_row, device)
        log(
            f"{calls['calls']} calls of {len(requests):,} multiple-choice requests: {calls['seconds_after_the_first']:.2f} s "
            f"after the first; {calls['method_checks']} method checks ({calls['method_check_seconds']:.2f} s)"
        )
    tasks = args.tasks.split(",")
    if "blimp" in tasks:
        requests = blimp_requests(SHARED / "blimp" / "data", args.blimp_per_file)
        report["blimp"] = measure("BLiMP", requests, models, device, args.rounds, args.memory_requests, log)
        report["blimp"]["pairs"] = len(requests) // 2
    if "mc" in tasks:
        requests = mc_requests(args.corpus, args.mc_questions, args.mc_context_words)
        report["mc"] = measure("multiple choice", requests, models, device, args.rounds, args.memory_requests, log)
        report["mc"]["context_words"] = args.mc_context_words
    report["machine"]["load_after"] = list(os.getloadavg())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
