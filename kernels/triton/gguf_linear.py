"""Triton dequant-GEMM for GGUF block-quantized weights: y = x W^T, W as uint8 rows of llama.cpp blocks.

One program computes a [BLOCK_M, BLOCK_N] tile of y. It walks K 32 elements at a time (a block of the
simple types, a sub-block of a K-quant super-block): reads that block's scale (and min) and its packed
values for BLOCK_N rows of W, dequantizes them in registers into a [32, BLOCK_N] tile of x's dtype, and
accumulates tl.dot(x tile, W tile) in float32.
W is never dequantized in memory. The formats are described in kernels/torch_impl/gguf_quant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES
from pagedserve.kernels.triton._utils import dot_precision, interpreting

# Where a block's packed low nibbles start (after d, m and the Q5 high bits), by GGML type value (the
# K-quants' layouts are spelled out in the kernel).
_QS_OFFSET = {2: 2, 3: 4, 6: 6, 7: 8, 8: 2, 12: 16, 13: 48, 14: 0}


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian float16 at byte pointers ``ptr`` (0 where masked), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_linear_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, row_bytes,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, SUBS: tl.constexpr, QS_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    j = tl.arange(0, 32)  # element within a block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_base = w_ptr + rn.to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]
    mask = n_mask[None, :]
    for b in range(0, K // 32):
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + b * 32 + j[None, :], mask=m_mask[:, None], other=0.0)
        block = row_base + (b // SUBS) * BLOCK_BYTES  # this block (K-quants: this super-block)
        i = b % SUBS  # the sub-block within it (K-quants)
        if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: 6-bit scale and min of sub-block i, then nibbles
            s_i = tl.load(block + 4 + i, mask=mask, other=0).to(tl.int32)
            s_i4 = tl.load(block + 8 + i, mask=mask, other=0).to(tl.int32)
            s_im4 = tl.load(block + 4 + tl.maximum(i - 4, 0), mask=mask, other=0).to(tl.int32)
            sc = tl.where(i < 4, s_i & 63, (s_i4 & 0x0F) | ((s_im4 >> 6) << 4)).to(tl.float32)
            mn = tl.where(i < 4, s_i4 & 63, (s_i4 >> 4) | ((s_i >> 6) << 4)).to(tl.float32)
            byte = tl.load(block + QS_OFFSET + 32 * (i // 2) + j[:, None], mask=mask, other=0).to(tl.int32)
            q = (byte >> (4 * (i % 2))) & 0x0F
            if QTYPE == 13:
                qh = tl.load(block + 16 + j[:, None], mask=mask, other=0).to(tl.int32)
                q = q | (((qh >> i) & 1) << 4)
            w = (_f16_at(block, mask) * sc) * q.to(tl.float32) - _f16_at(block + 2, mask) * mn
        elif QTYPE == 14:  # Q6_K: low nibbles, 2-bit highs, an int8 scale per 16 elements
            half = i // 4
            k = i % 4
            ql = tl.load(block + 64 * half + 32 * (k % 2) + j[:, None], mask=mask, other=0).to(tl.int32)
            qh = tl.load(block + 128 + 32 * half + j[:, None], mask=mask, other=0).to(tl.int32)
            q = (((ql >> (4 * (k // 2))) & 0x0F) | (((qh >> (2 * k)) & 3) << 4)) - 32
            sc = tl.load(block + 192 + 8 * half + 2 * k + (j // 16)[:, None], mask=mask, other=0)
            w = (_f16_at(block + 208, mask) * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q.to(tl.float32)
        elif QTYPE == 8:
            d = _f16_at(block, mask)  # [1, BLOCK_N]
            q = tl.load(block + 2 + j[:, None], mask=n_mask[None, :], other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
        else:
            d = _f16_at(block, mask)
            byte = tl.load(block + QS_OFFSET + (j % 16)[:, None], mask=n_mask[None, :], other=0).to(tl.int32)
            q = (byte >> (4 * (j // 16))[:, None]) & 0x0F  # [32, BLOCK_N]
            if QTYPE == 6 or QTYPE == 7:
                qh = tl.load(block + (QS_OFFSET - 4) + (j // 8)[:, None], mask=n_mask[None, :], other=0).to(tl.int32)
                q = q | (((qh >> (j % 8)[:, None]) & 1) << 4)
            qf = q.to(tl.float32)
            if QTYPE == 2:
                w = (qf - 8.0) * d
            elif QTYPE == 6:
                w = (qf - 16.0) * d
            else:
                m = _f16_at(block + 2, n_mask[None, :])
                w = qf * d + m
        w = w.to(x_ptr.dtype.element_ty)  # rounded to x's dtype, as the twin's dequantized tile
        if INTERPRET:  # interpreter defect: tl.dot on bf16 returns garbage; the GPU keeps bf16 dots
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_linear_triton(x: torch.Tensor, weight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """x [..., K] @ dequantize(weight).T -> [..., N] in x.dtype (K = in_features, whole blocks)."""
    code, bb, elements = GGUF_QUANT_TYPES[qtype]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    M, N = x2.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        block_m = 16 if M <= 16 else 32
        block_n = 64
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _gguf_linear_kernel[grid](
            x2, w, out, M, N, in_features, x2.stride(0), out.stride(0), w.shape[1],
            QTYPE=code, BLOCK_BYTES=bb, SUBS=elements // 32, QS_OFFSET=_QS_OFFSET[code], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(x.dtype),
            INTERPRET=interpreting(),
        )
    return out.reshape(*x.shape[:-1], N)
