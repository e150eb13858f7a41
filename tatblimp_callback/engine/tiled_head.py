"""Log-probabilities through the LM head tile by tile, so that the [contexts x vocabulary] logits never exist at once.

Each tile of (contexts x vocabulary columns) gives its float32 logits' log-sum-exp over that part of
the vocabulary; the parts are merged into each context's log-normaliser, and each wanted target's
logit is one dot product, rounded as the head's matmul rounds its output. log p(target | context)
is their difference. Where a forward call's contexts and the whole vocabulary fit one tile (on a GPU
the vocabulary always does), the tile's float32 ``log_softmax`` and one gather give the same numbers
in a few ops instead of a few dozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# On a CPU a head tile of 2048 positions x 2048 vocabulary columns (16 MiB of float32 logits)
# stays in the last-level cache while the log-sum-exp runs over it: 33,512 positions x 48K
# vocabulary took 6.8 s this way against 11.0 s as whole-vocabulary chunks of 1024 positions with
# cross-entropy (2 cores). A narrower vocabulary gets as many rows as make the same 16 MiB. On a GPU
# a tile spans the whole vocabulary.
CPU_HEAD_TILE = (2048, 2048)


# Config fields by which some models scale their logits after the head (Cohere, Granite); the tiled head does not.
LOGIT_SCALING_FIELDS = ("logit_scale", "logits_scaling")


def plain_head_weight(lm: torch.nn.Module) -> torch.Tensor | None:
    """The LM head's weight if the logits are exactly ``F.linear(hidden, weight, bias)`` (softcapping aside), else None.

    Only a plain ``torch.nn.Linear`` qualifies: no adapter wrapped around it (a LoRA layer on ``lm_head``,
    whose frozen ``weight`` is not what the model computes), no forward hook (accelerate's offload hooks,
    whose weight may sit on the meta device; its device-map hook that only places the head is fine), no
    subclass (quantized layers), and no logit scaling by the model. Any other head is scored through the
    model's own forward.
    """
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.is_meta:
        return None
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    if (hasattr(head, "_hf_hook") or "forward" in vars(head)) and not _placed_by_device_map(head):
        return None
    config = getattr(lm, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_SCALING_FIELDS):
        return None
    return head.weight


def _placed_by_device_map(head: torch.nn.Module) -> bool:
    """Whether the head's only wrapper is accelerate's device-map hook that moves its input to the head's device
    and leaves the weight where it is (no offload): ``F.linear`` with that weight on that device is its forward."""
    hook = getattr(head, "_hf_hook", None)
    hooks = getattr(hook, "hooks", [hook])
    return all(type(h).__name__ == "AlignDevicesHook" and not h.offload and not h.io_same_device for h in hooks)


def head_tile(device: torch.device, vocab: int, dtype: torch.dtype, memory_budget: int) -> tuple[int, int]:
    """(contexts, vocabulary columns) per tile of the LM head, so that its logits and their float32 work fit the budget."""
    element = torch.finfo(dtype).bits // 8
    # F.linear's logits, a float32 copy unless they are float32 already, logsumexp's temporary (or log_softmax's output).
    per_logit = element + (4 if element != 4 else 0) + 4
    if device.type == "cpu":
        columns = min(CPU_HEAD_TILE[1], vocab)
        rows = CPU_HEAD_TILE[0] * CPU_HEAD_TILE[1] // columns
        return max(1, min(rows, memory_budget // (columns * per_logit))), columns
    return max(1, memory_budget // (vocab * per_logit)), vocab


def head_logprobs(
    lm: torch.nn.Module, hidden: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """log p(target | context) = target logit - log-sum-exp of the context's logits, in float32.

    ``hidden``: [k, hidden size] states of the contexts; ``contexts``/``targets``: [t] an index into
    them and a token id for each log-prob wanted; ``tile``: ``head_tile``'s (contexts, columns).
    """
    head = lm.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    rows, columns = tile
    if hidden.shape[0] <= rows and columns >= weight.shape[0]:
        return _one_tile_logprobs(hidden, weight, bias, cap, contexts, targets)
    log_normalizers = torch.cat(
        [_log_sum_exp(hidden[start : start + rows], weight, bias, cap, columns) for start in range(0, hidden.shape[0], rows)]
    )
    target_logits = torch.cat(
        [
            _target_logits(hidden[contexts[start : start + rows]], weight, bias, cap, targets[start : start + rows])
            for start in range(0, targets.shape[0], rows)
        ]
    )
    return target_logits - log_normalizers[contexts]


def _one_tile_logprobs(hidden, weight, bias, cap, contexts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``head_logprobs`` where all of ``hidden``'s logits are one tile: their float32 log-softmax, gathered."""
    logits = F.linear(hidden, weight, bias).float()
    if cap:  # in place: ``logits`` is a fresh tensor
        logits.div_(cap).tanh_().mul_(cap)
    logprobs = logits.log_softmax(-1)[contexts, targets]
    # log_softmax is NaN throughout a row with a logit of inf; the tiled path's difference is -inf there
    # for every target whose own logit is not inf (a row with a NaN has the maximum NaN: NaN in both).
    # Only a NaN log-prob can be such a row's, so the rows' maxima are read for those alone.
    nan = logprobs.isnan()
    if bool(nan.any()):
        rows, wanted = contexts[nan], targets[nan]
        in_infinite_row = (logits[rows].amax(-1) == float("inf")) & (logits[rows, wanted] != float("inf"))
        logprobs[nan] = torch.where(in_infinite_row, float("-inf"), logprobs[nan])
    return logprobs


