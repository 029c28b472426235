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


def test_every_sampling_parameter_beside_speculation(target, plain_outputs):
    """logprobs, penalties, logit_bias, allowed_token_ids, min_tokens and bad_words apply at every verified
    position: the same tokens and logprobs as the plain engine, and every one of these requests speculates."""
    prompts, expected = plain_outputs
    tail = sorted(set(expected[1][:12]))  # tokens the greedy path uses: banning/biasing them changes it
    plain = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB")
    text = plain.generate({"prompt_token_ids": prompts[1]}, greedy(), use_tqdm=False)[0].outputs[0].text
    params = [
        greedy(logprobs=3),
        greedy(repetition_penalty=1.3),
        greedy(logit_bias={tail[0]: -100.0, tail[1]: 5.0}),
        greedy(allowed_token_ids=tail + [1, 5, 9, 77]),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, stop_token_ids=[expected[4][3]]),
        greedy(frequency_penalty=0.8, presence_penalty=0.5),
        greedy(bad_words=[text[4:9], text[12:14]]),
    ]
    prompts = [prompts[i % len(prompts)] for i in range(len(params))]
    llm = self_draft_llm(target, kv_cache_memory="16MiB")  # drafts at every step
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for i in (1, 2, 5, 6):  # each of these processors changed what greedy decoding gives
        assert want[i].outputs[0].token_ids != expected[i % len(expected)], i
    got_lp, want_lp = got[0].outputs[0].logprobs, want[0].outputs[0].logprobs
    assert len(got_lp) == len(want_lp) == MAX_NEW
    for g, w in zip(got_lp, want_lp):
        assert list(g) == list(w)  # same token ids (chosen + top 3), same order
        assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in g)
    for i, p in enumerate(params):  # every one of them speculates (alone, so the counters are its own)
        before = llm.get_stats().spec_decoding["num_draft_tokens"]
        again = llm.generate({"prompt_token_ids": prompts[i]}, p, use_tqdm=False)[0].outputs[0]
        assert again.token_ids == want[i].outputs[0].token_ids
        assert llm.get_stats().spec_decoding["num_draft_tokens"] > before, i
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


# Chi-square critical values at p = 0.001 by degrees of freedom (scipy is not a dependency).
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
             11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def two_sample_chi2(a: list[int], b: list[int]) -> tuple[float, int]:
    """Chi-square statistic of two equal-sized samples over their categories (counts < 10 pooled)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    pooled_a = pooled_b = 0
    stat, cells = 0.0, 0
    for cat in set(ca) | set(cb):
        x, y = ca[cat], cb[cat]
        if x + y < 10:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
            continue
        stat += (x - y) ** 2 / (x + y)
        cells += 1
    if pooled_a + pooled_b:
        stat += (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b)
        cells += 1
    return stat, cells - 1


def test_sampled_tokens_keep_the_target_distribution(tiny_model_factory):
    """A tiny-vocabulary target and a different draft: the 2nd to 4th tokens (verified against drafts)
    are distributed as without speculation (two-sample chi-square, fixed seeds: deterministic)."""
    target = tiny_model_factory("llama", vocab_size=16)
    draft = tiny_model_factory("llama", vocab_size=16, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    prompt = [3, 9, 4, 12, 7, 9, 4]
    n = 2000
    params = [SamplingParams(temperature=0.9, top_k=10, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    kw = dict(dtype="float32", block_size=8, kv_cache_memory="64MiB", max_num_seqs=512)
    plain = LLM(model=str(target), **kw)
    spec = LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                      "num_speculative_tokens": 2}, **kw)
    got_plain = run(plain, [prompt] * n, params)
    got_spec = run(spec, [prompt] * n, params)
    assert spec.get_stats().spec_decoding["num_draft_tokens"] > n  # tokens 2-4 came through verification
    for position in (1, 2, 3):
        stat, dof = two_sample_chi2([t[position] for t in got_plain], [t[position] for t in got_spec])
        assert dof >= 3 and stat < _CHI2_999[dof], (position, stat, dof)
    assert_all_blocks_free(spec)


def test_n_children_and_the_bundled_pair():
    """The bundled target/draft pair (trained together) in float32: greedy equals the plain engine for a
    parallel-sampling request's children too, and the first draft is accepted about as often as the pair agrees."""
    from pagedserve.engine.models.default_model import BUNDLED_MODEL_DIR

    DEFAULT_MODEL_DIR, DRAFT_MODEL_DIR = BUNDLED_MODEL_DIR, BUNDLED_MODEL_DIR.parent / "draft-model"

    kw = dict(dtype="float32", kv_cache_memory="32MiB", block_size=16)
    plain = LLM(model=str(DEFAULT_MODEL_DIR), **kw)
    spec = LLM(model=str(DEFAULT_MODEL_DIR), speculative_config={
        "method": "draft_model", "model": str(DRAFT_MODEL_DIR), "num_speculative_tokens": 4}, **kw)
    prompts = ["The quick brown fox", "def add(a, b):\n    return", "Paged attention stores keys and"]
    params = SamplingParams(temperature=0.0, max_tokens=32, n=2)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.get_stats().spec_decoding
    # The pair agrees on ~48% of greedy positions (assets/MODEL_CARD.md): the first draft of a run is
    # accepted about that often; a random draft would almost never be.
    assert stats["accepted_per_position"][0] / stats["num_drafts"] > 0.3
    assert_all_blocks_free(spec)


