"""Microseconds per call of the compiled CPU decode ops on the default model's shapes (SmolLM2-135M).

paged_decode_attention over a grid of batch sizes and context lengths (9 query heads, 3 KV heads, head
size 64, block size 16, shuffled physical blocks), at 1 and 2 torch threads; with `--layers N` the calls
cycle through N separate caches, as a decode step reads each layer's in turn: one cache read call after call
stays in L2/L3, which flatters a kernel that streams memory badly (a change measured 1.5x faster on one
reused cache was slower in the engine), and cells whose N caches would exceed `--max-cache-gib` print "-".
Then silu_and_mul,
fused_add_rms_norm and rotary_embedding at the model's widths (576 hidden, 1536 intermediate).
Each figure is the fastest of several timed loops (the least disturbed by other processes on a shared
machine); the load average is printed with the results.

    python benchmarks/cpu_decode_ops.py [--dtype bfloat16] [--batches 1,4,16,64] [--contexts 16,100,300,1000,4096]
                                        [--threads 1,2] [--cpu-time] [--layers 30] [--max-cache-gib 4]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from collections.abc import Callable

import torch

from pagedserve.kernels.cpu import cpu_ops_available


def per_call_us(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter,
                min_seconds: float = 0.02, repeats: int = 5) -> float:
    """The fastest of `repeats` timed loops of about min_seconds each, in microseconds per call: on a
    shared machine the minimum is the figure least disturbed by other processes."""
    fn()
    start, calls = clock(), 0
    while clock() - start < min_seconds / 4:
        fn()
        calls += 1
    loop = max(1, 4 * calls)
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(loop):
            fn()
        samples.append((clock() - start) / loop * 1e6)
    return min(samples)


def cache_shape(batch: int, context: int, args: argparse.Namespace) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache for a grid cell: [blocks, block_size, kv_heads, head_size]."""
    return (batch * -(-context // args.block_size), args.block_size, args.num_kv_heads, args.head_size)


def cache_bytes(batch: int, context: int, dtype: torch.dtype, args: argparse.Namespace) -> int:
    """The K and V caches of all `--layers` for one grid cell."""
    return 2 * args.layers * math.prod(cache_shape(batch, context, args)) * torch.empty((), dtype=dtype).element_size()


def attention_call(batch: int, context: int, dtype: torch.dtype, args: argparse.Namespace) -> Callable[[], object]:
    """One call of the op per invocation, on the next of `args.layers` caches in turn."""
    gen = torch.Generator().manual_seed(batch * 10_000 + context)
    shape = cache_shape(batch, context, args)
    num_blocks, blocks_per_seq = shape[0], shape[0] // batch
    caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(args.layers)]
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, args.num_heads, args.head_size, generator=gen).to(dtype)
    scale = args.head_size ** -0.5
    op = torch.ops.pagedserve.paged_decode_attention
    layer = itertools.cycle(caches)

    def call() -> object:
        key_cache, value_cache = next(layer)
        return op(query, key_cache, value_cache, tables, lens, scale, 0)

    return call


def elementwise_calls(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2 * 1536, generator=gen).to(dtype)
    h, r = torch.randn(1, 576, generator=gen).to(dtype), torch.randn(1, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    qkv = torch.randn(1, 15 * 64, generator=gen).to(dtype)
    q, k = qkv[:, :9 * 64], qkv[:, 9 * 64:12 * 64]
    positions = torch.tensor([100])
    from pagedserve import kernels

    cache = kernels.compute_rope_cos_sin_cache(64, 2048, 100000.0, None, torch.float32)
    ops = torch.ops.pagedserve
    return {
        "silu_and_mul [1, 3072]": lambda: ops.silu_and_mul(x),
        "fused_add_rms_norm [1, 576]": lambda: ops.fused_add_rms_norm(h, r, w, 1e-5),
        "rotary_embedding 9+3 heads x 64": lambda: ops.rotary_embedding(positions, q, k, cache, 64, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--contexts", default="16,32,100,300,500,1000,4096")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1,
                        help="separate K/V caches the calls cycle through (a decode step reads 30 on the default model)")
    parser.add_argument("--max-cache-gib", type=float, default=4.0,
                        help="skip grid cells whose caches (all --layers) would take more memory than this")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this process's CPU time instead of the wall clock: on a machine shared "
                             "with other work it leaves out the time they hold the core (use with --threads 1)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers: at least 1")
    clock = time.process_time if args.cpu_time else time.perf_counter
    assert cpu_ops_available(), "the compiled CPU ops did not load"
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{args.dtype}, heads {args.num_heads}/{args.num_kv_heads}, head {args.head_size}, "
          f"block {args.block_size}, {args.layers} cache(s) cycled, {'CPU' if args.cpu_time else 'wall'} time; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    saved = torch.get_num_threads()
    with torch.inference_mode():
        for n in threads:
            torch.set_num_threads(n)
            print(f"paged_decode_attention, us per call, {n} thread(s); rows: batch, columns: context")
            print("batch " + "".join(f"{c:>9d}" for c in contexts))
            for b in batches:
                cells = [f"{per_call_us(attention_call(b, c, dtype, args), clock):9.1f}"
                         if cache_bytes(b, c, dtype, args) <= args.max_cache_gib * 2**30 else f"{'-':>9s}"
                         for c in contexts]
                print(f"{b:5d} " + "".join(cells))
        torch.set_num_threads(1)
        for name, fn in elementwise_calls(dtype).items():
            print(f"{name:34s} {per_call_us(fn, clock):7.2f} us (1 thread)")
    torch.set_num_threads(saved)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
