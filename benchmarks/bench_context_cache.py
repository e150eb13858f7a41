"""What a harness model call would cost with each context computed once and its choices after it, from its KV cache.

Issue #52 item 4 asks that ``--model tatblimp``'s host time per 1,000 multiple-choice requests be at most 5% of
017d393's. The engine lays a question out as one prefix-tree row: its context, then each choice, with a tree mask of
width x width booleans a row that the CPU writes for every call, and a general plan (cells, spans, batches) around it.
This benchmark measures, on the same requests and the same model, a design the library does not use (``two_phase``):

1. each distinct context runs once in plain causal rows, right-padded, with no attention mask (the attention's own
   causal path; the padding comes after every real token, so no real position sees it), its KV cache kept;
2. each choice's tokens but its last run after its context's cache, at positions after the context, laid out either
   a row for each choice after a copy of its question's cache row, with the model's own 2D padding mask
   (``choice_rows``), or a question's choices one after another in the row after its own cache row, each seeing the
   context and itself through a small 4D mask (``question_rows``);
3. each continuation token's log-prob and greedy flag come from the engine's head (``greedy_head``), read at the
   context's last position (a choice's first token) and at the choice's own positions (the others).

Alternated with both, in one process: the harness model's ``_loglikelihood_tokens`` on the same encoded requests.
For each: host time (the call less the body's forward calls and the head; copying a question's cache for each of its
choices, ``kv_copy``, is part of it, as the engine's tree mask is of its), body, head, best of ``--rounds``; and how
far the designs' log-probs are from the engine's, and their greedy flags. The KV cache is the price: every layer's
keys and values of a batch are held at once (``kv_bytes``, the largest batch's), where the engine holds one layer's
activations at a time.

    python benchmarks/bench_context_cache.py --shape free --requests 400,4000 --json benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_lm_eval_model import SHAPES, SHARED, load_converted_tokenizer, make_model, mc_requests  # noqa: E402
from bench_scoring import machine_info, synchronize  # noqa: E402

from tatblimp_callback.engine.greedy_head import greedy_logprobs  # noqa: E402
from tatblimp_callback.engine.model_checks import input_device  # noqa: E402


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[k], starts[k] + 1, ..., starts[k] + counts[k] - 1`` for each k, one after another."""
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


