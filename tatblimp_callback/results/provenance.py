"""What made a result: library versions, the model's dtype and device, and when (UTC).

Every result carries these keys in ``run_info`` and so at the top level of its JSON (``score --output``,
a sweep line, a line of the callback's history file), so that a float32 and a bfloat16 result, or results
of two library versions, can be told apart:

    "environment": {"python": "3.12.3", "torch": "2.13.0", "transformers": "5.24.0", "tatblimp_callback": "0.1.0"},
    "dtype": "bfloat16", "device": "cuda:0", "created": "2026-12-01T04:48:48Z"
"""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from typing import Any

from ..engine.model_checks import unwrap_model


def environment() -> dict[str, str]:
    """The versions of Python, torch, transformers and this library."""
    import torch
    import transformers

    # The package's own __version__, read from the already imported package (importing it here would close a cycle).
    __version__ = sys.modules[__package__.partition(".")[0]].__version__
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tatblimp_callback": __version__,
    }


def created() -> str:
    """Now, in ISO 8601 and UTC, to the second: ``2026-12-01T04:48:48Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def model_placement(model: Any) -> dict[str, str | None]:
    """``dtype`` and ``device`` of the model's weights: the floating-point ones' dtype ("float32", "bfloat16";
    several joined by ","), and the devices they are on ("cpu", "cuda:0"; several joined by ","). A model placed
    by a ``device_map`` is where its map says ("disk" for weights offloaded there, which sit on the meta device
    between forward calls); the dtype of such weights is the one they are stored in."""
    import torch

    dtypes: dict[str, None] = {}
    devices: dict[str, None] = {}
    for parameter in model.parameters():
        if parameter.is_floating_point():
            dtypes.setdefault(str(parameter.dtype).removeprefix("torch."), None)
        devices.setdefault(str(parameter.device), None)
    placed = getattr(unwrap_model(model), "hf_device_map", None)
    if placed:
        devices = dict.fromkeys(str(torch.device(d)) if isinstance(d, int) else str(d) for d in placed.values())
    return {"dtype": ",".join(dtypes) or None, "device": ",".join(devices) or None}


def provenance(model: Any = None) -> dict[str, Any]:
    """``environment``, ``dtype``, ``device`` (None without a local ``model``, e.g. an endpoint) and ``created``."""
    placement = model_placement(model) if model is not None else {"dtype": None, "device": None}
    return {"environment": environment(), **placement, "created": created()}
