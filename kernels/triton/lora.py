"""Triton LoRA segment matmul (SGMV): grid (segment, row tile, column tile).

Rows of x come grouped by adapter slot (segment g holds rows seg_starts[g]..seg_starts[g+1] and uses
weights[seg_slots[g]]); each program computes one [BLOCK_M, BLOCK_N] tile of its segment's
x_seg @ W_slot^T, walking K in BLOCK_K steps with fp32 accumulation. The same kernel serves both
halves of a LoRA delta: the shrink (W = A stack [S, rank, in]) and the expand (W = B stack [S, out, rank]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._utils import dot_precision, next_pow2


@triton.jit
def _segment_matmul_kernel(
    x_ptr, w_ptr, out_ptr, starts_ptr, slots_ptr,
    N, K, stride_xm, stride_ws, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rm = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < end
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + slot * stride_ws
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def lora_segment_matmul_triton(x: torch.Tensor, weights: torch.Tensor, seg_starts: torch.Tensor,
                               seg_slots: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """The twin's contract; seg_starts [G+1] and seg_slots [G] are int32 tensors on x's device."""
    x = x.contiguous()
    weights = weights.contiguous()
    num_rows, k = x.shape
    n = weights.shape[1]
    out = x.new_zeros(num_rows, n)
    groups = seg_slots.numel()
    if groups == 0 or num_rows == 0 or max_seg_len == 0:
        return out
    block_m = max(16, min(64, next_pow2(max_seg_len)))
    block_n = max(16, min(64, next_pow2(n)))
    block_k = max(16, min(64, next_pow2(k)))
    grid = (groups, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _segment_matmul_kernel[grid](
        x, weights, out, seg_starts, seg_slots, n, k, x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
    )
    return out
