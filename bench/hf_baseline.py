"""The HF transformers baseline of `bench throughput --baseline hf`: `generate` with static batching
(vLLM's HF baseline), on the same weights, dtype and workload, in the same process, at its best batch size.

The model runs one short warm-up `generate` first, so that no batch size pays the first call's set-up.
Then every candidate batch size is measured: on the whole workload when it holds no more requests than
the calibration sample (the fastest run is the baseline, nothing is run again), else on the sample, and
the fastest one runs the whole workload.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from pagedserve.bench.workload import BenchRequest


def load_hf_model(path: str, dtype: Any):
    """The HF model for a safetensors folder or a GGUF file (transformers dequantizes it, as we do)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.models.gguf_loader import find_gguf_file

    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@dataclass(frozen=True)
class HFBaseline:
    """HF `generate` over the whole workload at its best batch size."""

    seconds: float
    batch_size: int
    steps: int  # forward passes over the workload (each batch: as many as its longest output)
    rates: dict[int, float]  # output tok/s of every batch size measured
    swept_whole_workload: bool  # the rates are whole-workload runs (else: on the calibration sample)


def forward_passes(workload: list[BenchRequest], batch_size: int) -> int:
    """The forward passes `run_hf` makes: each batch generates its longest output length."""
    return sum(max(r.output_len for r in workload[i : i + batch_size]) for i in range(0, len(workload), batch_size))


def batch_sizes_to_measure(candidates: list[int], num_requests: int) -> list[int]:
    """The candidates as they batch `num_requests` requests: sizes above it all mean one batch of them all."""
    return sorted({min(bs, num_requests) for bs in candidates})


def warm_up(model: Any, request: BenchRequest, pad_id: int = 0) -> None:
    """One short `generate`, so that the first measured batch size does not pay the first call's set-up."""
    run_hf(model, [BenchRequest(request.prompt_token_ids, 2)], 1, pad_id, desc="")


def run_hf(model: Any, workload: list[BenchRequest], batch_size: int, pad_id: int = 0,
           desc: str | None = None) -> float:
    """Seconds for HF `generate` over `workload` in left-padded batches in arrival order, each batch
    generating its longest output length (only the requested tokens count as output)."""
    import torch

    start = time.perf_counter()
    for i in tqdm(range(0, len(workload), batch_size), desc=desc or f"HF generate (batch {batch_size})",
                  leave=False, disable=desc == ""):
        batch = workload[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                           min_new_tokens=max_new, pad_token_id=pad_id)
    return time.perf_counter() - start


def best_batch_size(model: Any, workload: list[BenchRequest], candidates: list[int], sample: int,
                    pad_id: int = 0) -> tuple[int, dict[int, float]]:
    """HF's best static batch size by output tokens/s on the first `sample` requests (the full sweep
    would take hours); returns it and every candidate's rate."""
    scores: dict[int, float] = {}
    for bs in candidates:
        subset = workload[: max(sample, bs)]
        seconds = run_hf(model, subset, bs, pad_id, desc=f"HF calibration (batch {bs})")
        scores[bs] = sum(r.output_len for r in subset) / seconds
        print(f"    HF calibration: batch {bs:>3}: {scores[bs]:8.1f} out tok/s", file=sys.stderr, flush=True)
    return max(scores, key=scores.__getitem__), scores


def sweep(model: Any, workload: list[BenchRequest], sizes: list[int], pad_id: int = 0) -> dict[int, float]:
    """Seconds of the whole workload at every batch size."""
    seconds: dict[int, float] = {}
    for bs in sizes:
        seconds[bs] = run_hf(model, workload, bs, pad_id, desc=f"HF generate (batch {bs})")
        print(f"    HF generate: batch {bs:>3}: {sum(r.output_len for r in workload) / seconds[bs]:8.1f} out tok/s",
              file=sys.stderr, flush=True)
    return seconds


def hf_baseline(path: str, torch_dtype: Any, workload: list[BenchRequest], candidates: list[int],
                sample: int, pad_id: int = 0) -> HFBaseline:
    """HF `generate` on the whole workload at its best batch size among `candidates` (module docstring)."""
    sizes = batch_sizes_to_measure(candidates, len(workload))
    output_tokens = sum(r.output_len for r in workload)
    model = load_hf_model(path, torch_dtype)
    try:
        warm_up(model, workload[0], pad_id)
        whole = len(sizes) == 1 or len(workload) <= sample
        if whole:
            times = sweep(model, workload, sizes, pad_id)
            best = min(times, key=times.__getitem__)
            seconds, rates = times[best], {bs: output_tokens / t for bs, t in times.items()}
        else:
            best, rates = best_batch_size(model, workload, sizes, sample, pad_id)
            seconds = run_hf(model, workload, best, pad_id, desc=f"HF generate (batch {best})")
    finally:
        del model
        gc.collect()
    return HFBaseline(seconds=seconds, batch_size=best, steps=forward_passes(workload, best), rates=rates,
                      swept_whole_workload=whole)


def parse_batch_sizes(text: str, flag: str = "--hf-batch-sizes") -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{flag}: expected positive integers, got {text!r}")
    return sizes

