"""Triton rotary embedding: one program per token rotates all its query and key heads (out of place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, stride_x, stride_out, num_heads, head_size, cos, sin,
    IS_NEOX: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (i < HALF)
    if IS_NEOX:
        ia = i
        ib = i + HALF
    else:
        ia = 2 * i
        ib = 2 * i + 1
    base_x = x_ptr + token * stride_x + h * head_size
    base_o = out_ptr + token * stride_out + h * head_size
    a = tl.load(base_x + ia, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base_x + ib, mask=mask, other=0.0).to(tl.float32)
    tl.store(base_o + ia, (a * cos - b * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(base_o + ib, (b * cos + a * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
    stride_q, stride_k, stride_qo, stride_ko, stride_cache,
    num_heads, num_kv_heads, head_size,
    IS_NEOX: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_R)[None, :]
    cmask = i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q, stride_qo, num_heads, head_size, cos, sin,
                  IS_NEOX, HALF, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k, stride_ko, num_kv_heads, head_size, cos, sin,
                  IS_NEOX, HALF, BLOCK_HK, BLOCK_R)


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, cache = query.contiguous(), key.contiguous(), cos_sin_cache.contiguous()
    half = cache.shape[1] // 2
    # With partial rotary the dims past rotary_dim pass through, so start from copies.
    make_out = torch.empty_like if 2 * half == head_size else torch.clone
    q_out, k_out = make_out(query), make_out(key)
    num_tokens = query.shape[0]
    num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, query, key, q_out, k_out, cache,
            query.stride(0), key.stride(0), q_out.stride(0), k_out.stride(0), cache.stride(0),
            num_heads, num_kv_heads, head_size,
            IS_NEOX=is_neox, HALF=half, BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_R=triton.next_power_of_2(half),
        )
    return q_out, k_out
