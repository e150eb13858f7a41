"""What the library itself costs per evaluation, beside the model: the overhead ratio, the host time, the masks.

In one process and one run:

  (a) overhead: one TatBLiMP evaluation (``Scorer.score``, after the first) with a near-free model (a
      character-level tokenizer over the benchmark's characters, a 1-layer, hidden-8 Llama), divided
      by a dense packed forward of the same tokens with logits, log-softmax and the gather of the
      targets (its batches built beforehand, not timed);
  (b) host time: one TatBLiMP evaluation with the TATlit 48K tokenizer and a small random Llama, less
      the time inside the model's forward (``forward.model_output``) and the head (``forward.read_logprobs``, or
      the tiled head's ``head_choice.method_logprobs``);
  (c) the same on a model of the 478M shape's depth (24 layers, hidden 16); the same evaluation on the CUDA graph
      path with replays that cost nothing (``graph_path_host``: what that path spends beside the GPU's work,
      measured on any device); and apart, in ms, the checks made at every evaluation whose cost grows with the
      number of modules: the weights' fingerprint (``model_checks.weight_fingerprint``; once the weights have
      moved, only at a re-check), the structure that CUDA graphs are keyed by (``cuda_graphs.model_structure``;
      CUDA only), and ``model_state.scoring_mode``;
  (m) the tree mask's options on the CPU: the model's body over the same tree rows with the dense boolean
      mask, the additive float mask, rows of half and twice the length, and packed rows without a mask
      (exactness: each one's per-sentence log-probs against the default's); with ``--flex``, FlexAttention
      with the interval ``mask_mod`` against SDPA with the dense mask on the attention alone (compiled
      once: about a minute on a CPU).

The first evaluation's one-time costs (the plan, the method check) are reported on their own, and a
profile of (a) names the functions the rest of the time goes to.

    python benchmarks/bench_overhead.py --json overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tatblimp_callback import Scorer, ScoringMethod, SentencePieceTokenizer, build_cache, load_benchmark  # noqa: E402
from tatblimp_callback.engine import batch_forward, head_choice  # noqa: E402

SHARED = REPO.parent / "shared"


def char_tokenizer(benchmark):
    """A ``tokenizers`` WordLevel model over the benchmark's characters, one token a character."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted({ch for pair in benchmark.pairs for text in (pair.good, pair.bad) for ch in text})
    vocab = {"<s>": 0, "<unk>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", unk_token="<unk>")


def llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, context: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=0.1,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def best(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times), times


def first_and_best(scorer: Scorer, repeats: int) -> dict:
    start = time.perf_counter()
    scores = scorer.score()
    first = time.perf_counter() - start
    setup = dict(scorer.setup_seconds)
    seconds, times = best(scorer.score, repeats)
    layout = scorer.layout()
    return {
        "scores": scores,
        "first_call_seconds": first,
        "first_call_plan_seconds": setup["plan"],
        "first_call_method_check_seconds": setup["method_check"],
        "seconds": seconds,
        "times": times,
        "method": str(scorer.method),
        "positions": layout.total_positions,
        "forward_calls": len(layout.batches),
        "plan_bytes": layout.plan_bytes,
        "plan_bytes_per_position": layout.plan_bytes / max(layout.total_positions, 1),
        "memory_budget": scorer.memory_budget,
    }


@torch.no_grad()
def dense_packed_floor(model, scorer: Scorer, repeats: int) -> dict:
    """The model's own forward over packed rows of every input token, logits, float32 log-softmax, the gather."""
    batches = list(scorer.layout("packed").batches)  # built before the clock starts

    def run():
        for batch in batches:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            logprobs = logits.reshape(-1, logits.shape[-1])[batch.score_positions].float().log_softmax(-1)
            logprobs[batch.score_contexts, batch.score_targets].sum()

    seconds, times = best(run, repeats)
    return {"seconds": seconds, "times": times, "tokens": sum(b.score_targets.numel() for b in batches)}


def profile_top(fn, count: int = 10) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:count]  # by own time
    return [{"function": f"{Path(f).name}:{line}({name})", "own_seconds": s[2], "calls": s[1]} for (f, line, name), s in rows]


