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


def modules_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.modules()`` (each module once), parents before their children, read from the modules' own
    dictionaries: read at every evaluation, it takes under half of ``modules()``'s time, which builds dotted names."""
    seen = {id(model)}
    found = [model]
    for module in found:  # the list grows as it is read: breadth first
        for child in module.__dict__["_modules"].values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


def parameters_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model.parameters()`` (each once: tied weights are one) from ``modules_of``, for checks made every evaluation."""
    held = [parameter for module in modules_of(model) for parameter in module.__dict__["_parameters"].values()]
    return list(dict.fromkeys(parameter for parameter in held if parameter is not None))  # a tensor hashes by identity


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
    modes = [(module, module.training) for model in models for module in modules_of(model)]
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