def test_speculation_stops_at_disable_by_batch_size(target):
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 2, "disable_by_batch_size": 3}
    llm = LLM(model=str(target), dtype="float32", block_size=8, kv_cache_memory="16MiB", speculative_config=spec)
    prompts = repetitive_prompts(8, [10, 10, 10])
    run(llm, prompts, greedy(max_new=8))  # three requests run side by side the whole time: no drafts
    assert llm.get_stats().spec_decoding["num_drafts"] == 0
    run(llm, prompts[:2], greedy(max_new=8))  # two: below the threshold
    assert llm.get_stats().spec_decoding["num_drafts"] > 0
    assert_all_blocks_free(llm)


def test_each_verified_position_is_processed_as_the_plain_sampler_would_at_that_token():
    """Position j of a speculating request sees the output so far plus its first j drafts: its processed
    logits equal the plain sampler's processors for a request whose output already holds those drafts."""
    import torch

    from pagedserve.engine.sample.sampler import Sampler, SamplingState, _apply_logits_processors

    vocab, gen = 40, torch.Generator().manual_seed(3)
    every = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, max_tokens=50),
        SamplingParams(temperature=0.0, frequency_penalty=1.1, presence_penalty=0.6, max_tokens=50),
        SamplingParams(temperature=0.0, logit_bias={3: 2.0, 7: -50.0}, allowed_token_ids=list(range(5, 30)),
                       min_tokens=6, stop_token_ids=[9], max_tokens=50),
        SamplingParams(temperature=0.0, max_tokens=50),
    ]
    bad_words = [[11, 12], [13], [12, 14, 15]]
    for params in every:
        prompt, output, drafts = [4, 5, 6, 11], [7, 12, 11, 5], [12, 14, 7, 12, 14]
        state = SamplingState(params=params, prompt_token_ids=prompt, output_token_ids=list(output),
                              bad_words_token_ids=bad_words, eos_token_ids={1})
        logits = torch.randn(len(drafts) + 1, vocab, generator=gen) * 3
        got, errors = Sampler().process_positions(logits, [state], [drafts])
        assert not errors
        for j in range(len(drafts) + 1):
            at_j = SamplingState(params=params, prompt_token_ids=prompt, output_token_ids=output + drafts[:j],
                                 bad_words_token_ids=bad_words, eos_token_ids={1})
            want = _apply_logits_processors(logits[j : j + 1].clone(), [at_j], {})
            torch.testing.assert_close(got[j : j + 1], want, rtol=0, atol=1e-6, msg=f"{params} position {j}")
