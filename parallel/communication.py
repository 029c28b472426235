"""Collectives over the TP group and point-to-point transfers between PP stages.

Every function is a no-op (returns its input) when the relevant group has size 1,
so single-process code paths never touch torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedserve.parallel.state import ParallelContext


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place when tp_size > 1)."""
    if ctx.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ctx.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenate each TP rank's ``x`` along ``dim`` (in tp_rank order)."""
    if ctx.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x, group=ctx.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send_tensors(tensors: dict[str, torch.Tensor], ctx: ParallelContext, dst: int | None = None) -> None:
    """Send a dict of tensors to the next stage (global rank ``dst``, default the next stage).

    The names, shapes and dtypes go first as one pickled object so the receiver
    can allocate; then each tensor follows in insertion order.
    """
    if ctx.pp_size == 1:
        return
    dst = ctx.next_pp_rank if dst is None else dst
    header = [[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]]
    device = next(iter(tensors.values())).device if tensors else None
    dist.send_object_list(header, dst=dst, group=ctx.pp_group, device=device)
    for t in tensors.values():
        dist.send(t.contiguous(), dst=dst, group=ctx.pp_group)


def pp_recv_tensors(
    ctx: ParallelContext, src: int | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Receive the dict sent by ``pp_send_tensors`` from global rank ``src`` (default the previous stage)."""
    if ctx.pp_size == 1:
        return {}
    src = ctx.prev_pp_rank if src is None else src
    header: list = [None]
    dist.recv_object_list(header, src=src, group=ctx.pp_group, device=torch.device(device))
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in header[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=ctx.pp_group)
        out[name] = t
    return out


def world_sum_ints(values: list[int], device: torch.device) -> list[int]:
    """Sum a few integers over every rank of the default group (all TP x PP ranks of one engine).
    Every rank must call it for the same step, in the same order (like any collective)."""
    backend = dist.get_backend()
    tensor = torch.tensor(values, dtype=torch.int64, device=device if backend == "nccl" else "cpu")
    dist.all_reduce(tensor)
    return [int(x) for x in tensor.tolist()]
