"""The loop both paged attention kernels share: walk one sequence's block table, attend a tile of
query rows to each cache block's keys and accumulate the values with an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_blocks(
    q, q_pos, seq_len, first_blk, end_blk, sliding_window,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, d, d_mask, scale,
    stride_cb, stride_cs, stride_ch,
    ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """q [ROWS, BLOCK_D] at positions q_pos [ROWS] (decode: every row at seq_len - 1) over logical blocks
    [first_blk, end_blk) of the table at table_ptr. A row attends to keys at positions <= its own, below
    seq_len and, with a window, above q_pos - sliding_window.

    Returns the running (max [ROWS], exp-sum [ROWS], unnormalised output [ROWS, BLOCK_D]) in fp32.
    """
    offs = tl.arange(0, BLOCK_SIZE)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for blk in range(first_blk, end_blk):
        phys = tl.load(table_ptr + blk).to(tl.int64)
        kv_off = phys * stride_cb + offs[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        if INTERPRET:
            # Interpreter defect: tl.dot on bf16 returns garbage; the GPU keeps bf16 tensor-core dots.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [ROWS, BLOCK_SIZE]
        k_pos = blk * BLOCK_SIZE + offs
        valid = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
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
