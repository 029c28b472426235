"""Microseconds per call of the GGUF weight-only matmul (`kernels.gguf_linear`) against the same matmul on
the weight dequantized once (`x @ W.T` in x's dtype), on the default model's linear shapes (SmolLM2-135M:
hidden 576, MLP 1536, fused q/k/v 960 rows, fused gate/up 3072, vocabulary 49152).

On CUDA the quantized call is the Triton dequant-GEMM and the figure is the GPU's time per call (CUDA
graph replays between CUDA events: no launch overhead, as in the engine's decode steps); on CPU it is
the compiled CPU op (or the torch twin) and the figure is the fastest of several timed loops. Q8_0 and
Q4_1 weights are quantized from random floats (`quantize_gguf`); the other types are random blocks
(their values do not change the work). "GB/s" is the quantized weight's bytes over the quantized call's
time: what decode at small batches is bound by. Repeated calls on one weight find it in the GPU's L2
cache when it fits (50 MB on an H100), which favours the dense call more than in a model's forward.

    python benchmarks/gguf_linear.py [--device cuda] [--dtype bfloat16] [--qtypes Q4_1,Q8_0,Q4_K,Q6_K]
                                     [--batches 1,16,64,256] [--shapes qkv,o,gate_up,down,lm_head]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from cpu_decode_ops import per_call_us as cpu_per_call_us  # a sibling script (benchmarks/ is on sys.path)

from pagedserve.kernels.quantized import gguf_linear
from pagedserve.kernels.torch_impl.gguf_quant import (
    GGUF_QUANT_TYPES,
    RTN_TYPES,
    dequantize_gguf,
    quantize_gguf,
    row_bytes,
)

# (rows N, input features K) of the default model's linears.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call_us(fn: Callable[[], object], device: torch.device) -> float:
    """Microseconds per call. On a GPU: the device's time alone (a CUDA graph of 20 calls, replayed
    between CUDA events, as the engine's decode steps replay theirs); on CPU: the fastest of 5 loops."""
    if device.type != "cuda":
        return cpu_per_call_us(fn, min_seconds=0.05)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph, calls, replays = torch.cuda.CUDAGraph(), 20, 10
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--qtypes", default="Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    qtypes = args.qtypes.split(",")
    for qtype in qtypes:
        if qtype not in GGUF_QUANT_TYPES:
            parser.error(f"--qtypes: {qtype!r} is not one of {', '.join(GGUF_QUANT_TYPES)}")
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: {shape!r} is not one of {', '.join(SHAPES)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    print(f"device {device} ({name}), activations {args.dtype}, torch {torch.__version__}")
    print(f"{'shape':>8} {'N x K':>12} {'qtype':>5} {'M':>4} {'quant us':>9} {'dense us':>9} {'q/dense':>7} {'GB/s':>7}")
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k, generator=gen) * 0.05
        for qtype in qtypes:
            if k % GGUF_QUANT_TYPES[qtype][2]:
                continue  # a K-quant super-block (256) does not divide this width
            if qtype in RTN_TYPES:
                raw = quantize_gguf(w, qtype)
            else:
                raw = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=gen)
            raw = raw.to(device)
            dense = dequantize_gguf(raw, qtype, dtype)
            for m in (int(b) for b in args.batches.split(",")):
                x = torch.randn(m, k, generator=gen).to(device, dtype)
                quant_us = per_call_us(lambda: gguf_linear(x, raw, qtype, k), device)
                dense_us = per_call_us(lambda: x @ dense.t(), device)
                gbs = raw.numel() / quant_us / 1e3
                print(f"{shape:>8} {f'{n}x{k}':>12} {qtype:>5} {m:>4} {quant_us:>9.1f} {dense_us:>9.1f} "
                      f"{quant_us / dense_us:>7.2f} {gbs:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
