"""Speculative decoding under tensor and pipeline parallelism (Ray worker groups, CPU, gloo): every rank
proposes the same drafts (the draft model runs whole on each rank), the last stage verifies, and greedy
output equals the single-rank engine's without speculation."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from pagedserve.engine import LLM  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402
from tests.test_engine_parity import assert_all_blocks_free  # noqa: E402
from tests.test_spec_decode import greedy, repetitive_prompts, run  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with fresh_local_ray(num_cpus=4):
        yield


@pytest.mark.parametrize(("tp", "pp", "method"), [(2, 1, "draft_model"), (2, 1, "ngram"), (1, 2, "draft_model")])
def test_parallel_speculation_equals_single_rank(tiny_model_factory, tp, pp, method):
    target = tiny_model_factory("llama")
    prompts = repetitive_prompts(1, [9, 17, 30, 41, 5])  # the greedy loops of these give lookup hits
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory="16MiB")
    expected = run(LLM(model=str(target), **kw), prompts, greedy())
    spec = ({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3} if method == "draft_model"
            else {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    llm = LLM(model=str(target), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="ray", speculative_config=spec, **kw)
    try:
        assert run(llm, prompts, greedy()) == expected
        stats = llm.get_stats().spec_decoding
        assert stats["num_draft_tokens"] > 0
        if method == "draft_model":  # the target is its own draft: a rank out of step would reject some
            assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
