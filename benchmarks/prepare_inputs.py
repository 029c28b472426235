"""Micro-benchmark: host time of the model runner's per-step input building for decode-only batches.

    .venv/bin/python benchmarks/prepare_inputs.py --batch-sizes 64 256 --context 500 --steps 200

Runs the runner's own state update, step plan and input preparation (no model, no forward pass) on
a stream of decode steps shaped like the scheduler's output: every request gets one new token per
step and a new block every `block_size` steps. Prints the mean and p50/p90 per step of the input
batch's `prepare` alone and of the whole input path (`RequestStates.update` + `order_step` +
`InputBatch.prepare`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker.model_runner import ModelRunner
from pagedserve.engine.worker.step_plan import order_step
from pagedserve.parallel.state import ParallelContext


def _runner(model_dir: Path, batch: int, max_model_len: int) -> ModelRunner:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_model_len).save_pretrained(model_dir)
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=max_model_len, max_num_seqs=batch,
                          num_kv_blocks=batch * (max_model_len // 16 + 1)).resolve()
    return ModelRunner(config, ParallelContext.single(), torch.device("cpu"))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(batch: int, context: int, steps: int, block_size: int = 16) -> dict[str, float]:
    max_model_len = context + steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        runner = _runner(Path(tmp), batch, max_model_len)
    next_block = 0
    blocks: dict[str, list[int]] = {}
    new = []
    for i in range(batch):
        rid = f"r{i}"
        n_blocks = -(-(context + 1) // block_size)
        blocks[rid] = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        new.append(NewRequestData(
            req_id=rid, prompt_token_ids=[(i * 7 + j) % 32000 for j in range(context)], output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=steps + 10), block_ids=blocks[rid],
            num_computed_tokens=context - 1, eos_token_ids=set(), bad_words_token_ids=[],
        ))
    so = SchedulerOutput(new, [], {f"r{i}": 1 for i in range(batch)}, batch)
    prepare_s, total_s = [], []
    for step in range(steps + 5):
        t0 = time.perf_counter()
        runner.states.update(so, None)
        plan = order_step(so, runner.input_batch, {})
        t1 = time.perf_counter()
        runner.input_batch.prepare(plan.req_ids, plan.query_lens_np, plan.drafts, rows=plan.rows)
        t2 = time.perf_counter()
        if step >= 5:  # warm-up steps
            prepare_s.append(t2 - t1)
            total_s.append(t2 - t0)
        # What the forward pass + scheduler would do: the token computed, one sampled token, a block at a boundary.
        num_computed = context + step
        cached = []
        for i in range(batch):
            rid = f"r{i}"
            new_blocks = []
            if (num_computed + 1) % block_size == 0 or -(-(num_computed + 1) // block_size) > len(blocks[rid]):
                new_blocks = [next_block]
                blocks[rid].append(next_block)
                next_block += 1
            cached.append(CachedRequestData(rid, [(step + i) % 32000], new_blocks, num_computed))
        so = SchedulerOutput([], cached, {f"r{i}": 1 for i in range(batch)}, batch)
    return {
        "batch": batch,
        "prepare_inputs_mean_us": statistics.fmean(prepare_s) * 1e6,
        "prepare_inputs_p50_us": _percentile(prepare_s, 0.5) * 1e6,
        "prepare_inputs_p90_us": _percentile(prepare_s, 0.9) * 1e6,
        "input_path_mean_us": statistics.fmean(total_s) * 1e6,
        "input_path_p50_us": _percentile(total_s, 0.5) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch in args.batch_sizes:
        print(json.dumps({k: round(v, 1) for k, v in run(batch, args.context, args.steps).items()}))


if __name__ == "__main__":
    main()
