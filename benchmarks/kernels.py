"""CPU cost of paging: paged decode attention vs dense SDPA over the same KV stored contiguously.

Batch 32, context 1k, 32 query heads / 8 KV heads, head 128, block size 16, shuffled
physical blocks. Prints the median time of each and the ratio paged / dense, for fp32 and bf16.
"paged" is the entry point the engine calls (the compiled CPU op, kernels/cpu); the pure-torch
path (gather + SDPA, the fallback where the op cannot build) is timed too. The dense baseline is
SDPA with the query heads grouped per KV head ([B, Hkv, G, D]). Both caches sit on huge-page memory, as the engine's does
(kernels.cpu.empty_hugepage_tensor), so the ratio is the cost of paging alone.

    python benchmarks/kernels.py [--batch 32] [--context 1024] [--iters 10] [--threads N]

Timings are interleaved (paged, dense, paged, ...) and medians reported, since the
machine may be shared.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.kernels import paged_decode_attention
from pagedserve.kernels.cpu import cpu_ops_available, empty_hugepage_tensor
from pagedserve.kernels.torch_impl.attention import paged_decode_attention_gather


def interleaved_medians(fns: list[Callable[[], object]], iters: int, warmup: int = 2) -> list[float]:
    """Median seconds of each fn, run round-robin so load from other processes hits them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, acc in zip(fns, times):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def run(dtype: torch.dtype, args: argparse.Namespace) -> list[float]:
    batch, context, num_heads, num_kv_heads = args.batch, args.context, args.num_heads, args.num_kv_heads
    head_size, block_size = args.head_size, args.block_size
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = empty_hugepage_tensor(shape, dtype).copy_(torch.randn(shape, generator=gen))
    value_cache = empty_hugepage_tensor(shape, dtype).copy_(torch.randn(shape, generator=gen))
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    seq_lens_cpu = seq_lens.tolist()
    query = torch.randn(batch, num_heads, head_size, generator=gen).to(dtype)
    scale = head_size ** -0.5
    group = num_heads // num_kv_heads

    def dense_layout(cache: torch.Tensor) -> torch.Tensor:
        ctx = cache[block_tables.long()].reshape(batch, -1, num_kv_heads, head_size)[:, :context]
        ctx = ctx.transpose(1, 2)  # [B, Hkv, L, D], as a dense engine would keep it
        return empty_hugepage_tensor(tuple(ctx.shape), dtype).copy_(ctx)

    dense_k, dense_v = dense_layout(key_cache), dense_layout(value_cache)
    # Query heads grouped per KV head: the fastest dense form on CPU (enable_gqa=True is much slower in bf16).
    dense_q = query.view(batch, num_kv_heads, group, head_size)

    def paged() -> torch.Tensor:
        return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                      seq_lens_cpu=seq_lens_cpu)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, scale=scale)

    def gather() -> torch.Tensor:
        return paged_decode_attention_gather(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                             seq_lens_cpu=seq_lens_cpu)

    with torch.inference_mode():
        expected = dense().reshape(query.shape).float()
        torch.testing.assert_close(paged().float(), expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gather().float(), expected, atol=2e-2, rtol=2e-2)
        return interleaved_medians([paged, dense, gather], args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"paged decode attention vs dense SDPA: batch {args.batch}, context {args.context}, "
          f"heads {args.num_heads}/{args.num_kv_heads}, head {args.head_size}, block {args.block_size}, "
          f"torch threads {torch.get_num_threads()}, compiled CPU op: {'yes' if cpu_ops_available() else 'NO'}")
    for dtype in (torch.float32, torch.bfloat16):
        paged_s, dense_s, gather_s = run(dtype, args)
        print(f"{str(dtype):15s} paged {paged_s * 1e3:7.2f} ms | dense SDPA {dense_s * 1e3:7.2f} ms "
              f"| paged/dense {paged_s / dense_s:5.2f}x | gather+SDPA {gather_s * 1e3:7.2f} ms "
              f"({gather_s / dense_s:5.2f}x)")


if __name__ == "__main__":
    main()
