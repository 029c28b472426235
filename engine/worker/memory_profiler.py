"""Size the KV cache on a GPU from what the device has left (vLLM's `gpu_memory_utilization`).

After the weights are loaded, one forward pass at the step's full token budget
(`max_num_batched_tokens`, as prefill sequences of at most `max_model_len`) measures the peak
activation memory. The KV cache then gets

    budget = total * gpu_memory_utilization - used_before_profile - peak_activation_increase

where `used_before_profile` is everything already on the device (this process's weights and CUDA
context, and any other process), so the device as a whole stays under the utilization fraction.
On CPU the budget is `kv_cache_memory` instead (no profiling); an explicit `kv_cache_memory` or
`num_kv_blocks` overrides the profile on a GPU too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.worker.warmup import _metadata
from pagedserve.parallel.pipeline import IntermediateTensors

if TYPE_CHECKING:
    from pagedserve.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # device memory, bytes
    used_before: int  # in use (every process) after loading the weights, before the profile run
    peak_increase: int  # extra memory the profile forward pass needed at its peak

    def kv_budget(self, utilization: float) -> int:
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization}")
        return max(0, int(self.total * utilization) - self.used_before - self.peak_increase)

    def describe(self, utilization: float) -> str:
        return (f"device {self.total / GiB:.2f} GiB x {utilization:.2f} utilization - {self.used_before / GiB:.2f} GiB "
                f"in use (weights, context, other processes) - {self.peak_increase / GiB:.2f} GiB peak activations "
                f"= {self.kv_budget(utilization) / GiB:.2f} GiB for the KV cache")


def profile_sequences(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) of the profile batch: the whole token budget as prefill sequences of at most
    max_model_len tokens, spread over at most max_num_seqs sequences (the worst step the scheduler makes)."""
    num_seqs = min(max_num_seqs, max(1, max_num_batched_tokens))
    num_seqs = max(num_seqs, -(-max_num_batched_tokens // max_model_len))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    lens = [base + (1 if i < extra else 0) for i in range(num_seqs)]
    return [(n, n) for n in lens if n > 0]


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> None:
    """One forward pass (and the logits of every sequence) at the full token budget over a throwaway
    one-block KV cache: nothing is written (slot -1) and every block table points at block 0."""
    config, model, device = runner.config, runner.model, runner.device
    batch = profile_sequences(config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs)
    num_layers, num_kv_heads, head_size = model.kv_cache_shape_per_layer()
    shape = (1, runner.block_size, num_kv_heads, head_size)
    scratch = [(torch.zeros(shape, dtype=runner.dtype, device=device),
                torch.zeros(shape, dtype=runner.dtype, device=device)) for _ in range(num_layers)]
    md = _metadata(batch, runner.block_size, device)
    md.block_tables.zero_()
    num_tokens = md.query_start_loc_cpu[-1]
    positions = torch.cat([torch.arange(s - q, s, device=device) for q, s in batch])
    intermediate = None
    if not runner.is_first_stage:
        zeros = torch.zeros(num_tokens, model.spec.hidden_size, dtype=runner.dtype, device=device)
        intermediate = IntermediateTensors(hidden_states=zeros, residual=zeros.clone())
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device) if runner.is_first_stage else None
    hidden = model.forward(input_ids, positions, scratch, md, intermediate=intermediate)
    if runner.is_last_stage:
        last_rows = [end - 1 for end in md.query_start_loc_cpu[1:]]
        model.compute_logits(hidden[last_rows])


def profile_gpu_memory(runner: ModelRunner) -> MemoryProfile:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_run(runner)
    torch.cuda.synchronize(device)
    profile = MemoryProfile(total=total, used_before=total - free,
                            peak_increase=torch.cuda.max_memory_allocated(device) - allocated_before)
    torch.cuda.empty_cache()
    return profile


def gpu_kv_budget(runner: ModelRunner) -> int:
    """Bytes this rank may give its KV cache on its GPU (logged with the figures behind it)."""
    profile = profile_gpu_memory(runner)
    utilization = runner.config.gpu_memory_utilization
    logger.info("KV cache sizing on %s: %s", runner.device, profile.describe(utilization))
    budget = profile.kv_budget(utilization)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache ({profile.describe(utilization)}); "
            "raise it, lower max_num_batched_tokens, or free the GPU"
        )
    return budget
