"""Log-probabilities through the LM head tile by tile, so that the [contexts x vocabulary] logits never exist at once.

Each tile of (contexts x vocabulary columns) gives its float32 logits' log-sum-exp over that part of
the vocabulary; the parts are merged into each context's log-normaliser, and each wanted target's
logit is one dot product, rounded as the head's matmul rounds its output. log p(target | context)
is their difference. Where a forward call's contexts and the whole vocabulary fit one tile (on a GPU
the vocabulary always does), the tile's float32 ``log_softmax`` and one gather give the same numbers
in a few ops instead of a few dozen.

lm-evaluation-harness's requests also want each target's greedy flag (``logprobs_and_greedy``): the same
tiles give each context's maximum and its first column, and the target's logit is read from the tile
itself. Every readout goes over the vocabulary by one loop (``vocabulary_tiles``), softcapped in one place.
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
    weight, bias, cap = head_parts(lm)
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
    logits = softcap_(F.linear(hidden, weight, bias).float(), cap)
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
    weight, bias, cap = head_parts(lm)
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
    parts = [_fresh_log_sum_exp(logits) for _, logits in vocabulary_tiles(hidden, weight, bias, cap, columns)]
    return parts[0] if len(parts) == 1 else torch.logsumexp(torch.stack(parts, -1), -1)


_MAX_BLOCK = 128  # columns per block of ``first_max`` on the CPU


def vocabulary_tiles(hidden: torch.Tensor, weight: torch.Tensor | None, bias, cap: float | None, columns: int):
    """The head's float32 logits of ``hidden``'s rows, ``columns`` vocabulary entries at a time, softcapped:
    ``(first column, logits)`` per tile. With ``weight`` None, ``hidden`` are the model's own logits (softcapped
    already: pass ``cap`` None), copied tile by tile.

    Every tile is written into the same memory, which the caller may change in place and must be done with before it
    asks for the next tile, by ``F.linear``'s own matmul (``mm``, or ``addmm`` with a bias) in the dtype it would
    compute in (``linear_dtype``). A fresh tile each time lands at new addresses, which the system zeroes and the
    cache has never held: on the CPU, multiple-choice calls whose time is mostly the head's took 1.4 to 1.6 times as
    long (``CHANGELOG``).

    The one loop over the vocabulary of every tiled readout (log-probs, greedy flags), and its one softcap.
    """
    vocab = weight.shape[0] if weight is not None else hidden.shape[-1]
    size = hidden.shape[0] * min(columns, vocab)
    tiles = torch.empty(size, dtype=torch.float32, device=hidden.device)
    computes_in = torch.float32 if weight is None else linear_dtype(weight)
    # The matmul's own output where it is not float32: rounded as the head rounds it, then widened.
    low = None if computes_in == torch.float32 else torch.empty(size, dtype=computes_in, device=tiles.device)
    inputs = hidden if weight is None else hidden.to(computes_in)
    for first in range(0, vocab, columns):
        part = slice(first, first + columns)
        shape = (hidden.shape[0], min(columns, vocab - first))
        logits = tiles[: shape[0] * shape[1]].view(shape)
        if weight is None:
            logits.copy_(hidden[:, part])
        else:
            out = logits if low is None else low[: shape[0] * shape[1]].view(shape)
            transposed = weight[part].to(computes_in).t()
            with torch.no_grad():  # a readout, never differentiated (``out=`` takes no gradient)
                if bias is None:
                    torch.mm(inputs, transposed, out=out)
                else:
                    torch.addmm(bias[part].to(computes_in), inputs, transposed, out=out)
            if low is not None:
                logits.copy_(out)
        yield first, softcap_(logits, cap)


def linear_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` with ``weight`` computes in here: autocast's where it is on for the weight's device (as
    under ``precision.computing_in`` below the weights' dtype), else the weight's. ``out=`` calls are not autocast."""
    device = weight.device.type
    if weight.dtype != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def softcap_(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The model's final logit softcapping, ``cap * tanh(logits / cap)``, in place (``logits`` the caller's to change)."""
    return logits.div_(cap).tanh_().mul_(cap) if cap else logits


def head_parts(lm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """The LM head's ``(weight, bias, final logit softcapping)``: what the tiled readouts compute the logits from."""
    head = lm.get_output_embeddings()
    return head.weight, getattr(head, "bias", None), getattr(lm.config, "final_logit_softcapping", None)


