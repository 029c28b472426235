"""Triton dequant-GEMM for GGUF block-quantized weights: y = x W^T, W as uint8 rows of llama.cpp blocks.

One program computes a [BLOCK_M, BLOCK_N] tile of y over a range of K. It walks that range BLOCK_K
elements at a time: several 32-element blocks of the simple types, or one 256-element K-quant
super-block (its eight 32-element sub-blocks). For each step it reads every block's scale (and min) once
and its packed values for BLOCK_N rows of W, dequantizes them in registers into a [BLOCK_K, BLOCK_N] tile
of x's dtype (built as a [blocks, 32, BLOCK_N] tensor, then reshaped), and accumulates tl.dot(x tile, W tile) in
float32. W is never dequantized in memory. The formats are described in kernels/torch_impl/gguf_quant.py.

Decode multiplies a few rows of x by a small matrix (576 x 576 for the default model): a grid of
[M tiles, N tiles] alone would be a handful of programs on a GPU of a hundred-odd SMs, each walking all of
K. Such calls split K too (split-K): each split writes a float32 partial tile and the partials are summed
in a fixed order afterwards (the same result on every run, as greedy parity needs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES
from pagedserve.kernels.triton._utils import dot_precision, interpreting

# Where a block's packed low nibbles start (after d, m and the Q5 high bits), by GGML type value (the
# K-quants' layouts are spelled out in the kernel).
_QS_OFFSET = {2: 2, 3: 4, 6: 6, 7: 8, 8: 2, 12: 16, 13: 48, 14: 0}
# Elements of K per step: four blocks of a simple type, one K-quant super-block.
_BLOCK_K = {32: 128, 256: 256}


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian float16 at byte pointers ``ptr`` (0 where masked), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_simple(row, blk, mask, QTYPE: tl.constexpr, QS_OFFSET: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """[G, 32, BLOCK_N] weights of blocks ``blk`` [G, 1, 1] of rows ``row`` [1, 1, BLOCK_N] (a 32-element type)."""
    j = tl.arange(0, 32)[None, :, None]
    block = row + blk * BLOCK_BYTES  # [G, 1, BLOCK_N]
    d = _f16_at(block, mask)
    if QTYPE == 8:  # Q8_0
        q = tl.load(block + 2 + j, mask=mask, other=0)
        return q.to(tl.int8, bitcast=True).to(tl.float32) * d
    byte = tl.load(block + QS_OFFSET + (j % 16), mask=mask, other=0).to(tl.int32)
    q = (byte >> (4 * (j // 16))) & 0x0F
    if QTYPE == 6 or QTYPE == 7:  # Q5: the fifth bits
        qh = tl.load(block + (QS_OFFSET - 4) + (j // 8), mask=mask, other=0).to(tl.int32)
        q = q | (((qh >> (j % 8)) & 1) << 4)
    qf = q.to(tl.float32)
    if QTYPE == 2:
        return (qf - 8.0) * d
    if QTYPE == 6:
        return (qf - 16.0) * d
    return qf * d + _f16_at(block + 2, mask)  # Q4_1, Q5_1


@triton.jit
def _dequant_k_quant(block, mask, QTYPE: tl.constexpr, QS_OFFSET: tl.constexpr):
    """[8, 32, BLOCK_N] weights of the super-block at ``block`` [1, 1, BLOCK_N] (Q4_K, Q5_K, Q6_K)."""
    i = tl.arange(0, 8)[:, None, None]  # sub-block
    j = tl.arange(0, 32)[None, :, None]  # element within it
    if QTYPE == 14:  # Q6_K: low nibbles, 2-bit highs, an int8 scale per 16 elements
        half = i // 4
        k = i % 4
        ql = tl.load(block + 64 * half + 32 * (k % 2) + j, mask=mask, other=0).to(tl.int32)
        qh = tl.load(block + 128 + 32 * half + j, mask=mask, other=0).to(tl.int32)
        q = (((ql >> (4 * (k // 2))) & 0x0F) | (((qh >> (2 * k)) & 3) << 4)) - 32
        sc = tl.load(block + 192 + 8 * half + 2 * k + j // 16, mask=mask, other=0)
        return (_f16_at(block + 208, mask) * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q.to(tl.float32)
    # Q4_K, Q5_K: 6-bit scale and min of sub-block i, then nibbles (and Q5_K's fifth bits)
    s_i = tl.load(block + 4 + i, mask=mask, other=0).to(tl.int32)
    s_i4 = tl.load(block + 8 + i, mask=mask, other=0).to(tl.int32)
    s_im4 = tl.load(block + 4 + tl.maximum(i - 4, 0), mask=mask, other=0).to(tl.int32)
    sc = tl.where(i < 4, s_i & 63, (s_i4 & 0x0F) | ((s_im4 >> 6) << 4)).to(tl.float32)
    mn = tl.where(i < 4, s_i4 & 63, (s_i4 >> 4) | ((s_i >> 6) << 4)).to(tl.float32)
    byte = tl.load(block + QS_OFFSET + 32 * (i // 2) + j, mask=mask, other=0).to(tl.int32)
    q = (byte >> (4 * (i % 2))) & 0x0F
    if QTYPE == 13:
        qh = tl.load(block + 16 + j, mask=mask, other=0).to(tl.int32)
        q = q | (((qh >> i) & 1) << 4)
    return (_f16_at(block, mask) * sc) * q.to(tl.float32) - _f16_at(block + 2, mask) * mn


@triton.jit
def _gguf_linear_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, stride_os, row_bytes, steps_per_split,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_ELEMS: tl.constexpr, QS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask3 = (rn < N)[None, None, :]
    row = w_ptr + rn.to(tl.int64)[None, None, :] * row_bytes  # [1, 1, BLOCK_N]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    G: tl.constexpr = BLOCK_K // 32  # 32-element blocks (K-quants: sub-blocks) per step
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(first, last):
        k0 = step * BLOCK_K
        x = tl.load(x_rows + k0 + rk[None, :], mask=m_mask[:, None] & (k0 + rk < K)[None, :], other=0.0)
        if BLOCK_ELEMS == 256:
            w3 = _dequant_k_quant(row + step * BLOCK_BYTES, n_mask3, QTYPE, QS_OFFSET)
        else:
            blk = k0 // 32 + tl.arange(0, G)[:, None, None]
            w3 = _dequant_simple(row, blk, n_mask3 & (blk < K // 32), QTYPE, QS_OFFSET, BLOCK_BYTES)
        w = tl.reshape(w3, (BLOCK_K, BLOCK_N)).to(x_ptr.dtype.element_ty)  # rounded to x's dtype, as the twin's tile
        if INTERPRET:  # interpreter defect: tl.dot on bf16 returns garbage; the GPU keeps bf16 dots
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (rn < N)[None, :])


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    """Programs a launch should have to fill the device: two per SM on a GPU. Under the interpreter a
    small number, so that the CPU tests take the split-K path too."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shape(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for m rows of x and n of W. Wider M tiles share each dequantized
    weight tile among more rows; narrow N tiles keep the dequantized tile in registers. Picked from a
    sweep on an H100 (the default model's shapes and a 4096-wide one, M 1 to 256): a long GEMV (an LM
    head) ran 1.5x faster on 2 warps, and at 256 rows 128-row tiles 1.2-1.7x faster than 64-row ones."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return block_m, 32, 2 if m <= 16 and n >= 16384 else 4


