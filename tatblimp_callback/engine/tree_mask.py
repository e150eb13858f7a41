"""The prefix-tree attention mask from one integer a position: the size of its subtree.

A row's tree is laid out depth first (sorted sequences add their new tokens in order), so the
subtree of column k is the run of columns k, k + 1, ..., k + ``sizes[k]`` - 1, and column k is an
ancestor of column q (or q itself) exactly when ``0 <= q - k < sizes[k]``. The mask is that test,
broadcast over (query, key): with the offsets q - k of a row's width made once (a query before its
key gets the width, which no subtree reaches), it is one comparison an element, with no step per
depth and nothing quadratic kept between forward calls. Padding is a subtree of one: it sees itself
only. The same test is a FlexAttention ``mask_mod`` (``flex_mask_mod``), for a block-sparse mask
that skips the blocks no position attends to.

On the CPU, within a pass over a layout's batches (``reused_buffer``), each boolean mask is written into the memory
of the one before once that one is gone: a batch's mask is tens of MB, which the allocator would otherwise hand back
to the system after each batch and fault in again for the next (about half of the masks' time on the CPU).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import numpy as np
import torch

_OFFSETS: dict[tuple, torch.Tensor] = {}  # (width, dtype, device) -> [width, width] q - k, or width where q < k
_PASSES: list[dict] = []  # one per pass in progress (``reused_buffer``): its buffer, and a weak reference to its mask


@contextmanager
def reused_buffer():
    """Within the block, the CPU's boolean masks share one buffer, each written once the one before is gone; the
    buffer is freed on leaving."""
    _PASSES.append({"buffer": None, "mask": lambda: None})
    try:
        yield
    finally:
        _PASSES.pop()


def interval_mask(sizes: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[rows, 1, width, width]: query q sees key k where ``0 <= q - k < sizes[row, k]``; boolean (True:
    attend), or additive in the floating ``dtype`` (0, or its most negative value), as eager attention wants."""
    offsets = _offsets(sizes.shape[-1], sizes.dtype, sizes.device).unsqueeze(0)
    out = None
    if sizes.device.type == "cpu" and not torch.compiler.is_compiling():
        # numpy's comparison: a third of torch's time on the CPU (same values), into the pass's buffer where it can
        if dtype == torch.bool:
            out = _buffer((sizes.shape[0], sizes.shape[1], sizes.shape[1]))
        seen = torch.from_numpy(np.less(offsets.numpy(), sizes.unsqueeze(1).numpy(), out=out))
    else:
        seen = offsets < sizes.unsqueeze(1)
    if dtype == torch.bool:
        mask = seen.unsqueeze(1)
        if out is not None:  # in the pass's buffer: the next mask waits until this one is gone
            _PASSES[-1]["mask"] = weakref.ref(mask)
        return mask
    mask = torch.zeros(seen.shape, dtype=dtype, device=sizes.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min).unsqueeze(1)


def _buffer(shape: tuple[int, int, int]) -> np.ndarray | None:
    """The pass's buffer as a boolean array of ``shape``, if a pass is in progress and its last mask is gone."""
    if not _PASSES or _PASSES[-1]["mask"]() is not None:
        return None  # no pass, or its last mask is still held: a buffer of its own
    current = _PASSES[-1]
    if current["buffer"] is None or current["buffer"].size < math.prod(shape):
        current["buffer"] = np.empty(math.prod(shape), dtype=bool)
    return current["buffer"][: math.prod(shape)].reshape(shape)


def flex_mask_mod(sizes: torch.Tensor):
    """The same test as a FlexAttention ``mask_mod(batch, head, query, key)``, for ``create_block_mask``."""

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q - kv < sizes[b, kv])

    return mask_mod


def _offsets(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (width, dtype, str(device))
    if key not in _OFFSETS:
        if len(_OFFSETS) >= 8:  # a few row widths at a time
            _OFFSETS.clear()
        columns = torch.arange(width, device=device)
        offsets = columns[:, None] - columns[None, :]
        _OFFSETS[key] = torch.where(offsets >= 0, offsets, width).to(dtype)
    return _OFFSETS[key]
