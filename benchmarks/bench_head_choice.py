"""The LM head chosen by measurement (``engine/head_choice.py``), on a range of model shapes, in one run.

For each shape (vocabulary, hidden size, layers), on one randomly initialised Llama and the same token ids:

- the first evaluation of a fresh ``Scorer`` that times the head's candidates (``auto``), and of fresh scorers
  forced to today's tiles and to the method ``auto`` chose: what the choosing added, measured from outside,
  and as the choice accounts for it itself (``timing_added_seconds``: what its pieces cost above the fastest);
- later evaluations, ``auto`` and today's tiles alternated (``--repeats`` rounds, best of each): the speed-up
  over today's engine, in the same run;
- lm-evaluation-harness 0.4.13's ``HFLM._loglikelihood_tokens`` (batch 64) on the same token ids (each
  sequence's first token as the context, as lm-eval scores a sentence with an empty context);
- the distinct-context floor (``bench_scoring.py``'s: the body over the tree rows, measured, plus the head's
  matmul at a large square matmul's rate and one softmax pass, for the distinct contexts), measured in every
  round next to the evaluations (the matmul's rate too), so that both see the same load; the load average
  of each round is kept.

Token ids: the 4K shape tokenizes with a byte-level BPE trained on the shared Tatar corpus; the others
with the 48K TATlit SentencePiece model, ids taken modulo a smaller vocabulary (32K): the head's cost
depends on the vocabulary's size, not on which pieces it holds. ``4k-byte+16000`` adds 16,000 pairs of
long corpus sentences (``bench_suites.corpus_suite``) to TatBLiMP.

    python benchmarks/bench_head_choice.py --repeats 2 --json benchmarks/results/2026-12-02-cpu-head-choice-quiet.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scoring import SHARED, body_seconds, load_converted_tokenizer, matmul_gflops, softmax_seconds_per_row
from bench_suites import CORPUS, corpus_suite

from tatblimp_callback import Scorer, build_cache, load_benchmark
from tatblimp_callback.tokenized.cache import concat_caches

# name: (vocabulary, hidden, layers, heads, share of TatBLiMP's pairs, byte-level tokenizer, corpus pairs)
SHAPES = {
    "4k-byte": (4096, 128, 3, 4, 1.0, True, 0),
    "4k-byte+16000": (4096, 128, 3, 4, 1.0, True, 16000),
    "32k": (32000, 256, 4, 4, 1.0, False, 0),
    "48k": (48000, 256, 4, 4, 1.0, False, 0),
    "128k": (128256, 512, 4, 8, 0.25, False, 0),
    "256k": (262144, 640, 4, 8, 0.25, False, 0),
}


def byte_level_tokenizer(vocab_size: int, lines: int = 20000):
    """A byte-level BPE of ``vocab_size`` trained on the shared Tatar corpus (as the tests' ``train_bpe``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines()[:lines], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_model(vocab: int, hidden: int, layers: int, heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.1,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def shape_cache(name: str, tokenizers: dict):
    vocab, _, _, _, share, byte_level, corpus_pairs = SHAPES[name]
    tokenizer = tokenizers["byte"] if byte_level else tokenizers["spm"]
    benchmark = load_benchmark(SHARED / "tatblimp" / "test.jsonl", allow_modified=True)
    if share < 1:
        benchmark = replace(benchmark, pairs=benchmark.pairs[: int(len(benchmark.pairs) * share)])
    cache = build_cache(tokenizer, benchmark, allow_modified=True)
    if corpus_pairs:
        cache = concat_caches([cache, build_cache(tokenizer, corpus_suite(corpus_pairs), allow_modified=True)])
    if not byte_level:
        cache = replace(cache, token_ids=cache.token_ids % vocab, prefix_token_id=cache.prefix_token_id % vocab)
    return cache


def first_evaluation(model, cache, head_method=None) -> tuple[Scorer, float, torch.Tensor]:
    scorer = Scorer(model, cache, head_method=head_method)
    start = time.perf_counter()
    scores = scorer.score()
    return scorer, time.perf_counter() - start, scores


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def lm_eval_seconds(model, tokenizer, cache, batch_size: int = 64) -> tuple[float, torch.Tensor]:
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32)
    ids = cache.token_ids.tolist()
    offsets = cache.offsets.tolist()
    requests = [(("", ""), ids[a : a + 1], ids[a + 1 : b]) for a, b in itertools.pairwise(offsets)]
    start = time.perf_counter()
    result = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    return time.perf_counter() - start, torch.tensor([logprob for logprob, _ in result], dtype=torch.float64)


