"""The loop both paged attention kernels share: walk one sequence's block table a tile of several
cache blocks at a time, attend a tile of query rows to the tile's keys and accumulate the values with
an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_blocks(
    q, q_pos, seq_len, first_blk, end_blk, sliding_window,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, d, d_mask, scale,
    stride_cb, stride_cs, stride_ch,
    ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """q [ROWS, BLOCK_D] at positions q_pos [ROWS] over logical blocks [first_blk, end_blk) of the table
    at table_ptr, TILE_BLOCKS blocks (TILE_BLOCKS * BLOCK_SIZE keys) per iteration. A row attends to keys
    at positions <= its own, below seq_len and, with a window, above q_pos - sliding_window.

    Each iteration loads the tile's block-table entries as one vector (one entry per key slot, so the
    K/V gather of the whole tile is a single 2-D load) instead of one dependent scalar load per block.
    The loop bounds come from device values (seq_len, the block range), never from the host.

    Returns the running (max [ROWS], exp-sum [ROWS], unnormalised output [ROWS, BLOCK_D]) in fp32.
    """
    offs = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)
    end_pos = tl.minimum(end_blk * BLOCK_SIZE, seq_len)  # keys of this range sit below end_pos
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start_blk in range(first_blk, end_blk, TILE_BLOCKS):
        k_pos = start_blk * BLOCK_SIZE + offs
        in_range = k_pos < end_pos
        phys = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        kv_off = (phys[:, None] * stride_cb + (k_pos % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch
                  + d[None, :])
        kv_mask = in_range[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # stale rows never reach the dot
        if INTERPRET:
            # Interpreter defect: tl.dot on bf16 returns garbage; the GPU keeps bf16 tensor-core dots.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [ROWS, TILE]
        valid = in_range[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


def tile_blocks(block_size: int, min_tile_tokens: int = 64) -> int:
    """Cache blocks per iteration: enough for >= min_tile_tokens keys (block sizes are powers of two)."""
    return max(1, min_tile_tokens // block_size)
