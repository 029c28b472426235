"""Embeddings from tensor- and pipeline-parallel engines (Ray worker groups on a local 4-CPU Ray, gloo):
the last pipeline stage's driver rank pools the final-norm hidden states (replicated over the TP ranks),
and the vectors equal HF transformers' as on one rank, chunked and beside generations."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from pagedserve.engine import LLM  # noqa: E402
from pagedserve.engine.pooling_params import PoolingParams  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402
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
