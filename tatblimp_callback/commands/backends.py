"""The ``--backend`` options of ``tatblimp score`` and ``tatblimp sweep``: which engine scores, and vLLM's own options.

``--backend transformers`` (the default) loads the model with transformers and scores it with the
library's own engine (``engine/scoring.py``); ``--backend vllm`` starts a vLLM engine for the model
folder or Hub id instead (``engine/vllm_scoring.py``), with the options below. The options of one
backend are an error with the other, before anything loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..reading.option_types import positive_int, share, whole_number

# Options of the default backend's loader that vLLM does not take: it places the weights itself.
_TRANSFORMERS_ONLY = {
    "device": "--device",
    "device_map": "--device-map",
    "tp_plan": "--tp-plan",
    "attn_implementation": "--attn-implementation",
    "memory_budget_mb": "--memory-budget-mb",
    "head_method": "--head-method",
    "row_length": "--row-length",
    "no_cuda_graphs": "--no-cuda-graphs",
    "compile": "--compile",
    "precision": "--precision",
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
        choices=("transformers", "vllm"),  # engine/vllm_scoring.BACKENDS, without importing torch for --help
        default="transformers",
        help="transformers: load the model and score it in this process (default); vllm: start a vLLM engine "
        "for it (pip install 'tatblimp-callback[vllm]')",
    )
    group.add_argument(
        "--tensor-parallel-size", type=positive_int, metavar="N", help="vllm: GPUs each layer is split over (default: 1)"
    )
    group.add_argument(
        "--pipeline-parallel-size", type=positive_int, metavar="N", help="vllm: stages the layers are split into (default: 1)"
    )
    group.add_argument(
        "--gpu-memory-utilization", type=share, metavar="F", help="vllm: share of each GPU's memory it may take (default: 0.9)"
    )
    group.add_argument(
        "--max-model-len",
        type=whole_number(2),
        metavar="N",
        help="vllm: the engine's context (default: what the longest sentence needs)",
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
    from ..engine.vllm_scoring import VllmOptions  # torch: only when a command runs

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
