"""What scoring in low precision costs and does to decisions (issue #54): per precision, the evaluation's time, the
share of pairs ``exact_decisions`` rescores and its cost, and decision flips against float32.

For each initializer range (``--inits``, default 0.02 and 0.1), one randomly initialised Llama of ``--model-shape``
is made and rounded to bf16; the reference is a float32 evaluation of those same bf16 weights (a float32 copy,
``exact_decisions`` off). Against it, each configuration is one ``Evaluator`` on the prebuilt cache, timed over
``--repeats`` calls after its first (the method check):

- ``float32``: the float32 copy itself (the reference's time);
- ``bfloat16``: the bf16 weights, ``exact_decisions=False``, then ``exact_decisions=True``;
- ``mixed``: float32 weights (the copy) under bf16 autocast (``precision="bfloat16"``), as a Trainer with
  ``bf16=True`` is scored under ``precision="auto"``; both ways of deciding;
- ``float16`` with ``--float16``: fp16 autocast on the float32 copy, both ways.

Flips count acc and acc_norm decisions (2 x 1,248) that differ from the reference's. Targets (issue #54): 0 flips
with exact decisions; mixed within 1.2x of pure bf16; exact decisions at most 1.5x the low-precision evaluation at
init 0.02.

    python benchmarks/bench_precision.py --device cpu --model-shape 1.5m --json precision.json
    python benchmarks/bench_precision.py --device cuda --model-shape 478m --json $OUT/precision.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scoring import SHAPES, load_converted_tokenizer, model_arguments, timed

from tatblimp_callback import Evaluator, build_cache, load_benchmark

TARGET_MIXED = 1.2  # mixed precision's time over pure bf16's
TARGET_EXACT = 1.5  # exact decisions' time over the low-precision evaluation's, at init 0.02


def make_model(shape: str, vocab_size: int, device: torch.device, init: float, seed: int = 0):
    """A random Llama of ``shape`` with ``initializer_range=init`` (tied embeddings, sdpa), its weights rounded to bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=init,
        attn_implementation="sdpa",
        **SHAPES[shape],
    )
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def flips(results, reference) -> int:
    """acc and acc_norm decisions that differ between ``results`` and ``reference``."""
    ours, theirs = results.outcomes(), reference.outcomes()
    return sum(a != b for key in ("acc", "acc_norm") for a, b in zip(ours[key], theirs[key], strict=True))


def measure(model, cache, device, repeats: int, reference=None, **options) -> tuple:
    """One configuration: (its results, its row of the report)."""
    evaluator = Evaluator(cache=cache, **options)
    first_start = time.perf_counter()
    evaluator(model)  # the method check, the head's timing
    first = time.perf_counter() - first_start
    results, seconds, _ = timed(lambda: evaluator(model), device, repeats)
    exact = results.run_info.get("exact_decisions")
    row = {
        "precision": results.run_info["precision"],
        "weights": results.run_info["dtype"],
        "seconds": seconds,
        "first_call_seconds": first,
        "scoring_method": results.run_info["scoring_method"],
        "acc": results.acc,
        "acc_norm": results.acc_norm,
    }
    if exact is not None:
        row.update(
            rescored_pairs=exact["rescored_pairs"],
            rescored_share=exact["rescored_pairs"] / len(results.pairs),
            rescore_seconds=exact["seconds"],
            bound_per_token=exact["bound_per_token"],
        )
    if reference is not None:
        row["flips_vs_float32"] = flips(results, reference)
    return results, row


def one_init(args, tokenizer, cache, device, init: float) -> dict:
    bf16 = make_model(args.model_shape, len(tokenizer), device, init)
    float32 = copy.deepcopy(bf16).float()  # the same bf16 weights, upcast
    reference, rows = None, {}
    reference, rows["float32"] = measure(float32, cache, device, args.repeats, exact_decisions=False)
    rows["float32"]["flips_vs_float32"] = 0
    configs = [("bfloat16", bf16, "auto"), ("mixed_bf16_autocast", float32, "bfloat16")]
    if args.float16:
        configs.append(("mixed_fp16_autocast", float32, "float16"))
    for name, model, precision in configs:
        for exact in (False, True):
            key = f"{name}{'_exact' if exact else ''}"
            _, rows[key] = measure(model, cache, device, args.repeats, reference, precision=precision, exact_decisions=exact)
            print(init, key, json.dumps(rows[key]), flush=True)
    bf16_seconds = rows["bfloat16"]["seconds"]
    rows["ratios"] = {
        "mixed_over_bf16": rows["mixed_bf16_autocast"]["seconds"] / bf16_seconds,
        "bf16_exact_over_bf16": rows["bfloat16_exact"]["seconds"] / bf16_seconds,
        "mixed_exact_over_mixed": rows["mixed_bf16_autocast_exact"]["seconds"] / rows["mixed_bf16_autocast"]["seconds"],
        "float32_over_bf16": rows["float32"]["seconds"] / bf16_seconds,
    }
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, shape="478m", device="cuda")
    parser.add_argument("--inits", type=float, nargs="+", default=[0.02, 0.1], help="initializer ranges")
    parser.add_argument("--repeats", type=int, default=3, help="timed evaluations per configuration (min is kept)")
    parser.add_argument("--float16", action="store_true", help="also fp16 autocast on the float32 weights")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in IEEE float32
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model_shape": args.model_shape,
        "date": time.strftime("%Y-%m-%d"),
        "inits": {},
    }
    tokenizer = load_converted_tokenizer(args.tokenizer)
    cache = build_cache(tokenizer, load_benchmark(args.data, allow_modified=True), device=device)
    for init in args.inits:
        report["inits"][str(init)] = rows = one_init(args, tokenizer, cache, device, init)
        exact_keys = [key for key in rows if key.endswith("_exact")]
        rows["targets"] = {
            "no_flips_with_exact_decisions": all(rows[key]["flips_vs_float32"] == 0 for key in exact_keys),
            "mixed_within_1.2x_of_bf16": rows["ratios"]["mixed_over_bf16"] <= TARGET_MIXED,
            "exact_within_1.5x": rows["ratios"]["bf16_exact_over_bf16"] <= TARGET_EXACT,
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
