"""Speculative decoding end to end: greedy output equals the plain engine's (and HF's) token for token for
both proposers and every scheduler feature, sampled output keeps the target's distribution, stop
conditions inside an accepted run cut at the same token, the counters count, and every block of the
target and draft caches is free afterwards."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine import LLM, SamplingParams
from tests.test_engine_parity import _hf_model, assert_all_blocks_free, hf_greedy
from tests.tiny_models import VOCAB_SIZE

MAX_NEW = 24


def repetitive_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts that repeat a random segment, so prompt lookup finds n-grams to propose."""
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        segment = [rng.randrange(8, VOCAB_SIZE) for _ in range(max(3, n // 3))]
        prompts.append((segment * 4)[:n])
    return prompts


def greedy(max_new: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1, **kw}


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB")
    prompts = repetitive_prompts(1, [9, 17, 30, 41, 5])
    return prompts, run(llm, prompts, greedy())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_plain_and_hf(target, plain_outputs, k):
    prompts, expected = plain_outputs
    llm = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB", speculative_config=ngram(k))
    assert run(llm, prompts, greedy()) == expected
    hf = _hf_model(target)
    assert expected[0] == hf_greedy(hf, prompts[0], MAX_NEW)
    stats = llm.get_stats()
    spec = stats.spec_decoding
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert spec["num_accepted_tokens"] > 0, "a random model's greedy loops repeat: lookup must hit some"
    assert len(spec["accepted_per_position"]) == k
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_plain(target, plain_outputs, tiny_model_factory, k):
    prompts, expected = plain_outputs
    draft = tiny_model_factory("llama", num_hidden_layers=1)
    llm = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB",
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
    assert run(llm, prompts, greedy()) == expected
    assert llm.get_stats().spec_decoding["num_draft_tokens"] > 0
    assert_all_blocks_free(llm)


def self_draft_llm(target, k: int = 3, **kw) -> LLM:
    """The target as its own draft: every draft must be accepted unless the draft's cache fell out of step."""
    return LLM(model=str(target), dtype="float32", block_size=4,
               speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": k}, **kw)


def test_self_draft_accepts_everything_under_chunked_prefill_and_prefix_hits(target):
    llm = self_draft_llm(target, kv_cache_memory="16MiB", max_num_batched_tokens=11)
    shared = repetitive_prompts(3, [21])[0]
    prompts = [shared + [9, 10], shared + [11], repetitive_prompts(4, [37])[0]]
    plain = LLM(model=str(target), dtype="float32", block_size=4, kv_cache_memory="16MiB",
                max_num_batched_tokens=11)
    expected = run(plain, prompts, greedy())
    assert run(llm, prompts, greedy()) == expected
    assert run(llm, prompts, greedy()) == expected  # second round: prefix-cache hits in both caches
    spec = llm.get_stats().spec_decoding
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
    assert llm.get_stats().prefix_cache_hits > 0
    assert_all_blocks_free(llm)


def test_self_draft_under_preemption(target):
    prompts = repetitive_prompts(5, [30, 31, 29, 33])
    # 24 blocks of 4 tokens: four requests of ~55 tokens cannot all stay resident.
    llm = self_draft_llm(target, num_kv_blocks=24)
    plain = LLM(model=str(target), dtype="float32", block_size=4, num_kv_blocks=24)
    expected = run(plain, prompts, greedy())
    assert run(llm, prompts, greedy()) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decoding["num_accepted_tokens"] == stats.spec_decoding["num_draft_tokens"] > 0
    assert_all_blocks_free(llm)


def test_stop_conditions_inside_an_accepted_run(target, plain_outputs):
    prompts, expected = plain_outputs
    llm = self_draft_llm(target, k=5, kv_cache_memory="16MiB")
    for prompt, full in zip(prompts, expected):
        stop_id = full[7]
        cut = full.index(stop_id) + 1
        out = llm.generate({"prompt_token_ids": prompt}, greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == full[:cut]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
        # max_tokens inside a run
        out = llm.generate({"prompt_token_ids": prompt}, greedy(max_new=6), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == full[:6] and out.outputs[0].finish_reason == "length"
    # A stop string that ends inside an accepted run: text and tokens cut where the plain engine cuts.
    plain = LLM(model=str(target), dtype="float32", block_size=4, kv_cache_memory="16MiB")
    text = plain.generate({"prompt_token_ids": prompts[2]}, greedy(), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    want = plain.generate({"prompt_token_ids": prompts[2]}, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    got = llm.generate({"prompt_token_ids": prompts[2]}, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert_all_blocks_free(llm)


def test_ineligible_requests_share_the_batch(target, plain_outputs):
    """Penalties and logprobs decode one token per step beside speculating requests, exactly as before."""
    prompts, expected = plain_outputs
    llm = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB", speculative_config=ngram(3))
    plain = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB")
    special = [greedy(repetition_penalty=1.3), greedy(logprobs=2)]
    params = [greedy(), *special, greedy(), greedy()]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[2].outputs[0].logprobs is not None and len(got[2].outputs[0].logprobs) == MAX_NEW
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(target):
    prompts = repetitive_prompts(6, [12, 20, 28])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB", speculative_config=ngram(3))
    first = run(alone, [prompts[0]], seeded)[0]
    assert run(alone, [prompts[0]], seeded)[0] == first
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = alone.generate([{"prompt_token_ids": p} for p in prompts], [seeded, others, others], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == first
    assert_all_blocks_free(alone)


def test_speculative_config_errors_name_the_field(target, tiny_model_factory):
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(model=str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model=str(target), speculative_config={"method": "eagle9", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(model=str(target), speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    other_vocab = tiny_model_factory("llama", vocab_size=VOCAB_SIZE + 64)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(other_vocab),
                                                   "num_speculative_tokens": 2})
