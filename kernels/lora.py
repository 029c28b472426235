"""Entry point: the LoRA segment matmul (rows grouped by adapter slot, one weight per group)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.torch_impl.lora import lora_segment_matmul_torch


@dataclass
class LoRASegments:
    """Rows grouped by adapter slot: group g is rows starts[g]..starts[g+1] under slot slots[g]. The host
    lists drive the torch twin; the int32 tensors (on the rows' device) the Triton kernel."""

    starts: list[int]
    slots: list[int]
    starts_t: torch.Tensor
    slots_t: torch.Tensor
    max_len: int


def lora_segment_matmul(x: torch.Tensor, weights: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """x [M, K] (rows grouped as `segments` says), weights [S, N, K] -> [M, N]: each group's rows times
    its slot's weight, transposed."""
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and weights {tuple(weights.shape)}: expected [M, K] and [S, N, K]")
    if x.is_cuda:
        from pagedserve.kernels.triton.lora import lora_segment_matmul_triton

        return lora_segment_matmul_triton(x, weights, segments.starts_t, segments.slots_t, segments.max_len)
    return lora_segment_matmul_torch(x, weights, segments.starts, segments.slots)