def timed(spent: dict, name: str, device: torch.device, fn):
    """``fn``, its seconds (the device synchronised around it) added to ``spent[name]`` at each call."""

    def run(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        synchronize(device)
        spent[name] += time.perf_counter() - start
        return out

    return run


def choice_rows(inputs, tokens, context_length, context_real, owner):
    """The second phase with a row for each choice: its inputs after a copy of its question's cache row, the model's
    own 2D padding mask over the cache's real positions and its own. ``(input_ids, position_ids, attention_mask, the
    flat positions read, choice by choice, and the cache rows to copy)``."""
    width = max(int(inputs.max()), 1)
    real = np.arange(width) < inputs[:, None]
    ids = np.zeros((len(inputs), width), dtype=np.int64)
    ids[real] = tokens
    positions = context_length[owner, None] + np.arange(width)
    seen = np.concatenate([context_real[owner], real], axis=1).astype(np.int64)
    return ids, positions, seen, np.flatnonzero(real.ravel()), owner


def question_rows(inputs, tokens, context_length, context_real, owner):
    """The second phase with a row for each question, after its own cache row (nothing copied): its choices' inputs one
    after another, each seeing the context and itself (a 4D boolean mask). Returns as ``choice_rows``, no rows to copy."""
    rows = len(context_length)
    depth = _ranges(np.zeros(len(inputs), dtype=np.int64), inputs)  # each input's place in its choice
    choice = np.repeat(np.arange(len(inputs)), inputs)
    starts = np.cumsum(inputs) - inputs  # a choice's first input among all of the batch's
    question_first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # the batch's choices are grouped by question
    row_start = np.repeat(starts[question_first], np.diff(np.r_[question_first, len(owner)]))
    row, column = owner[choice], starts[choice] - row_start[choice] + depth
    width = int(column.max()) + 1
    ids = np.zeros((rows, width), dtype=np.int64)
    ids[row, column] = tokens
    positions = np.repeat(context_length[:, None], width, axis=1)
    positions[row, column] = context_length[row] + depth
    whose, place = np.full((rows, width), -1), np.zeros((rows, width), dtype=np.int64)
    whose[row, column], place[row, column] = choice, depth
    own = (whose[:, :, None] == whose[:, None, :]) & (place[:, None, :] <= place[:, :, None]) & (whose[:, None, :] >= 0)
    mask = np.concatenate([np.broadcast_to(context_real[:, None, :], (rows, width, context_real.shape[1])), own], axis=2)
    return ids, positions, mask[:, None], row * width + column, None


def two_phase(model, requests, pad_id: int, batch_positions: int, memory_budget: int, spent: dict, second=choice_rows):
    """``(log-prob, is_greedy)`` of each encoded ``(key, context, continuation)``: contexts once, then the choices after
    their context's KV cache, laid out by ``second`` (``choice_rows`` or ``question_rows``). ``spent`` gains the
    body's and the head's seconds, the cache copies' and the largest batch's KV bytes. The requests' contexts are
    shared lists where they share a context, as the harness model hands them; none is cut."""

    body, count = model.get_decoder(), len(requests)
    device = input_device(model)

    def on(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    def clocked(name, fn, *args, **kwargs):
        return timed(spent, name, device, fn)(*args, **kwargs)

    # transformers 5.25 renamed the argument; earlier 5.x releases (the GPU machine's 5.17) know the old name only
    cache_argument = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    contexts, continuations = [r[1] for r in requests], [r[2] for r in requests]
    first = {}  # a context list's id -> the first request holding it
    holder = np.fromiter(map(first.setdefault, map(id, contexts), range(count)), dtype=np.int64, count=count)
    firsts, question = np.unique(holder, return_inverse=True)
    distinct = list(map(contexts.__getitem__, firsts.tolist()))
    context_length = np.fromiter(map(len, distinct), dtype=np.int64, count=len(distinct))
    context_tokens = np.fromiter(itertools.chain.from_iterable(distinct), dtype=np.int64, count=int(context_length.sum()))
    length = np.fromiter(map(len, continuations), dtype=np.int64, count=count)
    tokens = np.fromiter(itertools.chain.from_iterable(continuations), dtype=np.int64, count=int(length.sum()))
    context_start, token_start = np.cumsum(context_length) - context_length, np.cumsum(length) - length
    by_question = np.argsort(question, kind="stable")
    choices = np.bincount(question, minlength=len(distinct))
    choice_start = np.cumsum(choices) - choices
    order = np.argsort(context_length, kind="stable")  # batches of questions of alike lengths, little padding
    logprob, greedy = np.zeros(count), np.zeros(count, dtype=bool)
    start = 0
    while start < len(order):
        # as many questions as fit batch_positions at the last one's width (the longest: they are sorted)
        positions = np.arange(1, len(order) - start + 1) * context_length[order[start:]]
        end = start + max(1, int(np.searchsorted(positions, batch_positions, "right")))
        questions, start = order[start:end], end
        width, rows = int(context_length[questions].max()), len(questions)
        real = np.arange(width) < context_length[questions, None]
        ids = np.full((rows, width), pad_id, dtype=np.int64)
        ids[real] = context_tokens[(context_start[questions, None] + np.arange(width))[real]]
        out = clocked("body", body, input_ids=on(ids), use_cache=True)
        hidden, cache = out.last_hidden_state.flatten(0, 1), out.past_key_values
        read = [hidden[on(np.arange(rows) * width + context_length[questions] - 1)]]
        # the batch's requests, question by question; each one's tokens but its last are the second phase's inputs
        owner = np.repeat(np.arange(rows), choices[questions])
        batch = by_question[_ranges(choice_start[questions], choices[questions])]
        inputs = length[batch] - 1
        if inputs.any():
            ids, positions, mask, reads, copies = second(
                inputs, tokens[_ranges(token_start[batch], inputs)], context_length[questions], real, owner
            )
            if copies is not None:
                clocked("kv_copy", cache.batch_select_indices, on(copies))
            out = clocked(
                "body",
                body,
                input_ids=on(ids),
                position_ids=on(positions),
                attention_mask=on(mask),
                use_cache=True,
                **{cache_argument: cache},
            )
            spent["kv_bytes"] = max(
                spent["kv_bytes"], sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
            )
            read.append(out.last_hidden_state.flatten(0, 1)[on(reads)])
        # token j of request k: read at its question's last context position (j = 0), else at its input j - 1
        request = np.repeat(np.arange(len(batch)), length[batch])
        j = _ranges(np.zeros(len(batch), dtype=np.int64), length[batch])
        context = np.where(j == 0, owner[request], rows + (np.cumsum(inputs) - inputs)[request] + j - 1)
        token_logprob, is_greedy = clocked(
            "head",
            greedy_logprobs,
            model,
            torch.cat(read),
            on(context),
            on(tokens[token_start[batch][request] + j]),
            "tiled",
            memory_budget,
        )
        logprob[batch] = np.bincount(request, weights=token_logprob.double().cpu().numpy(), minlength=len(batch))
        greedy[batch] = np.bincount(request, weights=~is_greedy.cpu().numpy(), minlength=len(batch)) == 0
        del out, hidden, cache, read
    return list(zip(logprob.tolist(), greedy.tolist()))


def engine_call(lm, encoded, spent: dict):
    """The harness model's ``_loglikelihood_tokens`` on ``encoded``, its plan made anew, with the body (its decoder's
    forward) and the head timed into ``spent``."""
    import tatblimp_callback.engine.scored_spans as spans_module

    body, device = lm.model.get_decoder(), input_device(lm.model)
    reader = spans_module.greedy_logprobs

    body.forward = timed(spent, "body", device, body.forward)
    spans_module.greedy_logprobs = timed(spent, "head", device, reader)
    try:
        lm.request_scorer._scorer = None  # as for requests it has not seen: the plan made again
        return lm._loglikelihood_tokens(encoded)
    finally:
        vars(body).pop("forward")
        spans_module.greedy_logprobs = reader


def measure(lm, model, requests, rounds: int, batch_positions: int, memory_budget: int) -> dict:
    """The engine's and both two-phase designs' timings on ``requests`` (best of ``rounds`` after one that warms them,
    by host time), and how far each design's answers are from the engine's."""
    from lm_eval.models.huggingface import HFLM

    lm._encoding_only = True  # the harness's own encoding, its context lists shared as the harness model hands them
    try:
        with lm._encodings(requests):
            encoded = HFLM.loglikelihood(lm, requests, disable_tqdm=True)
    finally:
        lm._encoding_only = False
    designs = {"engine": lambda spent: engine_call(lm, encoded, spent)}
    for second in (choice_rows, question_rows):
        designs[f"context_cache_{second.__name__}"] = lambda spent, second=second: two_phase(
            model, encoded, lm.prefix_token_id, batch_positions, memory_budget, spent, second
        )
    calls, answers, device = {name: [] for name in designs}, {}, input_device(model)
    with torch.inference_mode():
        lm._loglikelihood_tokens(encoded)  # the scoring method chosen
        for _ in range(rounds + 1):  # the first round warms them
            for name, call in designs.items():
                spent = {"body": 0.0, "head": 0.0, "kv_copy": 0.0, "kv_bytes": 0}
                synchronize(device)
                start = time.perf_counter()
                answers[name] = call(spent)
                synchronize(device)
                total = time.perf_counter() - start
                calls[name].append({"total": total, "host": total - spent["body"] - spent["head"], **spent})
    report = {"requests": len(requests)}
    for name, timings in calls.items():
        best = min(timings[1:], key=lambda c: c["host"])
        report[name] = {**best, "host_per_1000_requests": 1000 * best["host"] / len(requests)}
    for name in designs:
        pairs = list(zip(answers["engine"], answers[name], strict=True))
        report[name]["max_abs_logprob_diff_from_engine"] = max(abs(a[0] - b[0]) for a, b in pairs)
        report[name]["is_greedy_differs_from_engine"] = sum(a[1] != b[1] for a, b in pairs)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="free")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", default="400,4000", help="multiple-choice request counts (four choices a question)")
    parser.add_argument("--context-words", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-positions", type=int, default=1 << 16, help="context positions a first-phase call")
    parser.add_argument("--memory-budget", type=int, default=1 << 30, help="bytes for the head's tiles")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    parser.add_argument("--corpus", type=Path, default=SHARED / "tatar-corpus" / "train.txt", help="the multiple-choice text")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from tatblimp_callback.harness import register

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # as bench_lm_eval_model.py
    tokenizer = load_converted_tokenizer(args.tokenizer)
    model = make_model(args.shape, len(tokenizer), device, dtype)
    lm = register()(pretrained=model, tokenizer=tokenizer, max_length=2048)
    config = model.config
    report = {
        "machine": {**machine_info(device), "load_before": list(os.getloadavg())},
        "shape": args.shape,
        "batch_positions": args.batch_positions,
        # every layer's key and value at one position: what the cache holds for each context and choice position
        "kv_bytes_per_position": 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize,
    }
    for count in map(int, args.requests.split(",")):
        requests = mc_requests(args.corpus, count // 4, args.context_words)
        result = report[f"requests_{count}"] = measure(lm, model, requests, args.rounds, args.batch_positions, args.memory_budget)
        for name, r in result.items():
            if name == "requests":
                continue
            print(
                f"{count:,} requests, {name}: host {1000 * r['host']:.1f} ms (of it the KV copies {1000 * r['kv_copy']:.1f}), "
                f"body {1000 * r['body']:.0f} ms, head {r['head']:.2f} s; KV held {r['kv_bytes'] / 2**20:.0f} MiB; "
                f"max |diff| from the engine {r['max_abs_logprob_diff_from_engine']:.1e}, "
                f"greedy differs {r['is_greedy_differs_from_engine']}",
                flush=True,
            )
    report["machine"]["load_after"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
