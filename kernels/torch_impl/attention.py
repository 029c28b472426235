"""Paged attention over the block-table KV cache (the CPU twins).

Decode runs the compiled CPU op (kernels/cpu: K/V rows read in place) when it built; otherwise,
and as its reference, it gathers the blocks of a group of sequences with index_select into a
reused buffer and runs one SDPA per group with a length mask. GQA is handled by
viewing the query heads as [B, Hkv, G, D] so the K/V are never repeated.
Prefill loops over sequences (their query lengths differ) and runs SDPA on each
gathered context with an explicit causal-offset mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.build import cpu_ops_available

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_table [nb] -> [num_tokens, Hkv, D], copied into `out` (flat blocks) if given."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    idx = block_table[:num_blocks].to(torch.int64)
    if out is None:
        gathered = cache.index_select(0, idx)
    else:
        gathered = torch.index_select(cache, 0, idx, out=out[:num_blocks])
    return gathered.view(num_blocks * block_size, *cache.shape[2:])[:num_tokens]


def _key_mask(
    key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask (True = attend): key_pos <= query_pos and, with a window, key_pos > query_pos - window."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


# Gathered K+V bytes per decode group. Long contexts end up one sequence per group, so SDPA reads the
# gathered copy back from cache rather than DRAM, and the buffer reused across groups avoids the page
# faults of a fresh batch-sized allocation (a batch-wide gather measured 2-5x slower on CPU). Short
# sequences are still batched into one SDPA call. See benchmarks/kernels.py.
DECODE_GATHER_BUDGET_BYTES = 2 << 20


def _int32(t: torch.Tensor) -> torch.Tensor:
    # The engine's metadata is int32 already (the common case, checked first: even a no-op .to() dispatches).
    return t if t.dtype == torch.int32 else t.to(torch.int32)


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
    """The CPU decode path: the compiled op where it built and supports the inputs, else gather + SDPA."""
    if (
        query.dtype in _COMPILED_DTYPES
        and query.stride(-1) == 1
        and key_cache.stride(-1) == 1
        and key_cache.stride() == value_cache.stride()
        and cpu_ops_available()
    ):
        return torch.ops.pagedserve.paged_decode_attention(
            query, key_cache, value_cache, _int32(block_tables), _int32(seq_lens), float(scale), sliding_window or 0,
        )
    return paged_decode_attention_gather(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, seq_lens_cpu
    )


def paged_decode_attention_gather(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_lens_cpu: list[int] | None = None,
    gather_budget_bytes: int = DECODE_GATHER_BUDGET_BYTES,
) -> torch.Tensor:
    """Decode attention in groups of consecutive sequences.

    Each group's blocks are gathered with index_select into one reused buffer, viewed as
    [g, Hkv, L, D] (a strided view, no transpose copy) and fed to one SDPA call with the
    query heads grouped as [g, Hkv, G, D]; a length/window mask is added only when needed.
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    # Shortest first: a group's gather and SDPA span its longest member, so grouping sequences of
    # similar length wastes far less work on padding than grouping them in batch order.
    order = sorted(range(num_seqs), key=lens.__getitem__)
    if order == list(range(num_seqs)):
        return _decode_in_groups(query, key_cache, value_cache, block_tables, seq_lens, lens, scale,
                                 sliding_window, gather_budget_bytes)
    perm = torch.tensor(order, device=query.device)
    sorted_out = _decode_in_groups(
        query[perm], key_cache, value_cache, block_tables[perm], seq_lens[perm], [lens[i] for i in order],
        scale, sliding_window, gather_budget_bytes,
    )
    out = torch.empty_like(query)
    out[perm] = sorted_out
    return out


