"""Process groups for tensor and pipeline parallelism.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``; the ranks of one pipeline
stage form a TP group, and ranks with the same ``tp_rank`` form a PP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class ParallelContext:
    """Where this process sits in the TP x PP grid and the groups it talks through."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None

    @classmethod
    def single(cls) -> "ParallelContext":
        """One process, no torch.distributed: every collective is a no-op."""
        return cls()

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the same tp_rank on the next stage (wraps around)."""
        return ((self.pp_rank + 1) % self.pp_size) * self.tp_size + self.tp_rank

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the same tp_rank on the previous stage (wraps around)."""
        return ((self.pp_rank - 1) % self.pp_size) * self.tp_size + self.tp_rank


def _validate(rank: int, world_size: int, tp_size: int, pp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if world_size != tp_size * pp_size:
        raise ValueError(f"world_size ({world_size}) must equal tp_size * pp_size ({tp_size} * {pp_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def init_distributed(
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> ParallelContext:
    """Join the default process group (or reuse it) and build the TP and PP subgroups.

    Every rank must call this with the same arguments: ``new_group`` is collective
    and each rank creates every subgroup in the same order. ``backend`` defaults to
    nccl when CUDA is available, gloo otherwise. On CUDA the caller selects the
    device (``torch.cuda.set_device``) before calling.
    """
    _validate(rank, world_size, tp_size, pp_size)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already initialized with rank {dist.get_rank()} / world_size "
                f"{dist.get_world_size()}, not rank {rank} / world_size {world_size}"
            )
    else:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp_group = pp_group = None
    for p in range(pp_size):
        group = dist.new_group([p * tp_size + t for t in range(tp_size)])
        if p == pp_rank:
            tp_group = group
    for t in range(tp_size):
        group = dist.new_group([p * tp_size + t for p in range(pp_size)])
        if t == tp_rank:
            pp_group = group
    return ParallelContext(
        rank=rank,
        world_size=world_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_group=tp_group,
        pp_group=pp_group,
    )


def destroy_distributed() -> None:
    """Tear down the default process group (and with it every subgroup), if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
