"""A sweep on several processes: ``torchrun --nproc-per-node N -m tatblimp_callback sweep RUN_DIR``.

torchrun (or ``accelerate launch``) starts the processes and sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; the sweep joins them in a gloo process group (small Python objects only, so it
works whether the scoring runs on GPUs or the CPU). Process 0 polls the run folder and hands the
checkpoints out in rounds, one to each process; every process scores whole checkpoints alone
(``distributed.this_process_only``) on its own device, ``LOCAL_RANK``'s GPU or the CPU; process 0
gathers each round's outcomes and writes them in step order. A checkpoint that fails is an
outcome like any other, so no process waits for one that gave up.

Without those variables (or with ``WORLD_SIZE=1``) nothing here talks to another process.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# A round waits for its slowest checkpoint; a large model's may take hours to load and score.
ROUND_TIMEOUT = datetime.timedelta(hours=24)


class SweepProcesses:
    """This process's place among the sweep's processes, and the two collectives a sweep needs.

    Args:
        environ: the launcher's variables (default ``os.environ``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
    """

    def __init__(self, environ: dict[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self.rank = int(environ.get("RANK", 0))
        self.size = int(environ.get("WORLD_SIZE", 1))
        self.local_rank = int(environ.get("LOCAL_RANK", 0))
        self._group = None
        self._created_default_group = False
        if self.size > 1:
            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=self.rank, world_size=self.size, timeout=ROUND_TIMEOUT)
                self._created_default_group = True
            # A default group made by others may be NCCL; Python objects travel over gloo here.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=ROUND_TIMEOUT)

    @property
    def is_first(self) -> bool:
        """Whether this process writes the results (and the wandb run, the progress bar)."""
        return self.rank == 0

    def device(self, requested: str | None) -> str | None:
        """The device this process scores on: ``requested`` if given, else ``LOCAL_RANK``'s GPU under a
        launcher, else None (the loader's default: cuda if available, else the CPU)."""
        if requested is not None or self.size == 1:
            return requested
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def rounds(self, todo: Sequence[T]) -> Iterator[T | None]:
        """This process's checkpoint of each round (None when a round has fewer checkpoints than processes)."""
        for start in range(0, len(todo), self.size):
            round_ = todo[start : start + self.size]
            yield round_[self.rank] if self.rank < len(round_) else None

    def from_first(self, value: Any) -> Any:
        """Process 0's ``value`` on every process (what the others pass is ignored)."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every process's ``value`` in rank order on process 0; None on the others."""
        if self.size == 1:
            return [value]
        values = [None] * self.size if self.is_first else None
        dist.gather_object(value, values, dst=0, group=self._group)
        return values

    def close(self) -> None:
        """Leave the process group, if the sweep made it."""
        if self._created_default_group and dist.is_initialized():
            dist.destroy_process_group()
            self._created_default_group = False
