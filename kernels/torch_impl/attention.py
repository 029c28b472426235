"""Paged attention over the block-table KV cache (torch twins).

Decode gathers every sequence's blocks with one index_select into a padded
[B, L, Hkv, D] tensor and runs one batched matmul-softmax-matmul with a length
mask. GQA is handled by viewing the query heads as [B, Hkv, G, D] so the K/V
are never repeated. Prefill loops over sequences (their query lengths differ)
and runs SDPA on each gathered context with an explicit causal-offset mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_table [..., nb] -> [..., num_tokens, Hkv, D] (contiguous copy)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_table[..., :num_blocks]
    gathered = cache.index_select(0, table.reshape(-1).to(torch.int64))
    gathered = gathered.view(*table.shape[:-1], num_blocks * block_size, *cache.shape[2:])
    return gathered[..., :num_tokens, :, :]


def _key_mask(
    key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask (True = attend): key_pos <= query_pos and, with a window, key_pos > query_pos - window."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_lens_cpu: list[int] | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return query.new_empty(query.shape)
    max_len = max(seq_lens_cpu) if seq_lens_cpu is not None else int(seq_lens.max())
    lo = 0
    if sliding_window is not None and seq_lens_cpu is not None:
        # Blocks entirely before every sequence's window are never read.
        lo = max(0, min(seq_lens_cpu) - sliding_window) // key_cache.shape[1] * key_cache.shape[1]
    table = block_tables[:, lo // key_cache.shape[1]:]
    k = _gather_context(key_cache, table, max_len - lo)  # [B, L, Hkv, D]
    v = _gather_context(value_cache, table, max_len - lo)
    q = query.view(num_seqs, num_kv_heads, group, head_size)
    # scores [B, Hkv, G, L]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale
    key_pos = torch.arange(lo, max_len, device=query.device)
    mask = _key_mask(key_pos[None, :], (seq_lens.to(torch.int64) - 1)[:, None], sliding_window)
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_size).to(query.dtype)


def paged_prefill_attention_torch(
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
) -> torch.Tensor:
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(key_cache, block_tables[i], seq_len).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_context(value_cache, block_tables[i], seq_len).transpose(0, 1)
        # [q_len, H, D] -> [Hkv, G*q_len, D]: each KV head serves its G query heads without repeating K/V.
        q = query[q_start:q_end].view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * q_len, head_size)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = _key_mask(torch.arange(seq_len, device=query.device)[None, :], query_pos[:, None], sliding_window)
        mask = mask.repeat(group, 1)  # [G*q_len, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_size)
    return out
