"""A scorer's forward calls on one batch: the model's body, the LM head's log-probs of the (context, target) pairs the
batch reads, and the facts about the model they rest on (whether its head is a plain linear layer to tile, its
vocabulary, the dtype computed in).

``Scorer`` is a ``BatchForward``: the scoring pass (``scoring_pass``) and the CUDA graphs (``cuda_graphs``) call these
once a batch. What they read is the scorer's: ``lm``, ``_forward``, ``compiled``, ``head`` (``head_choice``),
``cache``, ``memory_budget``, ``precision``, ``sharded`` and ``_built_dtype``.
"""

from __future__ import annotations

import time

import torch

from . import head_choice
from .forward import model_output, read_logprobs
from .head_choice import HeadMethod
from .packing import Batch
from .tiled_head import head_tile, plain_head_weight


class BatchForward:
    """The forward calls of one batch, and the model facts they need (the base of ``scoring.Scorer``)."""

    @property
    def head_tile(self) -> tuple[int, int]:
        """(contexts, vocabulary columns) per tile of the LM head: its logits and their float32 work fit the budget."""
        weight = self._head_weight()
        device = weight.device if weight is not None else self.cache.device
        return head_tile(device, self._vocab_size(), self._dtype(), self.memory_budget)

    def _batch_logprobs(self, batch: Batch, head: str, spans=None) -> torch.Tensor:
        """log p(target | context) of every (context, target) the batch scores, in float32, on the cache's device
        (with ``spans``: a span's continuation tokens through ``scored_spans``; its context's are not read)."""
        if spans is None:
            return self._read(batch, head)
        start = time.perf_counter()
        output = self._model_output(batch, head)  # one forward call for both: the sentences' tokens are read below
        return spans.batch_logprobs(
            self, batch, output, head, lambda out, part: self._read(part, head, out, time.perf_counter() - start)
        )

    def _read(self, batch: Batch, head: str, output: torch.Tensor | None = None, seconds: float = 0.0) -> torch.Tensor:
        """The log-probs of the batch's (context, target) pairs, from the forward call's ``output`` (taken ``seconds``
        before), or from a forward call made here."""
        if head != "tiled":
            output = self._model_output(batch, head) if output is None else output
            return read_logprobs(self.lm, output, batch, head, None, None).to(self.cache.device)
        device = self._head_weight().device

        def body() -> tuple:  # under a device map the head may sit on another device than the last layer and the cache
            hidden = (self._model_output(batch, head) if output is None else output).to(device)
            return hidden, batch.score_contexts.to(device), batch.score_targets.to(device), batch.num_positions

        return self.head.forward_logprobs(body, self._head_logprobs, device, seconds).to(self.cache.device)

    def _head_logprobs(self, method: HeadMethod, hidden, contexts, targets) -> torch.Tensor:
        return head_choice.method_logprobs(self.lm, method, hidden, contexts, targets, self.head_tile, self.memory_budget)

    def _model_output(self, batch: Batch, head: str, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return model_output(self.compiled(self._forward), self.lm, batch, head, position_ids, self.compiled(self.lm.base_model))

    def _heads(self) -> list[str]:
        return ["tiled", "full_logits"] if self._head_weight() is not None else ["full_logits"]

    def _head_weight(self) -> torch.Tensor | None:
        if self.lm.base_model is self.lm or self.sharded or self.precision.itemsize > self._built_dtype.itemsize:
            return None  # a sharded head's weight is a shard, an upcast one is upcast in its own call: the model's forward
        return plain_head_weight(self.lm)

    def _vocab_size(self) -> int:
        weight = self._head_weight()
        return weight.shape[0] if weight is not None else self.lm.config.vocab_size

    def _dtype(self) -> torch.dtype:
        return self.precision  # what the forwards compute in
