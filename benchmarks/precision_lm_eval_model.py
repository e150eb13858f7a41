"""How far ``--model tatblimp``'s log-probs are from ``--model hf``'s, in float32 and in bfloat16: a precision figure.

Both models wrap one randomly initialised Llama (``bench_scoring.SHAPES``, the benchmark's initializer range 0.1)
with the shared 48K SentencePiece tokenizer and get the same ``Instance`` lists as ``bench_lm_eval_model.py``
(BLiMP pairs after the empty context; multiple choice with long shared contexts). For each dtype, every request's
log-prob is compared: the largest absolute difference in nats, the largest relative to the request's |log-prob|,
the median |log-prob|, and the ``is_greedy`` flags that differ. ``hf`` is run twice: as the harness runs it
(``softmax_dtype`` unset: its log-softmax and its sum over the continuation in the model's dtype) and with
``softmax_dtype=float32``, which leaves only the model's own forward rounding between the two.

    python benchmarks/precision_lm_eval_model.py --shapes 1.5m,tiny --json benchmarks/results/precision.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_lm_eval_model import SHARED, blimp_requests, mc_requests  # noqa: E402
from bench_scoring import DTYPES, load_converted_tokenizer, machine_info, make_model  # noqa: E402


def compare(reference: list[tuple[float, bool]], ours: list[tuple[float, bool]]) -> dict:
    """The largest |difference| (nats and relative), the median |log-prob| and the differing greedy flags."""
    pairs = list(zip(reference, ours, strict=True))
    return {
        "requests": len(pairs),
        "max_abs_diff_nats": max(abs(a - b) for (a, _), (b, _) in pairs),
        "max_rel_diff": max(abs(a - b) / abs(a) for (a, _), (b, _) in pairs if a),
        "median_abs_logprob": statistics.median(abs(a) for a, _ in reference),
        "is_greedy_differs": sum(g != h for (_, g), (_, h) in pairs),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1.5m,tiny")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--blimp-per-file", type=int, default=2, help="the first N pairs of each of BLiMP's 67 files")
    parser.add_argument("--mc-questions", type=int, default=20)
    parser.add_argument("--mc-context-words", type=int, default=150)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    from lm_eval.models.huggingface import HFLM

    from tatblimp_callback.harness import register

    device = torch.device("cpu")
    tokenizer = load_converted_tokenizer(SHARED / "tokenizers" / "kypchak_unigram_48k.model")
    requests = {
        "blimp": blimp_requests(SHARED / "blimp" / "data", args.blimp_per_file),
        "mc": mc_requests(SHARED / "tatar-corpus" / "train.txt", args.mc_questions, args.mc_context_words),
    }
    report = {"machine": machine_info(device, lm_eval=__import__("lm_eval").__version__), "results": {}}
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            model = make_model(shape, len(tokenizer), device, DTYPES[dtype])
            common = dict(pretrained=model, tokenizer=tokenizer, max_length=2048)
            ours = register()(**common)
            references = {
                "hf": HFLM(batch_size=64, **common),
                "hf_softmax_float32": HFLM(batch_size=64, softmax_dtype="float32", **common),
            }
            for task, instances in requests.items():
                mine = ours.loglikelihood(instances, disable_tqdm=True)
                for label, hf in references.items():
                    row = compare(hf.loglikelihood(instances, disable_tqdm=True), mine)
                    report["results"][f"{shape}/{dtype}/{task}/{label}"] = row
                    print(shape, dtype, task, label, row, flush=True)
                    if args.json:  # written as it goes: a long run that is stopped keeps what it measured
                        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
