"""Entry point: write new K/V rows into the paged cache."""

from __future__ import annotations

import torch

from pagedserve.kernels._validate import check_dim
from pagedserve.kernels.torch_impl.cache import reshape_and_cache_torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1 = skip). In place."""
    check_dim("key", key, 3)
    check_dim("key_cache", key_cache, 4)
    check_dim("slot_mapping", slot_mapping, 1)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not match key_cache rows {tuple(key_cache.shape[2:])}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping length {slot_mapping.shape[0]} != number of key tokens {key.shape[0]}")
    reshape_and_cache_unchecked(key, value, key_cache, value_cache, slot_mapping)


def reshape_and_cache_unchecked(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`reshape_and_cache` without the shape checks (for the model layers)."""
    if key_cache.is_cuda:
        from pagedserve.kernels.triton.cache import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping)