# (device, GGML type, x's dtype, chosen BLOCK_M, num_warps) -> the smaller BLOCK_M that a launch fell back
# to because the chosen tile did not fit the device's shared memory.
_FITTED_BLOCK_M: dict[tuple[torch.device, int, torch.dtype, int, int], int] = {}


def gguf_linear_triton(x: torch.Tensor, weight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """x [..., K] @ dequantize(weight).T -> [..., N] in x.dtype (K = in_features, whole blocks).

    A tile too large for the device's shared memory (a float32 K-quant step of 256 elements in 128-row
    tiles needs 288 KiB, over an H100's 227; consumer GPUs have about 100) fails to launch before any
    work is queued: the launch is retried with half the rows per tile, and the fitting size remembered."""
    code = GGUF_QUANT_TYPES[qtype][0]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, N = x2.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        block_m, block_n, num_warps = _launch_shape(M, N)
        key = (x.device, code, x.dtype, block_m, num_warps)
        block_m = _FITTED_BLOCK_M.get(key, block_m)
        while True:
            try:
                _launch(x2, w, out, qtype, in_features, block_m, block_n, num_warps)
                break
            except OutOfResources:
                if block_m <= 16:
                    raise
                block_m //= 2
                _FITTED_BLOCK_M[key] = block_m
    return out.reshape(*x.shape[:-1], N)


def _launch(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor, qtype: str, in_features: int,
            block_m: int, block_n: int, num_warps: int) -> None:
    """One launch of the kernel writing out [M, N], split over K where the tiles alone are too few."""
    code, bb, elements = GGUF_QUANT_TYPES[qtype]
    M, N = out.shape
    block_k = _BLOCK_K[elements]
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    steps = triton.cdiv(in_features, block_k)
    per_split = triton.cdiv(steps, max(1, min(steps, _target_programs(x2.device) // tiles)))
    splits = triton.cdiv(steps, per_split)
    dest = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x2.device)
    _gguf_linear_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)](
        x2, w, dest, M, N, in_features, x2.stride(0), dest.stride(-2), dest.stride(0) if splits > 1 else 0,
        w.stride(0), per_split,
        QTYPE=code, BLOCK_BYTES=bb, BLOCK_ELEMS=elements, QS_OFFSET=_QS_OFFSET[code],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x2.dtype),
        INTERPRET=interpreting(), num_warps=num_warps,
    )
    if splits > 1:
        out.copy_(dest.sum(dim=0))  # summed in float32, then rounded to x's dtype
