"""Embeddings from tensor- and pipeline-parallel engines (Ray worker groups on a local 4-CPU Ray, gloo):
the last pipeline stage's driver rank pools the final-norm hidden states (replicated over the TP ranks),
and the vectors equal HF transformers' as on one rank, chunked and beside generations. And from two
data-parallel engine actors behind the coordinator: routed like prompts, prefix affinity included."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from pagedserve.engine import LLM  # noqa: E402
from pagedserve.engine.pooling_params import PoolingParams  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402
from tests.test_engine_actors import wait_coordinator_idle  # noqa: E402
from tests.test_embeddings import LONG, PROMPTS, cosine, reference, run_mixed  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with fresh_local_ray(num_cpus=4):
        yield


@pytest.fixture(scope="module")
def hf_model(tiny_model_factory):
    import transformers

    return transformers.AutoModel.from_pretrained(str(tiny_model_factory("llama")), dtype=torch.float32).eval()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_embeddings_match_hf(tiny_model_factory, hf_model, tp, pp):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_executor_backend="ray", block_size=4,
              max_num_batched_tokens=16, kv_cache_memory="16MiB", max_model_len=128)
    try:
        for pooling in ("last", "mean"):
            outputs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
            for out in outputs:
                assert out.error is None
                assert cosine(out.outputs.embedding, reference(hf_model, out.prompt_token_ids, pooling)) > 0.9999
        alone = llm.embed(LONG, use_tqdm=False)[0]
        embeddings, texts = run_mixed(llm, [{"prompt_token_ids": alone.prompt_token_ids}], ["hello world"], "last")
        assert torch.allclose(torch.tensor(embeddings["emb-0"].outputs.embedding),
                              torch.tensor(alone.outputs.embedding), atol=1e-5)
        assert len(texts["gen-0"]) == 12
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


def test_data_parallel_embeddings_spread_and_share_the_prefix_cache(tiny_model_factory, hf_model):
    """DP=2 engine actors behind the coordinator (what `--data-parallel-size 2` serves): embeddings are routed
    like prompts, spread over both engines and each HF's vector; one whose prompt a generation just
    computed goes to that engine (prefix affinity) and reads its cached blocks; every block free after."""
    import asyncio

    from pagedserve.cluster.serve.coordinator import DPCoordinator
    from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready

    engine_kwargs = dict(model=str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory="16MiB",
                         block_size=4, max_model_len=128)
    prompts = [[(7 * i + 13 * k) % 400 + 10 for k in range(5 + 3 * i)] for i in range(8)]
    shared = [(11 * k) % 300 + 20 for k in range(16)]  # four full blocks
    handles = start_engine_actors(engine_kwargs, data_parallel_size=2, name_prefix="test-embed-dp")

    async def embed(coord: DPCoordinator, request_id: str, ids: list[int], pooling: str):
        outputs = [o async for o in coord.generate(request_id, ids, {}, pooling_params={"pooling_type": pooling})]
        assert len(outputs) == 1 and outputs[0].finished and outputs[0].error is None
        return outputs[0]

    def routed(coord: DPCoordinator) -> list[int]:
        return list(coord.aggregate_stats().num_requests_routed)

    async def run():
        coord = DPCoordinator(handles, block_size=4, seed=1)
        try:
            spread = await asyncio.gather(*[embed(coord, f"emb-{i}", ids, "mean") for i, ids in enumerate(prompts)])
            counts = [routed(coord)]
            async for _ in coord.generate("gen", shared + [1, 2], {"temperature": 0, "max_tokens": 2}):
                pass
            counts.append(routed(coord))
            affine = await embed(coord, "emb-shared", shared + [3], "last")
            counts.append(routed(coord))
            return spread, counts, affine, await wait_coordinator_idle(coord)
        finally:
            await coord.stop()

    try:
        wait_engines_ready(handles, timeout_s=300)
        spread, counts, affine, stats = asyncio.run(asyncio.wait_for(run(), 300))
    finally:
        for handle in handles:
            ray.kill(handle, no_restart=True)
    for ids, out in zip(prompts, spread):
        assert out.prompt_token_ids == ids
        assert cosine(out.outputs.embedding, reference(hf_model, ids, "mean")) > 0.9999
    assert sum(counts[0]) == len(prompts) and all(n > 0 for n in counts[0])  # both engines embedded
    generated_on = [b - a for a, b in zip(counts[0], counts[1])].index(1)
    embedded_on = [b - a for a, b in zip(counts[1], counts[2])].index(1)
    assert embedded_on == generated_on  # prefix affinity
    assert affine.num_cached_tokens >= 16  # it read the generation's four full blocks
    assert cosine(affine.outputs.embedding, reference(hf_model, shared + [3], "last")) > 0.9999
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats)
