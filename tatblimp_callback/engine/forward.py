"""One forward call: the model over a batch's rows, and the log-probs of the (context, target) pairs it reads.

The model is called as transformers models are: ``input_ids``, ``position_ids``, ``attention_mask``
(a 4D tree mask, a 2D padding mask, or None for packed rows) and ``use_cache=False``. With the tiled
head only its body runs (``base_model(...).last_hidden_state``) and the log-probs go through its
output embedding tile by tile (``tiled_head``); with "full_logits" its own forward gives the logits.
"""

from __future__ import annotations

import torch

from .packing import Batch
from .tiled_head import head_logprobs


def model_output(
    forward, lm: torch.nn.Module, batch: Batch, head: str, position_ids: torch.Tensor | None = None, body=None
) -> torch.Tensor:
    """The hidden states ("tiled" head) or the model's logits ("full_logits") at the positions the batch reads.

    ``forward``: the callable that gives the logits (the model, or its unwrapped forward); ``lm``: the
    causal LM whose ``base_model`` gives the hidden states, or ``body`` in its place (a compiled copy of it).
    """
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids if position_ids is None else position_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,
    }
    if head == "full_logits":
        output = forward(**inputs).logits
    else:
        output = (body or lm.base_model)(**inputs).last_hidden_state
    # The hidden states are wherever the last layer left them (under a device map, not the cache's device).
    return output.reshape(-1, output.shape[-1]).index_select(0, batch.score_positions.to(output.device))


def read_logprobs(lm: torch.nn.Module, output: torch.Tensor, batch: Batch, head: str, tile, head_device) -> torch.Tensor:
    """log p(target | context) of every (context, target) the batch scores, in float32, on ``output``'s device
    for full logits, on ``head_device`` (the head weight's) for the tiled head."""
    if head == "full_logits":
        return output.float().log_softmax(-1)[batch.score_contexts, batch.score_targets]
    # Under a device map the head may sit on another device than the last layer and the cache.
    contexts, targets = batch.score_contexts.to(head_device), batch.score_targets.to(head_device)
    return head_logprobs(lm, output.to(head_device), contexts, targets, tile)
