"""Rotary embedding applied from a precomputed cos/sin cache (torch twin)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path: one compiled op for q and k (kernels/cpu/elementwise.cpp) where it built, else the twin."""
    if (
        query.dtype in _COMPILED_DTYPES
        and key.dtype == query.dtype
        and cos_sin_cache.dtype in _COMPILED_DTYPES
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and cpu_ops_available()
    ):
        return torch.ops.pagedserve.rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox)
    return rotary_embedding_torch(positions, query, key, cos_sin_cache, head_size, is_neox)


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.to(torch.int64)).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot/2]
    return (
        _rotate(query, cos, sin, head_size, rotary_dim, is_neox),
        _rotate(key, cos, sin, head_size, rotary_dim, is_neox),
    )


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    num_tokens = x.shape[0]
    heads = x.view(num_tokens, -1, head_size)
    rot = heads[..., :rotary_dim].float()
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rotary_dim == head_size:
        return rotated.to(x.dtype).reshape(x.shape)
    out = heads.clone()
    out[..., :rotary_dim] = rotated.to(x.dtype)
    return out.reshape(x.shape)