def run_shape(name: str, tokenizers: dict, args, log) -> dict:
    vocab, hidden, layers, heads, share, byte_level, corpus_pairs = SHAPES[name]
    cache = shape_cache(name, tokenizers)
    model = make_model(vocab, hidden, layers, heads)
    row = {
        "vocab": vocab,
        "hidden": hidden,
        "layers": layers,
        "sentences": cache.num_sentences,
        "scored_tokens": sum(cache.lengths) - cache.num_sentences,
        "tatblimp_share": share,
        "corpus_pairs": corpus_pairs,
    }
    log(f"{name}: V={vocab} H={hidden} L={layers}, {row['sentences']} sentences, {row['scored_tokens']} scored tokens")
    with torch.no_grad():
        auto, auto_first, auto_scores = first_evaluation(model, cache)
        tiles, tiles_first, tiles_scores = first_evaluation(model, cache, "tiles")
        chosen = str(auto.head_method)
        _, chosen_first, _ = first_evaluation(model, cache, chosen)
        row.update(
            scoring_method=str(auto.method),
            head_choice=auto.head_choice,
            first_evaluation_seconds={"auto": auto_first, "tiles": tiles_first, "chosen_forced": chosen_first},
            method_check_seconds=auto.setup_seconds["method_check"],
            auto_vs_tiles_max_abs_diff=float((auto_scores - tiles_scores).abs().max()),
        )
        layout = auto.layout()
        contexts = layout.total_positions - layout.padded_positions
        times = {"auto": [], "tiles": [], "floor": [], "matmul_gflops": [], "load_average": []}
        for _ in range(args.repeats):  # alternated, the floor too: the machine's load falls on all alike
            times["auto"].append(timed(auto.score))
            times["tiles"].append(timed(tiles.score))
            rate = matmul_gflops(torch.device("cpu"), torch.float32, 3)  # the head matmul's rate at this moment
            body = body_seconds(model, layout, torch.device("cpu"), 1)
            softmax = softmax_seconds_per_row(vocab, torch.device("cpu"), 1) * contexts
            head = 2 * contexts * hidden * vocab / (rate * 1e9)
            times["floor"].append(
                {"body_seconds": body, "head_matmul_seconds": head, "softmax_seconds": softmax, "seconds": body + head + softmax}
            )
            times["matmul_gflops"].append(rate)
            times["load_average"].append(os.getloadavg()[0])
        row["evaluation_seconds"] = {k: min(times[k]) for k in ("auto", "tiles")}
        row["evaluation_times"] = times
        floor = min(times["floor"], key=lambda f: f["seconds"])
        row["floor_distinct_contexts"] = {"contexts": contexts, **floor}
        # The same round's ratio: the evaluation and the floor a few seconds apart.
        row["auto_over_floor_per_round"] = [a / f["seconds"] for a, f in zip(times["auto"], times["floor"], strict=True)]
        if not args.skip_lm_eval:
            tokenizer = tokenizers["byte"] if byte_level else tokenizers["spm"]
            seconds, theirs = lm_eval_seconds(model, tokenizer, cache)
            row["lm_eval_seconds"] = seconds
            row["lm_eval_max_abs_diff"] = float((auto.score() - theirs).abs().max())
    best = row["evaluation_seconds"]["auto"]
    row["auto_over_tiles"] = best / row["evaluation_seconds"]["tiles"]
    row["auto_over_floor"] = best / row["floor_distinct_contexts"]["seconds"]
    row["choice_added_share"] = row["head_choice"].get("timing_added_seconds", 0.0) / auto_first
    row["first_auto_over_first_chosen"] = auto_first / chosen_first
    if "lm_eval_seconds" in row:
        row["lm_eval_over_auto"] = row["lm_eval_seconds"] / best
    log(
        f"{name}: chose {chosen}; auto {best:.2f} s, tiles {row['evaluation_seconds']['tiles']:.2f} s "
        f"({row['auto_over_tiles']:.2f}x), floor {row['floor_distinct_contexts']['seconds']:.2f} s ({row['auto_over_floor']:.2f}x), "
        f"lm-eval {row.get('lm_eval_seconds', float('nan')):.2f} s ({row.get('lm_eval_over_auto', float('nan')):.2f}x); "
        f"choice added {row['choice_added_share']:.1%} of the first evaluation ({auto_first:.2f} s; forced {chosen_first:.2f} s)"
    )
    return row


def log(message: str) -> None:
    """A progress line with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def shape_tokenizers(names: list[str]) -> dict:
    """The tokenizers the shapes ``names`` need: ``"byte"`` (a 4K byte-level BPE) and ``"spm"`` (TATlit's 48K)."""
    tokenizers = {}
    if any(SHAPES[n][5] for n in names):
        tokenizers["byte"] = byte_level_tokenizer(4096)
    if any(not SHAPES[n][5] for n in names):
        tokenizers["spm"] = load_converted_tokenizer(SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    return tokenizers


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-lm-eval", action="store_true")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    names = args.shapes.split(",")
    tokenizers = shape_tokenizers(names)
    gflops = matmul_gflops(torch.device("cpu"), torch.float32, 10)
    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "matmul_gflops": gflops,
        "load_average_start": os.getloadavg(),
        "shapes": {},
    }
    for name in names:
        started = time.strftime("%H:%M", time.gmtime())
        report["shapes"][name] = run_shape(name, tokenizers, args, log)
        report["shapes"][name].update(started_utc=started, finished_utc=time.strftime("%H:%M", time.gmtime()))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
