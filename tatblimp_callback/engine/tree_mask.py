"""The prefix-tree attention mask from one integer a position: the end of its subtree.

A row's tree is laid out depth first (sorted sequences add their new tokens in order), so the
subtree of column k is the run of columns k, k + 1, ..., ``ends[k] - 1``, and column k is an
ancestor of column q (or q itself) exactly when ``k <= q < ends[k]``. The mask is that test,
broadcast over (query, key): two comparisons an element, with no step per depth and nothing
quadratic kept between forward calls. Padding ends where it starts (``ends[k] = k + 1``): it sees
itself only. The same test is a FlexAttention ``mask_mod`` (``flex_mask_mod``), for a block-sparse
mask that skips the blocks no position attends to.
"""

from __future__ import annotations

import torch


def interval_mask(ends: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[rows, 1, width, width]: query q sees key k where ``k <= q < ends[row, k]``; boolean (True:
    attend), or additive in the floating ``dtype`` (0, or its most negative value), as eager attention wants."""
    width = ends.shape[-1]
    columns = torch.arange(width, device=ends.device)
    queries = columns.view(1, width, 1)
    seen = (columns.view(1, 1, width) <= queries) & (queries < ends.unsqueeze(1))
    if dtype == torch.bool:
        return seen.unsqueeze(1)
    mask = torch.zeros(seen.shape, dtype=dtype, device=ends.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min).unsqueeze(1)


def flex_mask_mod(ends: torch.Tensor):
    """The same test as a FlexAttention ``mask_mod(batch, head, query, key)``, for ``create_block_mask``."""

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < ends[b, kv])

    return mask_mod
