"""Log-probs and greedy flags through the LM head tile by tile: what the harness asks of each continuation token.

lm-evaluation-harness's ``loglikelihood`` gives, with each continuation's log-prob, whether every one of its tokens
is its position's argmax (``is_greedy``). The tiles are those of the engine's tiled head (``tiled_head.head_tile``:
on a CPU 2,048 positions x 2,048 vocabulary columns, which stay in the last-level cache; on a GPU the whole
vocabulary), so that the [contexts x vocabulary] logits never exist at once. Each tile gives its float32 logits'
maximum and log-sum-exp, and the logits of the targets whose columns it holds (taken from the matmul's own
output, so that a target's logit and the maximum it is compared with are rounded alike); log p(target) is the
target's logit less its context's log-sum-exp, and the target is greedy when its logit is the context's maximum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def head_logprobs_and_greedy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cap: float | None,
    contexts: torch.Tensor,
    targets: torch.Tensor,
    tile: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target | context), target is the context's argmax)`` for each wanted token, float32 and bool.

    ``hidden``: [k, hidden size] states of the contexts (or, with ``weight`` None, their [k, vocabulary] logits);
    ``contexts``/``targets``: [t] an index into them and a token id for each wanted token; ``tile``: (contexts,
    vocabulary columns) per tile; ``cap``: the model's final logit softcapping, if any.
    """
    vocab = weight.shape[0] if weight is not None else hidden.shape[-1]
    rows, columns = tile
    logprobs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    greedy = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)
    order = torch.argsort(contexts)  # the wanted tokens grouped by tile of contexts
    sorted_contexts = contexts[order]
    bounds = torch.searchsorted(sorted_contexts, torch.arange(0, hidden.shape[0] + rows, rows, device=contexts.device))
    for row_tile, start in enumerate(range(0, hidden.shape[0], rows)):
        mine = order[bounds[row_tile] : bounds[row_tile + 1]]
        if mine.numel() == 0:
            continue
        part = hidden[start : start + rows]
        at, wanted = contexts[mine] - start, targets[mine]
        top = torch.full((part.shape[0],), float("-inf"), device=hidden.device)
        sums = []
        target_logits = torch.empty(wanted.shape, dtype=torch.float32, device=hidden.device)
        for first in range(0, vocab, columns):
            cols = slice(first, first + columns)
            if weight is not None:
                logits = F.linear(part, weight[cols], None if bias is None else bias[cols]).float()
            else:
                logits = part[:, cols].to(torch.float32, copy=True)  # modified in place below
            if cap:  # in place: ``logits`` is a fresh tensor (or a float copy)
                logits = logits.div(cap).tanh_().mul_(cap)
            here = (wanted >= first) & (wanted < first + columns)
            target_logits[here] = logits[at[here], wanted[here] - first]
            tile_top = logits.amax(-1)
            top = torch.maximum(top, tile_top)
            shift = torch.where(torch.isfinite(tile_top), tile_top, torch.zeros_like(tile_top))
            sums.append(logits.sub_(shift[:, None]).exp_().sum(-1).log_() + shift)
        log_normalizers = sums[0] if len(sums) == 1 else torch.logsumexp(torch.stack(sums, -1), -1)
        logprobs[mine] = target_logits - log_normalizers[at]
        greedy[mine] = target_logits >= top[at]
    return logprobs, greedy
