"""Where a loaded model's weights go, and what ``from_pretrained`` may run: the loader options of
``tatblimp score`` and ``tatblimp sweep``.

- ``--device-map auto|balanced|sequential`` with ``--max-memory DEVICE=SIZE`` and ``--offload-folder``:
  accelerate's big-model dispatch (layers spread over the GPUs, the CPU and disk offload);
- ``--tp-plan auto`` (``score`` under torchrun): transformers' tensor parallelism, every process one shard;
- ``--trust-remote-code``, ``--revision``, ``--attn-implementation``: passed to ``from_pretrained`` as they are.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

DEVICE_MAPS = ("auto", "balanced", "sequential")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device-map``, ``--max-memory``, ``--offload-folder``, ``--trust-remote-code``, ``--attn-implementation``."""
    group = parser.add_argument_group("models bigger than one device")
    group.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        help="spread the layers over the GPUs, then the CPU, then --offload-folder (accelerate's big-model dispatch)",
    )
    group.add_argument(
        "--max-memory",
        action="append",
        type=memory_item,
        metavar="DEVICE=SIZE",
        help="with --device-map: at most SIZE of weights on DEVICE (a GPU index, cpu, mps), e.g. 0=70GiB cpu=200GiB; repeatable",
    )
    group.add_argument("--offload-folder", metavar="DIR", help="with --device-map: where weights that fit nowhere else go")
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python files of the model's folder or Hub repository (a custom architecture): "
        "code from the model's author runs on this machine with your rights; off by default",
    )
    group.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, help="the attention kernel (default: the model's)")


def memory_item(text: str) -> tuple[int | str, int | str]:
    """``"0=70GiB"`` -> ``(0, "70GiB")``, ``"cpu=500000"`` -> ``("cpu", 500000)``: one ``--max-memory`` entry."""
    from accelerate.utils import convert_file_size_to_int

    device, sep, size = text.partition("=")
    device, size = device.strip(), size.strip()
    if not sep or not device or not size:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DEVICE=SIZE, e.g. 0=70GiB or cpu=200GiB")
    try:
        size = int(size) if size.isdigit() else size  # bytes
        convert_file_size_to_int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {size!r} is not a size such as 70GiB, 500MB or 1000000") from None
    if device.isdigit():
        return int(device), size
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:]), size
    if device not in ("cpu", "mps", "disk"):
        raise argparse.ArgumentTypeError(f"{text!r}: DEVICE must be a GPU index (0, 1, ...), cpu, mps or disk")
    return device, size


def placement_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_model`` keyword arguments of parsed loader options; ValueError for options that do not go together."""
    device_map = getattr(args, "device_map", None)
    max_memory = dict(getattr(args, "max_memory", None) or []) or None
    offload_folder = getattr(args, "offload_folder", None)
    tp_plan = getattr(args, "tp_plan", None)
    if device_map is None and (max_memory or offload_folder):
        raise ValueError("--max-memory and --offload-folder need --device-map")
    if device_map is not None and getattr(args, "device", None):
        raise ValueError(f"give either --device {args.device} or --device-map {device_map}, not both")
    if tp_plan is not None and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "--tp-plan splits each layer over processes: start them with torchrun --nproc-per-node N -m tatblimp_callback"
        )
    if tp_plan is not None and device_map is not None:
        raise ValueError("--tp-plan and --device-map do not go together: tensor parallelism puts one shard on each process")
    return {
        "device_map": device_map,
        "max_memory": max_memory,
        "offload_folder": offload_folder,
        "tp_plan": tp_plan,
        "trust_remote_code": getattr(args, "trust_remote_code", False),
        "revision": getattr(args, "revision", None),
        "attn_implementation": getattr(args, "attn_implementation", None),
    }


def from_pretrained_options(
    *,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    tp_plan: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``AutoModelForCausalLM.from_pretrained`` for these options (only those set)."""
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if device_map is not None:
        options["device_map"] = device_map
        if max_memory:
            options["max_memory"] = max_memory
        if offload_folder:
            options["offload_folder"] = offload_folder
    if tp_plan is not None:
        from transformers import DistributedConfig

        options["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    if revision is not None:
        options["revision"] = revision
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    return options
