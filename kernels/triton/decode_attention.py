"""Triton paged decode attention with split-K.

Grid (num_seqs, num_kv_heads, num_partitions): a program takes one KV head with all the
query heads that share it (GQA: one [G, D] query tile, so each K/V tile is loaded once
per group) over one partition of the context, walking the block table TILE_BLOCKS cache
blocks (>= 64 tokens) per iteration with an online softmax (kernels.triton.paged_blocks).
With more than one partition, each writes its (max, sum, acc) and a reduction kernel
merges the partitions that hold keys; with one, the result is stored directly.

Graph-safe contract (CUDA graphs capture decode steps, engine/worker/cuda_graphs.py): the
grids, every constexpr and every host-side branch depend only on num_seqs, the head counts,
head_size, block_size, partition_size and block_tables' width (shape[1]). Context lengths
are read from seq_lens on the device, inside the kernels: they set each program's loop
bounds and which partitions the reduction reads. A captured launch therefore replays
correctly with new seq_lens / block_tables contents of the same shapes. seq_lens_cpu is
accepted for the entry point's checks but never used here (no max_seq_len on the host
decides the grid or a loop count); a partition past a sequence's end runs no iteration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._utils import dot_precision, interpreting
from pagedserve.kernels.triton.paged_blocks import attend_paged_blocks, tile_blocks

DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition (a multiple of the block size)


# Integer arguments that change from step to step (context length, block-table width): Triton
# specialises ints on their value (== 1, divisible by 16), which would compile new variants
# in the middle of serving.
DECODE_PER_STEP_ARGS = ["num_partitions", "stride_bt"]
REDUCE_PER_STEP_ARGS = ["num_partitions"]


@triton.jit(do_not_specialize=DECODE_PER_STEP_ARGS)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, sliding_window, group, head_size, num_partitions,
    stride_qs, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_os, stride_oh,
    BLOCK_SIZE: tl.constexpr, TILE_BLOCKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTITION_BLOCKS: tl.constexpr, USE_PARTITIONS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_blk = part * PARTITION_BLOCKS
    end_blk = tl.minimum(first_blk + PARTITION_BLOCKS, tl.cdiv(seq_len, BLOCK_SIZE))
    if HAS_WINDOW:
        first_blk = tl.maximum(first_blk, tl.maximum(seq_len - sliding_window, 0) // BLOCK_SIZE)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_size
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)  # interpreter defect: tl.dot on bf16 returns garbage; GPU keeps bf16 dots

    q_pos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)  # the one new token of every grouped head
    m, l, acc = attend_paged_blocks(
        q, q_pos, seq_len, first_blk, end_blk, sliding_window,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, d, d_mask, scale,
        stride_cb, stride_cs, stride_ch,
        BLOCK_G, BLOCK_SIZE, TILE_BLOCKS, BLOCK_D, HAS_WINDOW, INTERPRET, DOT_PRECISION,
    )

    if USE_PARTITIONS:
        part_idx = (seq * tl.num_programs(1) * BLOCK_G + kv_head * BLOCK_G + g) * num_partitions + part
        tl.store(part_m_ptr + part_idx, m, mask=g_mask)
        tl.store(part_l_ptr + part_idx, l, mask=g_mask)
        tl.store(part_acc_ptr + part_idx[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=REDUCE_PER_STEP_ARGS)
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, seq_lens_ptr,
    group, head_size, num_partitions, stride_os, stride_oh,
    PARTITION_TOKENS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # query head
    kv_head = head // group
    row = (seq * (tl.num_programs(1) // group) + kv_head) * BLOCK_G + head % group  # the split kernel's row
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    # Only the partitions that hold keys (read from seq_lens on the device; later ones are empty).
    p_mask = p < tl.minimum(num_partitions, tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION_TOKENS))
    m = tl.load(part_m_ptr + row * num_partitions + p, mask=p_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row * num_partitions + p, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l * w, axis=0)
    acc = tl.load(part_acc_ptr + (row * num_partitions + p)[:, None] * BLOCK_D + d[None, :],
                  mask=p_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_size)


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_lens_cpu: list[int] | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride() != key_cache.stride():
        raise ValueError("query/key_cache must have a contiguous last dim and value_cache the strides of key_cache")
    if partition_size % block_size:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_size {block_size}")
    partition_blocks = partition_size // block_size
    # Graph-safe: the block table's width bounds every context (no device sync, no host lengths).
    num_partitions = max(1, triton.cdiv(block_tables.shape[1], partition_blocks))
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16 on GPU
    block_d = max(16, triton.next_power_of_2(head_size))
    use_partitions = num_partitions > 1
    if use_partitions:
        rows = num_seqs * num_kv_heads * block_g
        part_m = torch.empty(rows, num_partitions, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows, num_partitions, block_d, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale, sliding_window or 0, group, head_size, num_partitions,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, TILE_BLOCKS=tile_blocks(block_size), BLOCK_G=block_g, BLOCK_D=block_d,
        PARTITION_BLOCKS=partition_blocks, USE_PARTITIONS=use_partitions,
        HAS_WINDOW=sliding_window is not None, INTERPRET=interpreting(), DOT_PRECISION=dot_precision(query.dtype),
    )
    if use_partitions:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, seq_lens, group, head_size, num_partitions, out.stride(0),
            out.stride(1), PARTITION_TOKENS=partition_size, BLOCK_G=block_g, BLOCK_D=block_d,
            BLOCK_P=triton.next_power_of_2(num_partitions),
        )
    return out
