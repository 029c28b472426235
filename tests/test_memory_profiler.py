"""GPU KV-cache sizing: the budget arithmetic, the profile batch, and the profile forward pass (which runs
on CPU too: the same code, without the CUDA memory counters)."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.memory_profiler import MemoryProfile, profile_run, profile_sequences

GiB = 1024**3


def test_budget_is_the_utilization_share_minus_what_is_in_use_and_the_peak():
    profile = MemoryProfile(total=80 * GiB, used_before=15 * GiB, peak_increase=3 * GiB)
    assert profile.kv_budget(0.9) == int(72 * GiB) - 18 * GiB
    assert profile.kv_budget(0.2) == 0  # never negative: the caller refuses a zero budget
    assert "GiB for the KV cache" in profile.describe(0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        profile.kv_budget(1.5)


@pytest.mark.parametrize("budget,max_len,max_seqs", [(2048, 512, 256), (2048, 4096, 256), (100, 8, 4), (7, 16, 3)])
def test_profile_batch_covers_the_whole_token_budget_in_valid_sequences(budget, max_len, max_seqs):
    seqs = profile_sequences(budget, max_len, max_seqs)
    assert sum(q for q, _ in seqs) == budget
    assert all(q == s and 0 < s <= max_len for q, s in seqs)
    assert len(seqs) <= max(max_seqs, -(-budget // max_len))


def test_gpu_memory_utilization_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model=str(tiny_llama), gpu_memory_utilization=0)
    assert EngineConfig(model=str(tiny_llama)).gpu_memory_utilization == 0.9


def test_profile_run_leaves_the_engine_untouched(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, block_size=4, max_num_batched_tokens=48)
    prompt = [{"prompt_token_ids": list(range(10, 30))}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    cache_before = [k.clone() for k, _ in runner.kv_caches]
    profile_run(runner)
    assert all((k == c).all() for (k, _), c in zip(runner.kv_caches, cache_before))
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
