"""Decode steps through the fused CPU op (kernels/cpu/decode_layers.cpp) against the layer-by-layer path,
on the default model (or --model), in one process: the same engine generates the same greedy requests
with the op on and off (`model.fused_decode`, what `enforce_eager` sets), interleaved, and the figures are
the medians of each. Thread CPU time is printed beside wall time: on a shared machine it is the steadier
of the two at one torch thread (`--threads 1`).

    python benchmarks/fused_decode.py [--model PATH] [--batches 1,64] [--output-len 64] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.models.default_model import resolve_default_model


def generate_seconds(llm: LLM, batch: int, output_len: int) -> tuple[float, float]:
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 20000 for j in range(32)]} for i in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.thread_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the bundled default model)")
    parser.add_argument("--batches", default="1,64", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model or resolve_default_model(), kv_cache_memory="1GiB", max_num_seqs=max(batches),
              cpu_threads=args.threads)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, dtype {model.dtype}")
    for batch in batches:
        generate_seconds(llm, batch, 4)  # warm-up
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for fused in (True, False):
                model.fused_decode = fused
                runs[fused].append(generate_seconds(llm, batch, args.output_len))
        model.fused_decode = True
        tokens = batch * args.output_len
        (fused_wall, fused_cpu), (layer_wall, layer_cpu) = (
            (statistics.median(w for w, _ in runs[f]), statistics.median(c for _, c in runs[f])) for f in (True, False)
        )
        print(f"batch {batch:3d}: fused {tokens / fused_wall:7.1f} tok/s ({fused_cpu:.2f} s thread CPU), "
              f"layer by layer {tokens / layer_wall:7.1f} tok/s ({layer_cpu:.2f} s): "
              f"{layer_wall / fused_wall:.2f}x wall, {layer_cpu / fused_cpu:.2f}x thread CPU")
    llm.shutdown()


if __name__ == "__main__":
    main()