def host_seconds(scorer: Scorer, repeats: int) -> dict:
    """An evaluation's time outside the model's forward and the head, the best of ``repeats``.

    On a GPU the device is synchronised before and after each forward and head call, so that their
    time is theirs; the host time is then what a GPU cannot overlap with its own work.
    """
    inside = [0.0]
    calls: dict[str, int] = {}  # each timed function's calls over the repeats

    def timed(fn):
        def wrapper(*args, **kwargs):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize()
                inside[0] += time.perf_counter() - start

        return wrapper

    # Where the scorer looks them up: the body's call and both heads' (the tiled one through ``head_choice``).
    patched = [(batch_forward, "model_output"), (batch_forward, "read_logprobs"), (head_choice, "method_logprobs")]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, timed(original))
    try:
        rows = []
        for _ in range(repeats):
            inside[0] = 0.0
            synchronize()
            start = time.perf_counter()
            scorer.score()
            synchronize()
            total = time.perf_counter() - start
            rows.append((total - inside[0], total, inside[0]))
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)
    host, total, model = min(rows)
    return {"host_seconds": host, "seconds": total, "model_and_head_seconds": model, "all": rows, "timed_calls": calls}


def graph_path_host(model, cache, repeats: int) -> dict:
    """The best of ``repeats`` evaluations on the CUDA graph path whose replays cost nothing (each graph's output is
    what its capture computed, right for these unchanged weights): the host time of that path, on any device."""
    from tatblimp_callback.engine.cuda_graphs import TorchGraphs

    class FreeReplays(TorchGraphs):
        def supports(self, device):
            return True

        def pool(self):
            return object()

        def warm(self, fn):
            return fn()

        def capture(self, fn, pool):
            output = fn()
            return output, output

        def replay(self, graph):
            pass

    scorer = Scorer(model, cache)
    scorer.graphs.graph_factory = FreeReplays()
    for _ in range(3):  # the method check, the capture
        scorer.score()
    seconds, times = best(scorer.score, repeats)
    return {"seconds": seconds, "times": times, "replays": scorer.graphs.replays, "reason": scorer.graphs.reason}


def per_evaluation_checks(model, repeats: int, number: int = 20) -> dict:
    """Milliseconds of each check an evaluation makes on ``model`` whose cost grows with its modules (best of
    ``repeats`` runs of ``number`` calls)."""
    import timeit

    from tatblimp_callback.engine.cuda_graphs import model_structure
    from tatblimp_callback.engine.model_checks import weight_fingerprint
    from tatblimp_callback.engine.model_state import scoring_mode

    def enter_and_leave_scoring_mode():
        with scoring_mode(model):
            pass

    checks = {
        "weight_fingerprint": lambda: weight_fingerprint(model),
        "model_structure": lambda: model_structure(model),
        "scoring_mode": enter_and_leave_scoring_mode,
    }
    return {name: 1000 * min(timeit.repeat(fn, number=number, repeat=repeats)) / number for name, fn in checks.items()}


@torch.no_grad()
def mask_options(model, cache, repeats: int) -> dict:
    """The body over tree rows with each mask, and over packed rows; each one's log-probs against the default's."""
    from tatblimp_callback.engine.tree_mask import interval_mask

    out = {}
    reference = Scorer(model, cache, method=ScoringMethod("tree", "tiled")).score()
    for name, kind, row_length, additive in [
        ("tree rows of 256, boolean mask", "tree", 256, False),
        ("tree rows of 256, additive float mask", "tree", 256, True),
        ("tree rows of 128, boolean mask", "tree", 128, False),
        ("tree rows of 512, boolean mask", "tree", 512, False),
        ("packed rows of 256, no mask", "packed", 256, False),
    ]:
        scorer = Scorer(model, cache, method=ScoringMethod(kind, "tiled"), row_length=row_length)
        layout = scorer.layout()
        batches = list(layout.batches)
        if additive:
            for index, batch in enumerate(batches):
                sizes = layout.batches.prepared[index]["sizes"].view(batch.input_ids.shape)
                batch.attention_mask = interval_mask(sizes, torch.float32)

        def body(batches=batches):
            for b in batches:
                model.model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask, use_cache=False)

        seconds, _ = best(body, repeats)
        scores = scorer.score()
        out[name] = {
            "body_seconds": seconds,
            "positions": layout.total_positions,
            "max_abs_diff_vs_default": float((scores - reference).abs().max()),
        }
    return out


