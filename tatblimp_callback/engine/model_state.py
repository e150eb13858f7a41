"""The one place that puts a model back as scoring found it: every module's own train/eval mode, the random
number generators and whether gradients are on.

``model.train(was_training)`` is not enough: it sets every submodule to the top module's mode, so a
submodule the user froze with ``.eval()`` (its dropout off) comes back in train mode. The Hugging Face
Trainer hides that by calling ``model.train()`` before each step; Lightning and plain loops do not.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def rng_preserved() -> Iterator[None]:
    """Restore Python's, numpy's, torch's and (if in use) CUDA's random number generators on leaving."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def scoring_mode(*models: torch.nn.Module) -> Iterator[None]:
    """``models`` in eval mode without gradients, the random generators untouched by what runs inside; on
    leaving (also on an exception or Ctrl-C) each module of each model is in its own mode again, and the
    generators and the grad-enabled state are as they were."""
    modes = [(module, module.training) for model in models for module in model.modules()]
    with rng_preserved(), torch.no_grad():
        if any(training for _, training in modes):  # a model already in eval mode everywhere is left as it is
            for model in models:
                model.eval()
        try:
            yield
        finally:
            for module, training in modes:
                if module.training != training:  # setting a module's attribute is slow: only those that changed
                    module.training = training  # not .train(): that would set its submodules too