def logprobs_and_greedy(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    cap: float | None,
    contexts: torch.Tensor,
    targets: torch.Tensor,
    tile: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target | context), target is the context's argmax)`` for each wanted token, float32 and bool.

    ``hidden``: [k, hidden size] states of the contexts (or, with ``weight`` None, their [k, vocabulary] logits);
    ``contexts``/``targets``: [t] an index into them and a token id for each, on ``hidden``'s device; ``tile``:
    (contexts, vocabulary columns) per tile; ``cap``: the model's final logit softcapping, if any (None for logits).

    A target's logit is taken from the tile's own matmul output, so that it and the maximum it is compared with are
    rounded alike. Greedy is ``torch.argmax``'s: the first index of the maximum (a target tied with an earlier
    column is not greedy, as in lm-evaluation-harness's ``HFLM``). One host sync at most (with several row tiles).
    """
    rows, columns = tile
    if hidden.shape[0] <= rows:  # one row tile: every wanted token, in order, no sort and no sync
        return _row_tile(hidden, weight, bias, cap, contexts, targets, columns)
    logprobs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    greedy = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)
    order = torch.argsort(contexts)  # the wanted tokens grouped by tile of contexts
    starts = torch.arange(0, hidden.shape[0] + rows, rows, device=contexts.device)
    bounds = torch.searchsorted(contexts[order], starts).tolist()  # the loop's one sync
    for row_tile, start in enumerate(range(0, hidden.shape[0], rows)):
        if bounds[row_tile] == bounds[row_tile + 1]:
            continue
        mine = order[bounds[row_tile] : bounds[row_tile + 1]]
        part = hidden[start : start + rows]
        logprobs[mine], greedy[mine] = _row_tile(part, weight, bias, cap, contexts[mine] - start, targets[mine], columns)
    return logprobs, greedy


def _row_tile(hidden, weight, bias, cap, at: torch.Tensor, wanted: torch.Tensor, columns: int):
    """``logprobs_and_greedy`` of one tile of contexts (``at``: indices into ``hidden``), column tile by column tile."""
    top = torch.full((hidden.shape[0],), float("-inf"), device=hidden.device)
    first_top = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)  # the first column at the maximum
    target_logits = torch.zeros(wanted.shape, dtype=torch.float32, device=hidden.device)
    sums = []
    for first, logits in vocabulary_tiles(hidden, weight, bias, cap, columns):
        here = (wanted >= first) & (wanted < first + logits.shape[-1])
        column = (wanted - first).clamp_(0, logits.shape[-1] - 1)
        target_logits = torch.where(here, logits[at, column], target_logits)  # a gather, no mask indexing (no sync)
        tile_top, tile_first = first_max(logits)  # the first index of the tile's maximum
        higher = tile_top > top  # a later tile wins only above the maximum so far: ties keep the earlier column
        first_top = torch.where(higher, tile_first + first, first_top)
        top = torch.where(higher, tile_top, top)
        sums.append(_fresh_log_sum_exp(logits, tile_top))
    log_normalizers = sums[0] if len(sums) == 1 else torch.logsumexp(torch.stack(sums, -1), -1)
    return target_logits - log_normalizers[at], first_top[at] == wanted


def first_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(-1)`` of a [rows, columns] tile: each row's maximum and the first column holding it (NaN counts
    as the maximum, as there). On the CPU, where torch's max with indices is not vectorised, by blocks of
    ``_MAX_BLOCK`` columns: their maxima (``amax``), the first block at the row's maximum, the first column in it;
    a 2,048 x 2,048 float32 tile in 1.1 ms against 4.5 ms (1 thread, 2026-12-05)."""
    rows, columns = logits.shape
    whole = columns - columns % _MAX_BLOCK
    if logits.device.type != "cpu" or not whole:
        return logits.max(-1)
    blocks = logits[:, :whole].unflatten(-1, (-1, _MAX_BLOCK))
    top, block = blocks.amax(-1).max(-1)
    within = blocks[torch.arange(rows, device=logits.device), block]
    hit = within == top[:, None]
    if top.isnan().any():  # on the CPU: no device to wait for
        hit |= within.isnan()
    first = block * _MAX_BLOCK + hit.view(torch.uint8).argmax(-1)
    if whole < columns:  # the last columns, beyond the blocks: theirs only where above (a NaN above a number)
        tail_top, tail_first = logits[:, whole:].max(-1)
        higher = (tail_top > top) | (tail_top.isnan() & ~top.isnan())
        top, first = torch.where(higher, tail_top, top), torch.where(higher, tail_first + whole, first)
    return top, first


def _fresh_log_sum_exp(logits: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.logsumexp(logits, -1)``, computed in place in ``logits`` (the caller's to change), with no temporary
    of the tile's size: on a CPU tile of 2,048 x 2,048 float32 logits 3.3 ms against torch's 5.4 ms (2 cores, best of
    12, alternated, 2026-12-01); the same on narrow tiles. A row whose maximum is not finite is shifted by 0, so
    that an infinite logit gives inf and a row of -inf gives -inf, as torch's does. ``top``: the rows' maxima, if known."""
    top = logits.amax(-1, keepdim=True) if top is None else top[:, None]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _target_logits(hidden, weight, bias, cap, targets: torch.Tensor) -> torch.Tensor:
    """Each row's logit of its target token, rounded as the head's matmul rounds its output."""
    computes_in = linear_dtype(weight)  # the matmul's inputs and output are rounded to it (autocast's, under it)
    logits = (hidden.to(computes_in).float() * weight[targets].to(computes_in).float()).sum(-1)
    if bias is not None:
        logits += bias[targets].to(computes_in).float()
    logits = logits.to(computes_in).float()
    return softcap_(logits, cap)
