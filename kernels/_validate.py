"""Shape checks shared by the entry points: bad input -> ValueError naming the field."""

from __future__ import annotations

import torch


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_kv_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    check_dim("key_cache", key_cache, 4)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    num_heads, head_size = query.shape[-2], query.shape[-1]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache head_size {key_cache.shape[3]} != query head_size {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query num_heads {num_heads} is not a multiple of key_cache num_kv_heads {num_kv_heads}")


def check_sliding_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
