"""Structured output with tensor parallelism on Ray (CPU, gloo): the bitmask travels in the
scheduler output and only the sampling rank applies it; outputs are valid and greedy ones equal
the single-rank engine's."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from pagedserve import LLM  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402
from tests.structured_output_checks import assert_valid_outputs, constrained  # noqa: E402
from tests.test_engine_parity import assert_all_blocks_free, random_prompts  # noqa: E402

KINDS = ["json", "regex", "choice", "grammar"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with fresh_local_ray(num_cpus=2):
        yield


def test_tp2_constrained_outputs_are_valid_and_match_tp1(tiny_llama):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(21, [6, 9, 12, 7])]
    greedy = [constrained(k, temperature=0.0, max_tokens=32) for k in KINDS]
    sampled = [constrained(k, temperature=1.0, n=2, max_tokens=32) for k in KINDS]
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory="16MiB")
    single = LLM(model=str(tiny_llama), **kw)
    try:
        expected = single.generate(prompts, greedy, use_tqdm=False)
    finally:
        single.shutdown()
    llm = LLM(model=str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
    try:
        outs = llm.generate(prompts + prompts, greedy + sampled, use_tqdm=False)
        for kind, out in zip(KINDS + KINDS, outs):
            assert_valid_outputs(kind, out, min_stopped=0)  # greedy noise may loop until max_tokens
        assert sum(c.finish_reason == "stop" for o in outs for c in o.outputs) >= 6
        assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in expected]
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
