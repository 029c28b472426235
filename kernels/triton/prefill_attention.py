"""Triton varlen prefill attention over the paged KV cache.

Grid (num_seqs, query tiles, num_kv_heads): a program takes BLOCK_M query tokens of one
sequence together with the G query heads that share one KV head (GQA), as one tile of
BLOCK_M * BLOCK_G query rows (row r = token r // BLOCK_G, head r % BLOCK_G), so each K/V
tile is loaded once per KV head rather than once per query head. It walks that sequence's
block table up to its last query position (causal), from the first block inside the
sliding window if there is one, TILE_BLOCKS cache blocks (>= 64 tokens) per iteration with
an online softmax (kernels.triton.paged_blocks). Query token j of a sequence with q_len new
tokens and seq_len context sits at position seq_len - q_len + j, so cached prefixes
(chunked prefill, prefix-cache hits) need nothing special.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._utils import dot_precision, interpreting
from pagedserve.kernels.triton.paged_blocks import attend_paged_blocks, tile_blocks


# Per-step arguments (see decode_attention): the block table's width, and the tables sliced past
# the decode rows, whose pointer alignment changes with the number of decodes.
PREFILL_PER_STEP_ARGS = ["stride_bt"]
PREFILL_PER_STEP_POINTERS = ["block_tables_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=PREFILL_PER_STEP_ARGS, do_not_specialize_on_alignment=PREFILL_PER_STEP_POINTERS)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale, sliding_window, group, head_size,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    m_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_start -= tl.load(query_start_loc_ptr)  # offsets are relative to the first prefill token
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        offs_m = m_block * BLOCK_M + r // BLOCK_G  # the row's query token
        g = r % BLOCK_G  # the row's query head within the group
        heads = kv_head * group + g
        row_mask = (offs_m < q_len) & (g < group)
        q_pos = prefix + offs_m
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_size
        tokens = (q_start + offs_m)[:, None].to(tl.int64)
        io_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + tokens * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)  # interpreter defect: tl.dot on bf16 returns garbage; GPU keeps bf16 dots

        last_pos = tl.minimum(prefix + (m_block + 1) * BLOCK_M, seq_len)  # exclusive
        end_blk = tl.cdiv(last_pos, BLOCK_SIZE)
        first_blk = 0
        if HAS_WINDOW:
            first_blk = tl.maximum(prefix + m_block * BLOCK_M - sliding_window + 1, 0) // BLOCK_SIZE

        m, l, acc = attend_paged_blocks(
            q, q_pos, seq_len, first_blk, end_blk, sliding_window,
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, d, d_mask, scale,
            stride_cb, stride_cs, stride_ch,
            BLOCK_M * BLOCK_G, BLOCK_SIZE, TILE_BLOCKS, BLOCK_D, HAS_WINDOW, INTERPRET, DOT_PRECISION,
        )
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + tokens * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention_triton(
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
    block_m: int | None = None,
) -> torch.Tensor:
    """block_m: query tokens per program (a power of two); by default 64 query rows (tokens x grouped heads)."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride() != key_cache.stride():
        raise ValueError("query/key_cache must have a contiguous last dim and value_cache the strides of key_cache")
    if query_start_loc_cpu is not None:
        max_query_len = max(b - a for a, b in zip(query_start_loc_cpu[:-1], query_start_loc_cpu[1:]))
    else:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(1, 64 // block_g)
    if block_m & (block_m - 1) or block_m * block_g < 16:  # tl.dot needs M >= 16 on GPU
        raise ValueError(f"block_m {block_m} must be a power of two with block_m * {block_g} grouped heads >= 16")
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), num_kv_heads)](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale, sliding_window or 0, group, head_size,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_SIZE=block_size, TILE_BLOCKS=tile_blocks(block_size),
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        HAS_WINDOW=sliding_window is not None, INTERPRET=interpreting(), DOT_PRECISION=dot_precision(query.dtype),
    )
    return out
