"""Write new K/V rows into the paged cache (the CPU twin)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The CPU path: the compiled op (a memcpy per token) where it built and the dtypes match, else index_copy_."""
    if (
        key.dtype == key_cache.dtype
        and value.dtype == value_cache.dtype
        and key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
        and cpu_ops_available()
    ):
        torch.ops.pagedserve.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reshape_and_cache_index_copy(key, value, key_cache, value_cache, slot_mapping)


def reshape_and_cache_index_copy(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping; -1 slots skipped."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(value_cache.dtype))
