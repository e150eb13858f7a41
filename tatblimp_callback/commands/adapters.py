"""PEFT adapter checkpoints: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` (a LoRA
fine-tune saved by peft or by the Trainer around a ``PeftModel``) but no model of its own (no ``config.json``, or
one without model weights).

Such a folder is loaded with its base model, the one its ``adapter_config.json`` names
(``base_model_name_or_path``), through peft's ``AutoPeftModelForCausalLM``; peft is needed only then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a PEFT adapter without a model of its own: ``adapter_config.json``, and no
    ``config.json`` or no model weights beside it (Unsloth's and axolotl's adapter checkpoints keep the base model's
    ``config.json``)."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        return False
    return not (folder / "config.json").is_file() or not any((folder / name).is_file() for name in MODEL_WEIGHTS)


def adapter_base_model(folder: str | os.PathLike) -> str | None:
    """The base model (folder or Hub id) that the adapter in ``folder`` was trained on, if its config names one."""
    try:
        config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return base if isinstance(base, str) and base else None


def load_adapter_model(folder: str | os.PathLike, dtype, **options):
    """The adapter in ``folder`` on its base model, as a ``peft.PeftModel`` (CPU; ``dtype``: a torch dtype or "auto").

    ``options``: the base model's ``from_pretrained`` keyword arguments (``placement.from_pretrained_options``),
    which peft hands on to it: ``device_map`` ("auto", "balanced", "sequential"), ``max_memory`` and
    ``offload_folder`` place the base model and the adapter's weights beside their layers.

    Raises:
        ImportError: peft is not installed.
        FileNotFoundError: the adapter's config names no base model.
    """
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError:
        raise ImportError(
            f"{folder} holds a PEFT adapter (adapter_config.json, no config.json); loading it with its base model "
            "needs peft: pip install peft"
        ) from None
    if adapter_base_model(folder) is None:
        raise FileNotFoundError(f"{folder}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return AutoPeftModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **options)
