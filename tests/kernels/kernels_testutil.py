"""Shared helpers for the kernels tests: random paged batches and naive dense references."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], shuffled physical blocks, padded with 0
    seq_lens: list[int]


def make_paged_batch(
    seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype, seed: int = 0
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    cursor = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor(perm[cursor:cursor + nb], dtype=torch.int32)
        cursor += nb
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    return PagedBatch(key_cache, value_cache, tables, list(seq_lens))


def dense_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Token-by-token gather of one sequence's context: [seq_len, Hkv, D] in fp64."""
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows).double()


def naive_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: list[int], scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [q, H, D], k/v [L, Hkv, D] dense fp64; each query row attends to keys at positions <= its own."""
    num_heads, num_kv_heads = query.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for j, pos in enumerate(query_positions):
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        for h in range(num_heads):
            kh, vh = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
            scores = (kh @ query[j, h].double()) * scale
            out[j, h] = torch.softmax(scores, dim=0) @ vh
    return out


def naive_paged_attention(
    query: torch.Tensor, batch: PagedBatch, query_start_loc: list[int], scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense reference for decode (q_len 1) and prefill alike: [num_tokens, H, D] fp64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(batch.seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        k = dense_context(batch.key_cache, batch.block_tables[i], seq_len)
        v = dense_context(batch.value_cache, batch.block_tables[i], seq_len)
        positions = list(range(seq_len - (end - start), seq_len))
        out[start:end] = naive_attention(query[start:end], k, v, positions, scale, sliding_window)
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 5e-3, "rtol": 5e-3}
    return {"atol": 3e-2, "rtol": 3e-2}  # bfloat16


def k_quant_blocks(qtype: str, rows: int, cols: int, rng):
    """Random GGUF K-quant super-blocks (the `gguf` package cannot quantize them) as uint8 [rows, bytes]:
    float16 d (and dmin) are set to small positive numbers, so every other byte (scales, mins, codes) is a
    valid value whatever it is (rng: a numpy Generator)."""
    import numpy as np

    from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES

    _, nbytes, elements = GGUF_QUANT_TYPES[qtype]
    raw = rng.integers(0, 256, (rows, cols // elements, nbytes), dtype=np.uint8)
    scale = 2e-5 if qtype == "Q6_K" else 2e-4
    for offset in ([208] if qtype == "Q6_K" else [0, 2]):
        d = (rng.random((rows, cols // elements, 1)) * scale + scale / 4).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)
