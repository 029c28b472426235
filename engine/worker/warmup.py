"""Start-up warm-up: run every Triton kernel variant the engine will use once, so that no JIT
compile lands in the middle of serving (CUDA only; see device_limits.should_warm_up).

The batches cover decode with one split-K partition and with every power-of-two partition
count up to max_model_len (the reduce kernel specialises on it), prefill without and with a
cached prefix, the cache write, norms, rope and SiLU (inside the forward), and the sampling
kernel with each combination of top-k / top-p / min-p. Nothing is written to the KV cache
(slot -1 skips the write) and every block table points at block 0, so no state changes.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np
import torch

from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.sample.sampler import Sampler, SamplingState
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.parallel.pipeline import IntermediateTensors

# Tokens per split-K partition of the decode launcher (kernels.triton.decode_attention).
DECODE_PARTITION_SIZE = 512


def warm_up_batches(max_model_len: int, partition_size: int = DECODE_PARTITION_SIZE) -> list[list[tuple[int, int]]]:
    """Batches of (query_len, seq_len) per sequence, decodes first."""
    q = max(1, min(16, max_model_len // 2))
    batches = [[(1, 1), (q, q), (q, min(max_model_len, 2 * q))]]  # decode, prefill, prefill after a prefix
    parts = 2
    while (parts // 2) * partition_size < max_model_len:
        batches.append([(1, min(max_model_len, parts * partition_size))])
        parts *= 2
    return batches


def _metadata(batch: list[tuple[int, int]], block_size: int, device: torch.device) -> AttentionMetadata:
    query_lens = np.array([q for q, _ in batch], dtype=np.int64)
    seq_lens = np.array([s for _, s in batch], dtype=np.int64)
    cu = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    width = int(-(-seq_lens.max() // block_size))
    num_decodes = sum(1 for q, _ in batch if q == 1)
    return AttentionMetadata(
        slot_mapping=torch.full((int(cu[-1]),), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.zeros((len(batch), width), dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )


def _sampling_states(num_prompt_tokens: int = 4) -> list[SamplingState]:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=0)]
    for top_k, top_p, min_p in itertools.product((0, 5), (1.0, 0.9), (0.0, 0.1)):
        if (top_k, top_p, min_p) != (0, 1.0, 0.0):
            params.append(SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p))
    return [SamplingState.create(p, list(range(num_prompt_tokens))) for p in params]


class WarmUpTarget(Protocol):
    """What warm-up reads of a model runner: its model and KV cache, and where it sits in the pipeline."""

    config: EngineConfig
    model: torch.nn.Module
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    dtype: torch.dtype
    block_size: int
    is_first_stage: bool
    is_last_stage: bool
    is_driver: bool


@torch.inference_mode()
def warm_up_kernels(runner: WarmUpTarget) -> None:
    """Every rank calls this at the same point (tensor-parallel collectives run inside the forward)."""
    model, device = runner.model, runner.device
    hidden_size = model.spec.hidden_size
    for batch in warm_up_batches(runner.config.max_model_len):
        md = _metadata(batch, runner.block_size, device)
        num_tokens = md.query_start_loc_cpu[-1]
        positions = torch.cat([torch.arange(s - q, s, device=device) for q, s in batch])
        intermediate = None
        if not runner.is_first_stage:
            zeros = torch.zeros(num_tokens, hidden_size, dtype=runner.dtype, device=device)
            intermediate = IntermediateTensors(hidden_states=zeros, residual=zeros.clone())
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device) if runner.is_first_stage else None
        hidden = model.forward(input_ids, positions, runner.kv_caches, md, intermediate=intermediate)
    if runner.is_last_stage:
        states = _sampling_states()
        logits = model.compute_logits(hidden[-1:].expand(len(states), -1).contiguous())
        if runner.is_driver:
            Sampler(seed=0).sample(logits, states)  # a throwaway sampler: the engine's draws stay untouched
    if device.type == "cuda":
        torch.cuda.synchronize(device)
