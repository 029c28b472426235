"""Entry points: paged decode attention and varlen prefill attention over the paged KV cache."""

from __future__ import annotations

import torch

from pagedserve.kernels._validate import check_dim, check_kv_cache, check_sliding_window
from pagedserve.kernels.torch_impl.attention import paged_decode_attention_torch, paged_prefill_attention_torch


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_lens_cpu: list[int] | None = None,
) -> torch.Tensor:
    """One query token per sequence (at position seq_len-1) over its blocks.

    On CPU the twin runs the compiled op (kernels/cpu) when it built, else gather + SDPA.

    Returns [num_seqs, num_heads, head_size] in the query dtype.
    """
    check_dim("query", query, 3)
    check_kv_cache(query, key_cache, value_cache)
    check_dim("block_tables", block_tables, 2)
    check_dim("seq_lens", seq_lens, 1)
    check_sliding_window(sliding_window)
    if block_tables.shape[0] != query.shape[0] or seq_lens.shape[0] != query.shape[0]:
        raise ValueError(
            f"block_tables rows {block_tables.shape[0]} / seq_lens length {seq_lens.shape[0]} "
            f"!= query num_seqs {query.shape[0]}"
        )
    if seq_lens_cpu is not None and seq_lens_cpu and max(seq_lens_cpu) > block_tables.shape[1] * key_cache.shape[1]:
        raise ValueError(
            f"seq_lens up to {max(seq_lens_cpu)} tokens need more than block_tables' {block_tables.shape[1]} "
            f"blocks of {key_cache.shape[1]}"
        )
    return paged_decode_attention_unchecked(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, seq_lens_cpu
    )


def paged_decode_attention_unchecked(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_lens_cpu: list[int] | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` without the shape checks (for the attention layer, whose step metadata
    `AttentionMetadata` checks once per step)."""
    if query.is_cuda:
        from pagedserve.kernels.triton.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, seq_lens_cpu
        )
    return paged_decode_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, seq_lens_cpu
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    query_start_loc_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen query batch over each sequence's cached prefix plus its new tokens.

    `key`/`value` optionally repeat the new tokens' K/V ([num_tokens, num_kv_heads, head_size]); the CPU
    path uses them to skip the cache gather for sequences with no cached prefix.

    The new tokens' K/V must already be in the cache. query_start_loc may be a slice of the whole
    batch's offsets (e.g. starting at num_decode_tokens): row 0 of `query` is token query_start_loc[0].
    Returns [num_tokens, num_heads, head_size].
    """
    check_dim("query", query, 3)
    check_kv_cache(query, key_cache, value_cache)
    check_dim("block_tables", block_tables, 2)
    check_dim("query_start_loc", query_start_loc, 1)
    check_dim("seq_lens", seq_lens, 1)
    check_sliding_window(sliding_window)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc length {query_start_loc.shape[0]} must be num_seqs+1 and block_tables rows "
            f"{block_tables.shape[0]} must be num_seqs ({num_seqs})"
        )
    if query_start_loc_cpu is not None and query_start_loc_cpu[-1] - query_start_loc_cpu[0] != query.shape[0]:
        raise ValueError(
            f"query_start_loc spans {query_start_loc_cpu[-1] - query_start_loc_cpu[0]} tokens but query has "
            f"{query.shape[0]}"
        )
    return paged_prefill_attention_unchecked(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, query_start_loc_cpu, seq_lens_cpu, key, value,
    )


def paged_prefill_attention_unchecked(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    query_start_loc_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention` without the shape checks (for the attention layer, like the decode one)."""
    if query.is_cuda:
        from pagedserve.kernels.triton.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window, query_start_loc_cpu, seq_lens_cpu,
        )
    return paged_prefill_attention_torch(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, query_start_loc_cpu, seq_lens_cpu, key, value,
    )
