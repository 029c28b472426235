"""Triton reshape_and_cache: one program per token copies its [Hkv, D] K and V rows to its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._utils import next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size, num_kv_heads, head_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_size)
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    rows_ok = key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
    if not rows_ok or value_cache.stride() != key_cache.stride():
        raise ValueError("key/value and key_cache/value_cache must have a contiguous last dim and equal cache strides")
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1], num_kv_heads, head_size,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_size),
    )
