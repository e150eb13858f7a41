"""How much memory one evaluation may use, how many positions a forward call may hold, and the retry on out-of-memory."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from ..reading.option_types import is_whole_number
from . import distributed

logger = logging.getLogger(__name__)

CPU_MEMORY_BUDGET = 512 * 2**20
MIN_MEMORY_BUDGET = 16 * 2**20
# The default budget is at most this fraction of the workload's full float32 logits: a tenth, so
# that the real peak, estimates' error included, stays within an eighth of them.
FULL_LOGITS_DIVISOR = 10

T = TypeVar("T")


def check_sizes(memory_budget, row_length) -> None:
    """``memory_budget`` (bytes) and ``row_length`` (positions a row): each None (the default) or a positive whole number.

    Raises:
        ValueError: anything else, naming the option.
    """
    for name, value, unit in (("memory_budget", memory_budget, "bytes"), ("row_length", row_length, "positions")):
        if value is not None and (not is_whole_number(value) or value <= 0):
            raise ValueError(f"{name} must be a positive whole number of {unit}, or None for the default; got {value!r}")


def default_memory_budget(device: torch.device, full_logits_bytes: int | None = None) -> int:
    """Bytes one evaluation may use: a quarter of free GPU memory, else ``CPU_MEMORY_BUDGET``.

    Scoring runs beside training, so it never asks for more than a tenth of what the full float32
    logits of the workload (``full_logits_bytes``) would take, nor less than ``MIN_MEMORY_BUDGET``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 4
    else:
        budget = CPU_MEMORY_BUDGET
    if full_logits_bytes:
        budget = min(budget, full_logits_bytes // FULL_LOGITS_DIVISOR)
    return max(MIN_MEMORY_BUDGET, budget)


def one_call_budget(memory_budget: int, cache, lm: torch.nn.Module, row_length: int) -> int | None:
    """The bytes a forward call may use: at least ``memory_budget``, and enough for every token of ``cache``
    (``activation_bytes_per_position`` of ``lm`` each) where the memory free beside training is known and a quarter of
    it holds them: on one GPU (one process). None: the calls are sized by ``memory_budget``.

    The default budget stays what it is for the LM head and the plan: only the body's calls are sized by this, so
    an evaluation on a large card is one call instead of a few (the 478M shape's three under its 691 MB budget on
    a 141 GB H200). Measured by ``benchmarks/gpu_check.py`` (``calls``).
    """
    if cache.device.type != "cuda" or distributed.world()[1] > 1:
        return None
    free, _ = torch.cuda.mem_get_info(cache.device)
    dtype = next(lm.parameters()).dtype
    needed = sum(cache.lengths) * activation_bytes_per_position(lm.config, dtype, row_length)
    return max(memory_budget, needed) if needed <= free // 4 else None


def activation_bytes_per_position(config, dtype: torch.dtype, row_length: int) -> int:
    """Estimated live bytes per position in a forward call: one layer's activations plus a row's attention scores.

    Attention without a fused kernel for the mask (the CPU's, with a prefix-tree mask) holds the scores and
    their softmax at once, each [heads x row_length] a position: both are counted.
    """
    hidden = getattr(config, "hidden_size", 1024)
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    heads = getattr(config, "num_attention_heads", 16)
    element = torch.finfo(dtype).bits // 8
    # A row's attention scores and their softmax, and its mask (4 bytes at most per key).
    return element * (6 * hidden + 3 * intermediate) + 4 * (2 * heads + 1) * row_length


def positions_per_forward(memory_budget: int, config, dtype: torch.dtype, row_length: int, full_logits_vocab: int | None) -> int:
    """Positions one forward call may hold within ``memory_budget``, at least one row.

    ``full_logits_vocab``: where the model's own forward gives the logits (not the tiled head),
    their vocabulary size: every position then also holds its logits, and the scored ones a
    float32 log-softmax.
    """
    per_position = activation_bytes_per_position(config, dtype, row_length)
    if full_logits_vocab:
        per_position += full_logits_vocab * (2 * (torch.finfo(dtype).bits // 8) + 8)
    return max(row_length, memory_budget // per_position)


def retry_out_of_memory(
    attempt: Callable[[], T], budget: int, device: torch.device, set_budget: Callable[[int, bool], None]
) -> T:
    """``attempt()``, its memory budget halved and retried on out-of-memory down to ``MIN_MEMORY_BUDGET``.

    ``set_budget(budget, retrying)`` gives the caller the budget to use (a plan made for another
    budget is stale), first the smallest over the processes (every process must lay its rows out
    alike), then after each out-of-memory its half. All processes retry together (``distributed.retry_together``).
    """
    budget = distributed.min_over_processes(budget)
    set_budget(budget, False)
    while True:
        try:
            return attempt()
        except torch.OutOfMemoryError as error:
            distributed.retry_together(error)
            if budget // 2 < MIN_MEMORY_BUDGET:
                raise
        # Past the except block, the failed attempt's traceback and the tensors its frames
        # held are gone, so emptying the device cache below really frees them.
        budget //= 2
        set_budget(budget, True)
        empty_device_cache(device)
        logger.warning("tatblimp: out of memory while scoring; retrying with %d MiB", budget >> 20)


def empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release_freed_memory(device: torch.device) -> None:
    """Hand the memory an evaluation freed on the CPU back to the system (glibc's ``malloc_trim``).

    glibc keeps freed blocks below its adaptive threshold (up to 32 MiB: the head's tiles, the
    activations) mapped for reuse, so without this a training process would carry hundreds of MiB
    of an evaluation's freed memory until its next one. Nothing happens on another allocator.
    """
    if device.type == "cpu" and _malloc_trim() is not None:
        _malloc_trim()(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl; Windows has no CDLL(None))
        return None
