"""Torch twin of the LoRA segment matmul (SGMV): rows grouped by adapter slot, one matmul per group."""

from __future__ import annotations

import torch


def lora_segment_matmul_torch(x: torch.Tensor, weights: torch.Tensor, seg_starts: list[int],
                              seg_slots: list[int]) -> torch.Tensor:
    """out[s:e] = x[s:e] @ weights[slot]^T for each segment [s, e) = seg_starts[g:g+2], slot = seg_slots[g].

    x [M, K], weights [S, N, K] -> out [M, N] in x's dtype (rows outside every segment are zero).
    """
    covered = bool(seg_slots) and seg_starts[0] == 0 and seg_starts[-1] == x.shape[0]
    # Segments that cover every row (as the LoRA layers' are) write all of out: no zero-fill first.
    out = x.new_empty(x.shape[0], weights.shape[1]) if covered else x.new_zeros(x.shape[0], weights.shape[1])
    for g, slot in enumerate(seg_slots):
        start, end = seg_starts[g], seg_starts[g + 1]
        if end > start:
            torch.matmul(x[start:end], weights[slot].t(), out=out[start:end])
    return out
