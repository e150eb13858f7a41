"""The ``--backend`` options of ``tatblimp score`` and ``tatblimp sweep``: which engine scores, and vLLM's own options.

``--backend transformers`` (the default) loads the model with transformers and scores it with the
library's own engine (``engine/scoring.py``); ``--backend vllm`` starts a vLLM engine for the model
folder or Hub id instead (``engine/vllm_scoring.py``), with the options below. The options of one
backend are an error with the other, before anything loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..engine.vllm_scoring import BACKENDS, VllmOptions

# Options of the default backend's loader that vLLM does not take: it places the weights itself.
_TRANSFORMERS_ONLY = {
    "device": "--device",
    "device_map": "--device-map",
    "tp_plan": "--tp-plan",
    "attn_implementation": "--attn-implementation",
    "memory_budget_mb": "--memory-budget-mb",
}
_VLLM_ONLY = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
}


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend`` and vLLM's options (``VllmOptions``), in a group of their own."""
    group = parser.add_argument_group("the scoring engine (see docs/guides/vllm.md)")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="transformers",
        help="transformers: load the model and score it in this process (default); vllm: start a vLLM engine "
        "for it (pip install 'tatblimp-callback[vllm]')",
    )
    group.add_argument("--tensor-parallel-size", type=int, metavar="N", help="vllm: GPUs each layer is split over (default: 1)")
    group.add_argument(
        "--pipeline-parallel-size", type=int, metavar="N", help="vllm: stages the layers are split into (default: 1)"
    )
    group.add_argument(
        "--gpu-memory-utilization", type=float, metavar="F", help="vllm: share of each GPU's memory it may take (default: 0.9)"
    )
    group.add_argument(
        "--max-model-len", type=int, metavar="N", help="vllm: the engine's context (default: what the longest sentence needs)"
    )


def uses_vllm(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for the vLLM backend; ValueError for an option of the other backend."""
    vllm = getattr(args, "backend", "transformers") == "vllm"
    wrong = _TRANSFORMERS_ONLY if vllm else _VLLM_ONLY
    given = [flag for name, flag in wrong.items() if getattr(args, name, None) not in (None, False)]
    if given and vllm:
        raise ValueError(f"{', '.join(given)}: an option of --backend transformers; vLLM places and sizes the model itself")
    if given:
        raise ValueError(f"{', '.join(given)}: an option of --backend vllm")
    return vllm


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``evaluate``/``Evaluator`` keyword arguments of ``args``: ``backend`` and, for vLLM, ``vllm_options``."""
    if not uses_vllm(args):
        return {}
    options = VllmOptions(
        tensor_parallel_size=args.tensor_parallel_size or 1,
        pipeline_parallel_size=args.pipeline_parallel_size or 1,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        revision=getattr(args, "revision", None),
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    return {"backend": "vllm", "vllm_options": options}


def score_through_endpoint(args: argparse.Namespace):
    """``tatblimp score --endpoint URL --model-name NAME --tokenizer TOK`` (``--protocol logprob``): the ``Results``."""
    import json
    import os
    import sys

    from ..chat.logprob_endpoint import CompletionsClient, evaluate_logprob_endpoint
    from ..reading.data import load_benchmark
    from .loading import load_tokenizer

    if not args.model_name:
        raise ValueError("--endpoint needs --model-name (the model field of each request)")
    if args.model:
        raise ValueError(f"give either a model folder ({args.model}) or --endpoint, not both")
    if not args.tokenizer:
        raise ValueError(
            "--protocol logprob with --endpoint needs --tokenizer: the served model's tokenizer, whose token ids are sent"
        )
    if uses_vllm(args):
        raise ValueError("--backend vllm starts an engine in this process; an --endpoint is a server's")
    if getattr(args, "suite", None) or getattr(args, "suites_only", False):
        raise ValueError("--suite is not scored through --endpoint; score each suite's file with --data")
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body}")
    tokenizer = load_tokenizer(args.tokenizer)
    benchmark = load_benchmark(args.data, allow_modified=args.allow_modified).select(args.limit, args.phenomena)
    client = CompletionsClient(
        args.endpoint,
        args.model_name,
        api_key=os.environ.get(args.api_key_env) or None,
        extra_body=extra_body,
        timeout=args.timeout,
        max_retries=args.max_retries,
    )
    return evaluate_logprob_endpoint(
        client,
        tokenizer,
        benchmark,
        prefix_token_id=args.prefix_token_id,
        results_path=args.results,
        concurrency=args.concurrency,
        allow_modified=args.allow_modified,
        include_tokens=getattr(args, "include_tokens", False),
        progress=sys.stderr.isatty(),
    )