def flex_against_sdpa(cache, model, repeats: int, dtype: torch.dtype = torch.float32) -> dict:
    """The attention alone over the plan's first tree batch: SDPA with the dense mask, FlexAttention with the interval mask_mod."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tatblimp_callback.engine.tree_mask import flex_mask_mod, interval_mask

    scorer = Scorer(model, cache, method=ScoringMethod("tree", "tiled"))
    layout = scorer.layout()
    sizes = layout.batches.prepared[0]["sizes"].long().view(-1, scorer.row_length)
    rows, width = sizes.shape
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    device = sizes.device
    q, k, v = (torch.randn(rows, heads, width, dim, device=device, dtype=dtype) for _ in range(3))
    dense = interval_mask(sizes)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
    compiled = torch.compile(flex_attention)
    start = time.perf_counter()
    block_mask = create_block_mask(flex_mask_mod(sizes), rows, None, width, width, device=device)
    flex = lambda: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
    flex()
    compile_seconds = time.perf_counter() - start
    sdpa_seconds, _ = best(sdpa, repeats)
    flex_seconds, _ = best(flex, repeats)
    return {
        "shape": [rows, heads, width, dim],
        "sdpa_dense_seconds": sdpa_seconds,
        "flex_seconds": flex_seconds,
        "flex_compile_seconds": compile_seconds,
        "block_sparsity": float(block_mask.sparsity()) / 100,
        "max_abs_diff": float((sdpa() - flex()).abs().max()),
        "dtype": str(dtype),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED / "tatblimp" / "test.jsonl")
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-masks", action="store_true")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention against SDPA (compiles: about a minute)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    benchmark = load_benchmark(args.data, allow_modified=True)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
    }

    # (a) the overhead ratio
    tokenizer = char_tokenizer(benchmark)
    cache = build_cache(tokenizer, benchmark)
    model = llama(len(tokenizer), hidden=8, layers=1, heads=2, kv_heads=1)
    scorer = Scorer(model, cache)
    ours = first_and_best(scorer, args.repeats)
    floor = dense_packed_floor(model, scorer, args.repeats)
    ours.pop("scores")
    report["overhead"] = {
        "tokens": sum(cache.lengths) - cache.num_sentences,
        "ours": ours,
        "dense_packed_floor": floor,
        "ratio": ours["seconds"] / floor["seconds"],
        "profile": profile_top(scorer.score),
    }
    print(
        f"(a) overhead: {ours['seconds']:.3f} s against a dense packed forward's {floor['seconds']:.3f} s: "
        f"{report['overhead']['ratio']:.2f}x; first call {ours['first_call_seconds']:.2f} s "
        f"(plan {ours['first_call_plan_seconds']:.2f} s, method check {ours['first_call_method_check_seconds']:.2f} s)"
    )

    # (b) host time with the TATlit tokenizer
    spm = SentencePieceTokenizer(args.tokenizer)
    spm_cache = build_cache(spm, benchmark)
    small = llama(len(spm), hidden=32, layers=2, heads=4, kv_heads=2)
    spm_scorer = Scorer(small, spm_cache)
    spm_ours = first_and_best(spm_scorer, 1)
    spm_ours.pop("scores")
    host = host_seconds(spm_scorer, args.repeats)
    report["host"] = {"ours": spm_ours, **host}
    print(
        f"(b) host: {1000 * host['host_seconds']:.1f} ms of a {1000 * host['seconds']:.0f} ms evaluation "
        f"(plan {spm_ours['plan_bytes'] / 2**20:.2f} MiB, {spm_ours['plan_bytes_per_position']:.1f} B/position)"
    )

    # (c) the 478M shape's depth
    deep = llama(len(spm), hidden=16, layers=24, heads=2, kv_heads=1)
    deep_scorer = Scorer(deep, spm_cache)
    first_and_best(deep_scorer, 1)
    report["deep"] = {
        **host_seconds(deep_scorer, args.repeats),
        "graph_path": graph_path_host(deep, spm_cache, args.repeats),
        "checks_ms": per_evaluation_checks(deep, args.repeats),
    }
    checks = ", ".join(f"{name} {ms:.2f}" for name, ms in report["deep"]["checks_ms"].items())
    print(
        f"(c) 24 layers: host {1000 * report['deep']['host_seconds']:.1f} ms; the graph path, replays free: "
        f"{1000 * report['deep']['graph_path']['seconds']:.1f} ms; per-evaluation checks (ms): {checks}"
    )

    if not args.skip_masks:
        report["masks"] = mask_options(small, spm_cache, args.repeats)
        for name, row in report["masks"].items():
            print(
                f"(m) {name}: body {row['body_seconds']:.3f} s over {row['positions']} positions, "
                f"max |diff| {row['max_abs_diff_vs_default']:.1e}"
            )
    if args.flex:
        report["flex"] = flex_against_sdpa(spm_cache, small, args.repeats)
        print(f"(m) flex: {report['flex']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
