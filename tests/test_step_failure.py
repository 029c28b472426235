"""One request's failure inside a step fails that request alone; a failed forward pass fails its batch,
and the engine goes on serving. Failures are injected through the model runner's test hook."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineConfig
from tests.test_engine_parity import _hf_model, assert_all_blocks_free, greedy, hf_greedy, random_prompts


def _inject(engine, fault_injector) -> None:
    engine.engine_core.executor.collective_rpc("set_fault_injector", (fault_injector,))


class _Poison:
    """fault_injector: raises for one request id at one stage."""

    def __init__(self, stage: str, request_id: str) -> None:
        self.stage, self.request_id = stage, request_id

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == self.stage and request_id == self.request_id:
            raise RuntimeError(f"injected {stage} failure")


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    yield llm
    llm.shutdown()


def test_poisoned_request_fails_alone(llm, tiny_model_factory):
    hf = _hf_model(tiny_model_factory("llama"))
    prompts = random_prompts(31, [9, 13, 6])
    # LLM.generate numbers its requests from a counter: the middle one of this batch is poisoned.
    first_id = int(next(llm._request_counter)) + 1
    _inject(llm.llm_engine, _Poison("sample", str(first_id + 1)))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    finally:
        _inject(llm.llm_engine, None)
    ok = [outs[0], outs[2]]
    for prompt, out in zip([prompts[0], prompts[2]], ok):
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "injected sample failure" in bad.error
    assert_all_blocks_free(llm)
    # The engine serves a new request afterwards.
    again = llm.generate({"prompt_token_ids": prompts[1]}, greedy(), use_tqdm=False)[0]
    assert again.error is None and again.outputs[0].token_ids == hf_greedy(hf, prompts[1])
    assert_all_blocks_free(llm)


def test_forward_failure_fails_its_batch_and_the_engine_goes_on(llm, tiny_model_factory):
    hf = _hf_model(tiny_model_factory("llama"))
    prompts = random_prompts(32, [8, 8], prefix=[11, 12, 13, 14, 15, 16, 17, 18])
    first_id = int(next(llm._request_counter)) + 1
    _inject(llm.llm_engine, _Poison("forward", str(first_id)))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    finally:
        _inject(llm.llm_engine, None)
    for out in outs:  # both prompts ran in the same (first) batch
        assert out.outputs[0].finish_reason == "error" and "injected forward failure" in out.error
    assert_all_blocks_free(llm)
    # Same prompts again: no block of the failed batch may be reused as a prefix hit.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.outputs[0].token_ids == hf_greedy(hf, prompt)
    assert_all_blocks_free(llm)


def test_seeded_overflowing_seed_and_huge_top_k_run(llm):
    params = SamplingParams(n=2, seed=2**64 - 1, top_k=2**31, max_tokens=4, temperature=1.0)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [4, 4]
    assert_all_blocks_free(llm)


def test_async_llm_stream_gets_the_error_and_others_finish(tiny_model_factory):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory="8MiB"))
    _inject(engine.engine, _Poison("sample", "poisoned"))
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)

    async def collect(request_id):
        last = None
        async for out in engine.generate("hello there", params, request_id=request_id):
            last = out
        return last

    async def run():
        return await asyncio.gather(collect("healthy-1"), collect("poisoned"), collect("healthy-2"))

    try:
        healthy_1, poisoned, healthy_2 = asyncio.run(run())
        assert poisoned.finished and poisoned.outputs[0].finish_reason == "error"
        assert "injected sample failure" in poisoned.error
        for out in (healthy_1, healthy_2):
            assert out.error is None and out.outputs[0].finish_reason == "length"
        assert healthy_1.outputs[0].token_ids == healthy_2.outputs[0].token_ids
        assert engine.is_healthy()
        after = asyncio.run(collect("after"))
        assert after.outputs[0].token_ids == healthy_1.outputs[0].token_ids
        stats = engine.engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()


class _PoisonAfter:
    """fault_injector: the sampling of one request raises once it has sampled ``tokens`` tokens; each of
    its steps takes ``step_s`` longer, so that a reader keeps up with its first token."""

    def __init__(self, request_id: str, tokens: int, step_s: float = 0.0) -> None:
        self.request_id, self.tokens, self.step_s, self.sampled = request_id, tokens, step_s, 0

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "sample" and request_id == self.request_id:
            self.sampled += 1
            time.sleep(self.step_s)
            if self.sampled > self.tokens:
                raise RuntimeError("injected sample failure")


def test_a_consumer_that_fell_behind_gets_the_tokens_made_before_the_failure_first(tiny_model_factory):
    """The deltas waiting for a slow consumer are merged, but never with the request's failure: the tokens
    made before it come as their own output, then the error (an HTTP stream has started by then)."""
    engine = AsyncLLM(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory="8MiB"))
    _inject(engine.engine, _PoisonAfter("poisoned", 3, step_s=0.05))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> list:
        outputs = []
        async for out in engine.generate("hello there", params, request_id="poisoned"):
            outputs.append(out)
            deadline = time.monotonic() + 60
            while len(outputs) == 1 and engine.get_stats().num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # fall behind until the request has failed in the engine
        return outputs

    try:
        outputs = asyncio.run(run())
        *tokens, failed = outputs  # e.g. the first token, tokens 2-3 merged, then the failure on its own
        assert tokens and all(o.error is None and not o.finished for o in tokens)
        assert sum(len(o.outputs[0].token_ids) for o in tokens) == 3
        assert failed.finished and "injected sample failure" in failed.error
        assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    finally:
        engine.shutdown()