def chunked_logprobs(
    lm: torch.nn.Module, hidden: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor, rows: int
) -> torch.Tensor:
    """``head_logprobs`` by whole-vocabulary chunks: ``rows`` contexts at a time, their float32 ``log_softmax``
    over the whole vocabulary, and each target's log-prob gathered from it (no separate target-logit products).

    The same numbers as one tile of the whole batch, row for row (``log_softmax`` works on each row alone).
    """
    head = lm.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if hidden.shape[0] <= rows:
        return _one_tile_logprobs(hidden, weight, bias, cap, contexts, targets)
    order = torch.argsort(contexts, stable=True)
    ordered = contexts[order]
    starts = torch.arange(0, hidden.shape[0] + rows, rows, device=contexts.device).clamp_(max=hidden.shape[0])
    bounds = torch.searchsorted(ordered, starts).tolist()
    logprobs = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
    for chunk, start in enumerate(range(0, hidden.shape[0], rows)):
        lo, hi = bounds[chunk], bounds[chunk + 1]
        if lo == hi:
            continue
        pick = order[lo:hi]
        part = hidden[start : start + rows]
        logprobs[pick] = _one_tile_logprobs(part, weight, bias, cap, ordered[lo:hi] - start, targets[pick])
    return logprobs


def _log_sum_exp(hidden, weight, bias, cap, columns: int) -> torch.Tensor:
    """log sum_v exp(logit_v) per row of ``hidden``, in float32, ``columns`` vocabulary entries at a time."""
    parts = []
    for start in range(0, weight.shape[0], columns):
        part = slice(start, start + columns)
        logits = F.linear(hidden, weight[part], None if bias is None else bias[part]).float()
        if cap:  # in place: ``logits`` is a fresh tensor
            logits.div_(cap).tanh_().mul_(cap)
        parts.append(_fresh_log_sum_exp(logits))
    return parts[0] if len(parts) == 1 else torch.logsumexp(torch.stack(parts, -1), -1)


def _fresh_log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits, -1)``, computed in place in ``logits`` (a fresh tensor), with no temporary of the
    tile's size: on a CPU tile of 2,048 x 2,048 float32 logits 3.3 ms against torch's 5.4 ms (2 cores, best of 12,
    alternated, 2026-12-01); the same on narrow tiles. A row whose maximum is not finite is shifted by 0, so
    that an infinite logit gives inf and a row of -inf gives -inf, as torch's does."""
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _target_logits(hidden, weight, bias, cap, targets: torch.Tensor) -> torch.Tensor:
    """Each row's logit of its target token, rounded as the head's matmul rounds its output."""
    logits = (hidden.float() * weight[targets].float()).sum(-1)
    if bias is not None:
        logits += bias[targets].float()
    logits = logits.to(weight.dtype).float()
    return logits.div_(cap).tanh_().mul_(cap) if cap else logits
