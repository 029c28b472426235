"""Prompt logprobs cover every prompt position exactly once, whatever the scheduler did: prefix-cache hits
(a repeated prompt, n > 1 siblings), chunked prefill and preemption with recompute. Values equal HF's
log_softmax over the prompt (float32, tiny random model)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from tests.test_engine_parity import _hf_logprobs, _hf_model, assert_all_blocks_free, greedy, random_prompts

TOP = 2


def check_prompt_logprobs(prompt: list[int], prompt_logprobs, ref: torch.Tensor) -> None:
    """Entry 0 is None; entry p holds prompt[p] with HF's logprob and rank, plus the top TOP tokens."""
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[pos], ref[pos - 1], prompt[pos]
        assert entry is not None, f"position {pos} has no logprobs"
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum().item()) + 1
        assert set(torch.topk(row, TOP).indices.tolist()) <= set(entry)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama, _hf_model(tiny_llama)


def test_repeated_prompt_is_not_cut_by_prefix_hits(model):
    path, hf = model
    llm = LLM(model=str(path), dtype="float32", block_size=4, kv_cache_memory="16MiB")
    prompt = random_prompts(21, [40])[0]
    ref = _hf_logprobs(hf, prompt)
    params = greedy(max_new=2, prompt_logprobs=TOP)
    for _ in range(2):  # the second time, the whole prompt but its last block is in the prefix cache
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        check_prompt_logprobs(prompt, out.prompt_logprobs, ref)
    # Without prompt logprobs the same prompt still reads the cache.
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_new=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 36 and out.prompt_logprobs is None
    assert_all_blocks_free(llm)


def test_n_siblings_each_get_every_position(model):
    path, hf = model
    llm = LLM(model=str(path), dtype="float32", block_size=4, kv_cache_memory="16MiB")
    prompt = random_prompts(22, [40])[0]
    ref = _hf_logprobs(hf, prompt)
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    check_prompt_logprobs(prompt, out.prompt_logprobs, ref)
    assert_all_blocks_free(llm)


def test_chunked_prefill_with_a_cached_prefix(model):
    path, hf = model
    # A 6-token budget splits the prompts into several chunks; the shared prefix is cached by the first.
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=6, kv_cache_memory="16MiB")
    shared = random_prompts(23, [17])[0]
    prompts = random_prompts(24, [1, 9, 22], prefix=shared)
    llm.generate({"prompt_token_ids": shared}, greedy(max_new=1), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_new=3, prompt_logprobs=TOP),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(prompt, out.prompt_logprobs, _hf_logprobs(hf, prompt))
    assert_all_blocks_free(llm)


def test_preempted_requests_do_not_repeat_positions(model):
    path, hf = model
    # 14 blocks of 4 tokens cannot hold six growing requests: some are preempted (mid-prompt with the
    # small budget, or while decoding) and recompute their prompts.
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8)
    prompts = random_prompts(25, [10, 12, 7, 15, 9, 11])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(prompt_logprobs=TOP), use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(prompt, out.prompt_logprobs, _hf_logprobs(hf, prompt))
    assert_all_blocks_free(llm)
