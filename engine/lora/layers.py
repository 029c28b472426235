"""LoRA wrappers of the tensor-parallel projections: the base layer plus per-token low-rank deltas.

A wrapper keeps, for every resident slot, its adapter's A and B as this rank's shard, stacked over the
slots: ``a`` [max_loras, n * max_rank, in_here] and ``b`` [max_loras, out_here, n * max_rank], where n
is the number of logical projections fused in the layer (q/k/v: 3, gate/up: 2, o and down: 1). Sub-
projection i owns rank columns [i * max_rank, i * max_rank + r) and its own output rows, so one shrink
and one expand (the segment matmul, grouped by slot) serve the fused layer; padding and projections an
adapter leaves alone are zeros.

Sharding follows the base weights: a column-parallel layer (q/k/v, gate/up) splits B's output rows the
way its weight loader splits the weight (KV heads replicated where there are fewer than ranks) and keeps
A whole; a row-parallel layer (o, down) splits A's input columns and keeps B whole, and its partial
delta joins the partial output before the all-reduce (the sum over ranks of x_r A_r^T is x A^T).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.engine.lora.batch import LoRAContext
from pagedserve.parallel.communication import tp_all_reduce
from pagedserve.parallel.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def _add_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, context: LoRAContext) -> None:
    batch = context.batch
    if batch is None:
        return
    xs = x if batch.all_rows_in_order else x.index_select(0, batch.token_index)
    # The scaling multiplies the rank-wide shrunk rows, not the output-wide delta (the same product, less work).
    shrunk = kernels.lora_segment_matmul(xs, a, batch.segments) * batch.token_scale
    delta = kernels.lora_segment_matmul(shrunk, b, batch.segments)
    if batch.all_rows_in_order:
        y.add_(delta)
        return
    # (Each adapted row appears once: a gather, add and scatter; CPU index_add_ is far slower.)
    y.index_copy_(0, batch.token_index, y.index_select(0, batch.token_index) + delta)


class LoRALinear(nn.Module):
    """A projection with LoRA slots. `modules`: the HF names of the logical projections it fuses, in order."""

    def __init__(self, base: nn.Module, layer_idx: int, modules: tuple[str, ...], context: LoRAContext,
                 max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.layer_idx = layer_idx  # global layer index (the adapter's key)
        self.modules_fused = modules
        self.context = context
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        weight = base.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        if self.row_parallel:
            in_here, out_here = base.input_size_per_rank, base.output_size
        else:
            in_here, out_here = base.input_size, base.output_size_per_rank
        width = len(modules) * max_rank
        self.a = torch.zeros(max_loras, width, in_here, dtype=dtype, device=weight.device)
        self.b = torch.zeros(max_loras, out_here, width, dtype=dtype, device=weight.device)

    def _output_rows(self, i: int) -> tuple[int, int, int]:
        """Sub-projection i: (first output row here, rows here, first row of the full B to read)."""
        base = self.base
        tp_rank = base.parallel.tp_rank
        if isinstance(base, QKVParallelLinear):
            if i == 0:
                return 0, base.q_size, tp_rank * base.q_size
            start = base.kv_head_start * base.head_size
            return base.q_size + (i - 1) * base.kv_size, base.kv_size, start
        if isinstance(base, MergedColumnParallelLinear):
            n = base.output_sizes[i] // base.parallel.tp_size
            return sum(base.output_sizes[:i]) // base.parallel.tp_size, n, tp_rank * n
        n = base.output_size_per_rank
        return 0, n, tp_rank * n

    def set_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install an adapter in `slot`: `pairs` maps this layer's module names to full (A [r, in], B [out, r])."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, module in enumerate(self.modules_fused):
            pair = pairs.get(module)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            cols = slice(i * self.max_rank, i * self.max_rank + r)
            if self.row_parallel:
                n = self.base.input_size_per_rank
                start = self.base.parallel.tp_rank * n
                self.a[slot, cols].copy_(a[:, start:start + n])
                self.b[slot, :, cols].copy_(b)
            else:
                row, n, start = self._output_rows(i)
                self.a[slot, cols].copy_(a)
                self.b[slot, row:row + n, cols].copy_(b[start:start + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not self.row_parallel:
            y = base(x)
            _add_delta(y, x, self.a, self.b, self.context)
            return y
        y = base.local_matmul(x)
        _add_delta(y, x, self.a, self.b, self.context)
        if base.reduce_results:
            y = tp_all_reduce(y, base.parallel)
        if base.bias is not None:
            y = y + base.bias
        return y

    # The model reads these of its projections (split of the fused q/k/v output, head counts).
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)
