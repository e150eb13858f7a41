"""Log-probs and greedy flags of continuation tokens: what lm-evaluation-harness asks of each request, read in one place.

lm-evaluation-harness's ``loglikelihood`` gives, with each continuation's log-prob, whether every one of its tokens
is its position's argmax (``is_greedy``, ``torch.argmax``'s first index of the maximum, as ``HFLM`` decides). Every
pass that answers harness requests (the harness model's, ``harness/fused.py``, and the in-loop spans,
``scored_spans``) reads them here: the hidden states (or the model's own logits) go to the LM head's device, and
``tiled_head.logprobs_and_greedy`` reads both from the same tiles (on a CPU 2,048 positions x 2,048 vocabulary
columns, on a GPU the whole vocabulary), so that the [contexts x vocabulary] logits never exist at once.
"""

from __future__ import annotations

import torch

from .tiled_head import head_parts, head_tile, logprobs_and_greedy


def greedy_logprobs(
    lm: torch.nn.Module, output: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor, head: str, memory_budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target | context), target is the context's argmax)`` of each wanted token, float32 and bool, on the
    head's device.

    ``output``: a forward call's hidden states ("tiled" head: the LM head is a plain linear layer,
    ``tiled_head.plain_head_weight``) or the model's logits ("full_logits", softcapped by the model already) at the
    contexts; ``contexts``/``targets``: [t] an index into ``output`` and a token id for each wanted token, on any
    device. Under a device map the last layer, the head and the cache may sit on three devices: everything is
    moved to the head's.
    """
    if head == "tiled":
        weight, bias, cap = head_parts(lm)
        device, vocab, dtype = weight.device, weight.shape[0], weight.dtype
    else:
        weight = bias = cap = None
        device, vocab, dtype = output.device, output.shape[-1], output.dtype
    tile = head_tile(device, vocab, dtype, memory_budget)
    return logprobs_and_greedy(output.to(device), weight, bias, cap, contexts.to(device), targets.to(device), tile)
