"""Prefill/decode across nodes: a local multi-node Ray cluster (a head and two worker raylets on this
machine, `ray.cluster_utils.Cluster`), the prefill pool pinned to one node and the decode pool to the
other by custom resources, KV moving between them through the Ray transport (each node has its own
object store). The prefill engine is TP=2: its rank actors, on the prefill node, answer the reads.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.cluster.serve.pd_pools import PoolSpec, start_pool, wait_pool_ready
from tests.multinode_cluster import in_process_cluster

PROMPTS = [[(29 * i + 3 * k) % 470 + 20 for k in range(n)] for i, n in enumerate((6, 19, 37))]
MAX_TOKENS = 6



@pytest.fixture(scope="module")
def cluster():
    with in_process_cluster({"prefill": (3, {"prefill_node": 3}), "decode": (2, {"decode_node": 2})}) as nodes:
        yield nodes


def test_prefill_and_decode_pools_on_different_nodes(cluster, tiny_model_factory):
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    model = str(tiny_model_factory("llama", max_position_embeddings=512))
    kwargs = {"model": model, "dtype": "float32", "num_kv_blocks": 64, "block_size": 4}
    llm = LLM(**kwargs)
    try:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                       ignore_eos=True), use_tqdm=False)]
    finally:
        llm.shutdown()
    extra = {"read_timeout_s": 30}
    prefill = start_pool(PoolSpec("prefill", 1, {**kwargs, "tensor_parallel_size": 2}, num_cpus_per_engine=0.5,
                                  resources={"prefill_node": 1}, kv_connector_extra_config=extra), "multinode")
    decode = start_pool(PoolSpec("decode", 1, kwargs, num_cpus_per_engine=0.5, resources={"decode_node": 1},
                                 kv_connector_extra_config=extra), "multinode")

    async def run() -> None:
        ready = {"prefill": await wait_pool_ready(prefill, 300), "decode": await wait_pool_ready(decode, 300)}
        assert ready["prefill"][0]["node_id"] == cluster["prefill"]
        assert ready["decode"][0]["node_id"] == cluster["decode"]
        client = PDClient.over_actors(prefill.handles, decode.handles, prefill.names, 4, 4, stats_interval_s=0.1)
        client.start()
        try:
            async def tokens(i: int, prompt: list[int]) -> list[int]:
                out: list[int] = []
                async for o in client.generate(f"r{i}", prompt, {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                                  "ignore_eos": True}):
                    out += o.outputs[0].token_ids
                return out

            got = await asyncio.gather(*(tokens(i, p) for i, p in enumerate(PROMPTS)))
            assert list(got) == expected
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                stats = [await h.get_stats.remote() for h in (*prefill.handles, *decode.handles)]
                idle = all(s.num_free_blocks == s.num_total_blocks and not s.kv_transfer["held_requests"]
                           for s in stats)
                if idle or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert idle, stats
            kv = stats[1].kv_transfer
            assert kv["loads"] == len(PROMPTS) and kv["fallbacks"] == 0
            # n == 1 requests continue from the prefill's token: each prompt's whole KV moves.
            assert kv["loaded_tokens"] == sum(len(p) for p in PROMPTS)
        finally:
            await client.stop()

    try:
        asyncio.run(run())
    finally:
        prefill.shutdown()
        decode.shutdown()
