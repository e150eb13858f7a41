"""A compiled scoring forward for long runs: ``torch.compile(..., dynamic=False)`` of the body scoring calls.

With ``compile=True`` the scorer's forward calls go through a compiled copy of the callable they would call (the
model's body for the tiled head, its own forward for full logits), compiled for each batch shape it meets (the
method check's sample, then the plan's few fixed shapes). Only the scorer's calls use it: the model, its
``forward`` and how training compiles or runs it are untouched (``torch.compile`` wraps the module, it does not
change it). The method check's plain reference never goes through it, so the check compares the compiled readout
with the plain forward, as it compares any method.

The first compile is slow (about a minute for the 478M shape on an H200: 63 s for the plan's two batch shapes,
against 32 ms saved per evaluation), so it is off by default; see the long-runs guide for the count of
evaluations from which it pays. Where it cannot work (a sharded model, whose forward is a collective; a
compile error), scoring runs the plain forward and says why once (``reason``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class CompiledForward:
    """The compiled copies of the scorer's forward callables, made when first called.

    ``enabled``: ``compile=``; ``sharded``: the model's forward is a collective (never compiled); ``backend``:
    ``torch.compile``'s (default inductor). ``reason`` says why the plain forward is used (None when compiled).
    """

    enabled: bool = False
    sharded: bool = False
    backend: str | Callable = "inductor"
    reason: str | None = None
    calls: int = 0  # forward calls that went through the compiled copy
    _compiled: dict = field(default_factory=dict)  # id(callable) -> (callable, its compiled copy)

    def __call__(self, fn: Callable) -> Callable:
        """``fn``'s compiled copy (made once per callable), or ``fn`` itself where compiling is off or cannot work."""
        if not self.enabled:
            return fn
        if self.sharded:
            self._say("the weights are sharded (FSDP, ZeRO-3): the forward is a collective")
            return fn
        kept = self._compiled.get(id(fn))
        if kept is None or kept[0] is not fn:
            kept = (fn, self._guarded(fn))
            self._compiled[id(fn)] = kept
        return kept[1]

    def _guarded(self, fn: Callable) -> Callable:
        """``fn`` compiled, falling back to ``fn`` itself for good when compiling fails (the reason logged once)."""
        compiled = None

        def call(*args, **kwargs):
            nonlocal compiled
            if self.reason is not None:
                return fn(*args, **kwargs)
            try:
                if compiled is None:
                    compiled = torch.compile(fn, dynamic=False, backend=self.backend)
                self.calls += 1
                return compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # a compiler failure is not a scoring failure: the plain forward is exact
                self._say(f"torch.compile failed ({type(error).__name__}: {str(error).strip()[:200]})")
                return fn(*args, **kwargs)

        return call

    def _say(self, reason: str) -> None:
        if self.reason != reason:
            logger.warning("tatblimp: scoring with the plain forward, not compiled: %s", reason)
        self.reason = reason