def _decode_in_groups(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lens: list[int],
    scale: float,
    sliding_window: int | None,
    gather_budget_bytes: int,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    q = query.view(num_seqs, num_kv_heads, group, head_size)
    out_grouped = out.view(num_seqs, num_kv_heads, group, head_size)
    bytes_per_block = 2 * block_size * num_kv_heads * head_size * key_cache.element_size()
    budget_blocks = max(1, gather_budget_bytes // bytes_per_block)

    spans: list[tuple[int, int, int, int]] = []  # (first seq, end seq, first block, end block)
    start = 0
    while start < num_seqs:
        end, first_blk, end_blk = start, None, 0
        while end < num_seqs:
            lo = 0 if sliding_window is None else max(0, lens[end] - sliding_window) // block_size
            hi = -(-lens[end] // block_size)
            new_first = lo if first_blk is None else min(first_blk, lo)
            new_end = max(end_blk, hi)
            if end > start and (end + 1 - start) * (new_end - new_first) > budget_blocks:
                break
            first_blk, end_blk, end = new_first, new_end, end + 1
        spans.append((start, end, first_blk, end_blk))
        start = end
    max_group_blocks = max((e - s) * (hb - lb) for s, e, lb, hb in spans)
    k_buf = key_cache.new_empty((max_group_blocks, block_size, num_kv_heads, head_size))
    v_buf = value_cache.new_empty((max_group_blocks, block_size, num_kv_heads, head_size))

    for s, e, lb, hb in spans:
        n = e - s
        idx = block_tables[s:e, lb:hb].reshape(-1).to(torch.int64)
        k = torch.index_select(key_cache, 0, idx, out=k_buf[: idx.numel()])
        v = torch.index_select(value_cache, 0, idx, out=v_buf[: idx.numel()])
        span_len = (hb - lb) * block_size
        k = k.view(n, span_len, num_kv_heads, head_size).transpose(1, 2)
        v = v.view(n, span_len, num_kv_heads, head_size).transpose(1, 2)
        mask = None
        if sliding_window is not None or any(lens[i] != span_len + lb * block_size for i in range(s, e)):
            key_pos = torch.arange(lb * block_size, hb * block_size, device=query.device)
            query_pos = (seq_lens[s:e].to(torch.int64) - 1)[:, None]
            mask = _key_mask(key_pos[None, :], query_pos, sliding_window)[:, None, None, :]
        out_grouped[s:e] = F.scaled_dot_product_attention(q[s:e], k, v, attn_mask=mask, scale=scale)
    return out


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
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """`key`/`value` ([num_tokens, Hkv, D], the rows just written to the cache) are optional: a sequence
    with no cached prefix then attends over them directly with SDPA's causal kernel, skipping the
    gather and the explicit mask (the common whole-prompt prefill)."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    out = torch.empty_like(query)
    if not lens:
        return out
    # One buffer reused by every sequence: no fresh (page-faulting) allocation per sequence.
    max_blocks = -(-max(lens) // key_cache.shape[1])
    k_buf = key_cache.new_empty((max_blocks, *key_cache.shape[1:]))
    v_buf = value_cache.new_empty((max_blocks, *value_cache.shape[1:]))
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i] - starts[0], starts[i + 1] - starts[0]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # [q_len, H, D] -> [Hkv, G, q_len, D] against K/V [Hkv, G, L, D] expanded (stride 0) from
        # [Hkv, 1, L, D]: each KV head serves its G query heads without a copy, and with 4-d inputs of
        # equal head counts SDPA takes its flash kernel (3-d or broadcast heads fall back to the math
        # path, measured 2-3x slower at the small model's shapes).
        q = query[q_start:q_end].view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        grouped = (num_kv_heads, group, seq_len, head_size)
        if key is not None and seq_len == q_len and (sliding_window is None or seq_len <= sliding_window):
            k = key[q_start:q_end].transpose(0, 1).unsqueeze(1).expand(grouped)
            v = value[q_start:q_end].transpose(0, 1).unsqueeze(1).expand(grouped)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # [Hkv, G, L, D]
        else:
            k = _gather_context(key_cache, block_tables[i], seq_len, k_buf).transpose(0, 1).unsqueeze(1)
            v = _gather_context(value_cache, block_tables[i], seq_len, v_buf).transpose(0, 1).unsqueeze(1)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            mask = _key_mask(key_pos[None, :], query_pos[:, None], sliding_window)  # [q_len, L]
            o = F.scaled_dot_product_attention(q, k.expand(grouped), v.expand(grouped), attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return out
