"""Scoring on several processes (DDP, FSDP, DeepSpeed, plain ``torch.distributed``), without hangs.

Every process holds the same cache and builds the same layout of batches. The batches are dealt
out by token count (``assign``), each process writes its share's log-probs into a zero matrix of all
sequences' cells, and one ``all_reduce(SUM)`` adds the matrices up: every cell is computed on
exactly one process, so the result is bitwise that of one process (adding zeros is exact), and so
are the per-sentence sums taken from it afterwards.

Collectives must be called in the same order on every process, or a job hangs. The scorer keeps
that invariant with *check-ins*: one small ``all_reduce`` that every process reaches at the same
points (before every batch step, after the last one, and for each decision), carrying whether the
process has failed. A process that fails anywhere between two check-ins announces the failure at
the next one (``shared_failures``), and then every process stops: the failing one with its own
error, the others with ``PeerFailure``; when every failure was out of memory, all of them raise
``torch.OutOfMemoryError`` so that they all retry with the same smaller budget.

When a forward call is itself a collective (FSDP, DeepSpeed ZeRO-3, tensor-parallel DTensors:
``is_sharded``), every process runs the same number of forward calls; a process with fewer batches
repeats one and drops its result. A failure *inside* such a forward (say, out of memory halfway
through the layers) leaves the others inside the same forward's all-gather; only the process
group's timeout ends that, which is why the check-ins come between the forward calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

OK, OUT_OF_MEMORY, FAILED = 0, 1, 2
_SHARED = "_tatblimp_shared"  # set on an exception that every process already knows about


class PeerFailure(RuntimeError):
    """Scoring failed on another process; this process stopped the same evaluation with it."""


_alone = contextvars.ContextVar("tatblimp_alone", default=False)


def world() -> tuple[int, int]:
    """This process's rank and the number of processes (0 and 1 without ``torch.distributed``
    and inside ``this_process_only``)."""
    if dist.is_available() and dist.is_initialized() and not _alone.get():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def this_process_only() -> Iterator[None]:
    """Score on this process alone, with no collectives, e.g. ``if rank == 0:`` in a custom loop.

    Without it an evaluation started on one process only would wait for the others. A sharded
    (FSDP, ZeRO-3) model cannot be scored this way: its forward needs every process.
    """
    token = _alone.set(True)
    try:
        yield
    finally:
        _alone.reset(token)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether a forward call of ``model`` is a collective because its weights are split over processes.

    True for FSDP1 (``FullyShardedDataParallel``), FSDP2 (``fully_shard``) and other DTensor
    parameters, and DeepSpeed ZeRO-3 (partitioned parameters carry ``ds_id``).
    """
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules()):
        return True
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers are split over processes by tensor parallelism (DTensor weights, no FSDP),
    as transformers' ``tp_plan`` does: each forward adds up every process's partial result, so every
    process must feed it the same rows."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules()):
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def assign(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Batch indices per rank, balanced by cost: the largest batch goes to the least-loaded rank.

    Deterministic (ties go to the lower batch index and the lower rank), so every process computes
    the same assignment without talking to the others. Each rank's indices are in ascending order.
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(share) for share in shares]


def shard(batches: Sequence[Any], *, split: bool = True, lockstep: bool = False) -> Iterator[tuple[Any, bool]]:
    """This process's batch steps as ``(batch, is_filler)``, with a check-in before each and after the last.

    ``split``: deal the batches out (``assign`` by ``num_positions``); otherwise every process runs
    all of them. ``lockstep``: every process runs as many forward calls as the busiest one, the
    short ones repeating a batch as a filler (``is_filler=True``: its result must be dropped);
    needed when a forward call is a collective. On one process it yields every batch with
    ``is_filler=False`` and does nothing else.
    """
    rank, size = world()
    if size == 1:
        for index in range(len(batches)):
            yield batches[index], False  # unnamed: a batch built on reading is freed before the next one
        return
    sizes = batches.positions if hasattr(batches, "positions") else [b.num_positions for b in batches]
    shares = assign(sizes, size) if split else [list(range(len(batches)))] * size
    mine = shares[rank]
    for step in range(max(len(share) for share in shares)):
        check_in()
        if step < len(mine):
            yield batches[mine[step]], False
        elif lockstep and batches:
            yield batches[mine[-1] if mine else 0], True
    check_in()


def sum_over_processes(totals: torch.Tensor) -> torch.Tensor:
    """``totals`` summed over all processes (``all_reduce(SUM)``), on its own device."""
    if world()[1] == 1:
        return totals
    reduced = totals.to(_collective_device())
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(totals.device)


def check_in(failure: BaseException | None = None, *, vote: bool = True, value: int = 0) -> tuple[bool, int]:
    """The collective every process reaches at the same point: agree on success, a vote and a maximum.

    Returns (every process voted yes, the largest ``value``). Raises on every process when any
    process passed a ``failure``: that process its own exception, the others
    ``torch.OutOfMemoryError`` when all failures were out of memory, else ``PeerFailure``.
    """
    rank, size = world()
    code = OK if failure is None else OUT_OF_MEMORY if isinstance(failure, torch.OutOfMemoryError) else FAILED
    if size == 1:
        if failure is not None:
            raise failure
        return vote, value
    flags = torch.tensor([code, rank + 1 if code else 0, int(not vote), value], dtype=torch.int64)
    flags = flags.to(_collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    worst, failed_rank, veto, largest = flags.tolist()
    if worst == OK:
        return not veto, largest
    if code == worst:
        error = failure
    elif worst == OUT_OF_MEMORY:
        error = torch.OutOfMemoryError(f"tatblimp: process {failed_rank - 1} ran out of memory while scoring")
    else:
        error = PeerFailure(f"tatblimp: scoring failed on process {failed_rank - 1}; see its log")
    setattr(error, _SHARED, True)
    if error is failure:
        raise error
    raise error from failure


def same_on_every_process(value: str, what: str) -> None:
    """Raise ``ValueError`` on every process when ``value`` differs between them: ``what`` each holds (say, a
    benchmark file of its own), which would otherwise put them in collectives of other sizes (a gloo abort)."""
    if world()[1] == 1:
        return
    code = int(hashlib.sha256(value.encode()).hexdigest()[:15], 16)
    if check_in(value=code)[1] != -check_in(value=-code)[1]:
        raise ValueError(f"the processes hold different {what}: give every process the same")


def all_agree(vote: bool) -> bool:
    """True on every process if ``vote`` is true on every process."""
    return check_in(vote=vote)[0]


def min_over_processes(value: int) -> int:
    """The smallest ``value`` over all processes (e.g. a memory budget every process can afford)."""
    return -check_in(value=-value)[1]


def retry_together(error: torch.OutOfMemoryError) -> None:
    """After ``error``: return if every failing process ran out of memory, so that all retry together
    with the same smaller budget; raise ``PeerFailure`` if another process failed otherwise."""
    if world()[1] > 1 and not getattr(error, _SHARED, False):
        with contextlib.suppress(torch.OutOfMemoryError):
            check_in(error)


@contextlib.contextmanager
def shared_failures() -> Iterator[None]:
    """Re-raise an exception from the block after announcing it to the other processes (``check_in``)."""
    try:
        yield
    except Exception as error:
        if world()[1] > 1 and not getattr(error, _SHARED, False):
            check_in(error)
        raise


def _collective_device() -> torch.device:
    """Where the backend wants its tensors: the CPU for gloo and MPI, else the current accelerator."""
    backend = dist.get_backend()
    if "gloo" in backend or backend == "mpi" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
