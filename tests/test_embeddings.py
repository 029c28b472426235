"""Embeddings from the served decoder model (`LLM.embed`, `AsyncLLM.encode`): the pooled final-norm hidden
states equal HF transformers' on the same weights, whatever batch, chunking or prefix-cache hit they are
computed in; the inputs an embedding refuses; every KV block free again afterwards."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.outputs import EmbeddingRequestOutput
from pagedserve.engine.pooling_params import PoolingParams

HIDDEN = 64  # tests/tiny_models.py
LONG = "the quick brown fox jumps over the lazy dog while the engine computes every position of this prompt"
PROMPTS = [LONG, "hello world", "a", "embedding vectors for retrieval pipelines " * 3]


def engine_kwargs(**overrides) -> dict:
    return {"dtype": "float32", "kv_cache_memory": "16MiB", "block_size": 4, "max_model_len": 128,
            "seed": 0, **overrides}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_model(model):
    return transformers.AutoModel.from_pretrained(str(model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model):
    # A small token budget: the long prompts are prefilled in several chunks.
    engine = LLM(str(model), **engine_kwargs(max_num_batched_tokens=16))
    yield engine
    engine.shutdown()


def reference(hf_model, token_ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """HF's last hidden states (after the model's final norm), pooled."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([token_ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0).item()


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_hf_reference(llm, hf_model, pooling):
    outputs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.finished and out.error is None and out.prompt == prompt
        vector = torch.tensor(out.outputs.embedding)
        assert vector.shape == (HIDDEN,)
        assert abs(vector.norm().item() - 1.0) < 1e-5  # normalized by default
        assert cosine(vector, reference(hf_model, out.prompt_token_ids, pooling)) > 0.9999
    assert len(outputs[0].prompt_token_ids) > 16  # it was chunked
    assert_all_blocks_free(llm)


def test_unnormalized_and_truncated(llm, hf_model):
    raw, cut = llm.embed([LONG, LONG], [PoolingParams(pooling_type="mean", normalize=False),
                                        PoolingParams(pooling_type="mean", dimensions=8)], use_tqdm=False)
    expected = reference(hf_model, raw.prompt_token_ids, "mean", normalize=False)
    assert torch.allclose(torch.tensor(raw.outputs.embedding), expected, atol=1e-4)
    assert len(cut.outputs.embedding) == 8
    expected_cut = torch.nn.functional.normalize(expected[:8], dim=0)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), expected_cut, atol=1e-4)


def test_engine_defaults_from_config(model, hf_model):
    llm = LLM(str(model), **engine_kwargs(pooling="mean", normalize_embeddings=False))
    try:
        (out,) = llm.embed("hello world", use_tqdm=False)
        expected = reference(hf_model, out.prompt_token_ids, "mean", normalize=False)
        assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=1e-4)
    finally:
        llm.shutdown()


def run_mixed(llm: LLM, embed_prompts: list[dict], gen_prompts: list[str], pooling: str) -> tuple[dict, dict]:
    """Embeddings and greedy generations added together and stepped as one continuous batch."""
    engine = llm.llm_engine
    embeddings: dict[str, EmbeddingRequestOutput] = {}
    texts: dict[str, list[int]] = {}
    for i, prompt in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for i, prompt in enumerate(embed_prompts):
        engine.add_request(f"emb-{i}", prompt, PoolingParams(pooling_type=pooling))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, EmbeddingRequestOutput):
                embeddings[out.request_id] = out
            elif out.finished:
                texts[out.request_id] = out.outputs[0].token_ids
    return embeddings, texts


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batch_independent_with_chunks_and_prefix_hits(llm, pooling):
    """The same input alone, and beside generations and a request that shares its prefix (a prefix-cache
    hit), chunked by a small token budget: the same vector; the generations are what they are alone."""
    alone = llm.embed(LONG, PoolingParams(pooling_type=pooling), use_tqdm=False)[0].outputs.embedding
    gen_alone = [o.outputs[0].token_ids for o in llm.generate(
        ["hello world", "a b c d e f"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    llm.reset_prefix_cache()
    ids = llm.embed(LONG, use_tqdm=False)[0].prompt_token_ids  # (also caches the prompt's blocks)
    embeddings, texts = run_mixed(llm, [{"prompt_token_ids": ids}, {"prompt_token_ids": ids}],
                                  ["hello world", "a b c d e f"], pooling)
    for out in embeddings.values():
        assert out.error is None
        assert torch.allclose(torch.tensor(out.outputs.embedding), torch.tensor(alone), atol=1e-5)
        if pooling == "last":
            assert out.num_cached_tokens > 0  # it read the cached prefix
        else:
            assert out.num_cached_tokens == 0  # mean pooling recomputes every position
    assert [texts["gen-0"], texts["gen-1"]] == gen_alone
    assert_all_blocks_free(llm)


def test_prompt_may_fill_max_model_len(model, hf_model):
    llm = LLM(str(model), **engine_kwargs(max_model_len=16))
    try:
        ids = list(range(5, 21))
        (out,) = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
        assert cosine(out.outputs.embedding, reference(hf_model, ids, "last")) > 0.9999
        with pytest.raises(ValueError, match="^prompt: .*17 tokens.*max_model_len is 16"):
            llm.embed({"prompt_token_ids": ids + [5]}, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": []}, PoolingParams(), "^prompt: the prompt is empty"),
    ({"prompt_token_ids": [1, 10**6]}, PoolingParams(), "^prompt_token_ids: token id 1000000"),
    ("hello", PoolingParams(dimensions=HIDDEN + 1), "^dimensions: "),
])
def test_bad_input_raises_naming_the_field(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.embed(["hello", prompt], params, use_tqdm=False)
    assert_all_blocks_free(llm)  # the good prompt before it was aborted


def test_pooling_params_validation():
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(model="x", pooling="max")


def test_async_scheduling_engine(model, hf_model):
    """With a step scheduled ahead, an embedding leaves no placeholder decode behind."""
    llm = LLM(str(model), **engine_kwargs(async_scheduling=True, max_num_batched_tokens=16))
    try:
        embeddings, texts = run_mixed(llm, [LONG, "hello world"], ["a b c"], "mean")
        for out in embeddings.values():
            assert cosine(out.outputs.embedding, reference(hf_model, out.prompt_token_ids, "mean")) > 0.9999
        assert len(texts["gen-0"]) == 12
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_async_llm_encode(model, hf_model):
    async def main() -> tuple[list, list]:
        engine = AsyncLLM(EngineConfig(model=str(model), **engine_kwargs()))
        try:
            async def embed(prompt):
                return [o async for o in engine.encode(prompt, PoolingParams(pooling_type="mean"))]

            async def generate():
                return [o async for o in engine.generate("hello", SamplingParams(max_tokens=4))]

            results = await asyncio.gather(embed(LONG), embed("hello world"), generate())
            with pytest.raises(ValueError, match="^dimensions"):
                [o async for o in engine.encode("x", PoolingParams(dimensions=10**4))]
            return results, engine.engine.get_stats()
        finally:
            engine.shutdown()

    (first, second, gen), stats = asyncio.run(main())
    for outs in (first, second):
        assert len(outs) == 1 and outs[0].finished
        assert cosine(outs[0].outputs.embedding, reference(hf_model, outs[0].prompt_token_ids, "mean")) > 0.9999
    assert gen[-1].finished
    assert stats.num_free_blocks == stats.num_total_blocks


def test_cli_flags_reach_the_engine(model):
    from pagedserve.cluster.cli import build_parser, serve_args_from

    ns = build_parser().parse_args(["serve", str(model), "--pooling", "mean", "--no-normalize-embeddings"])
    kwargs = serve_args_from(ns).engine_kwargs()
    assert kwargs["pooling"] == "mean" and kwargs["normalize_embeddings"] is False
    assert EngineConfig(**kwargs).pooling == "mean"


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_preempted_embeddings_start_again(model, hf_model, pooling):
    """A KV cache too small for everyone: requests are preempted and recomputed, embeddings included,
    and the vectors are still HF's (what a preempted request had gathered is dropped)."""
    llm = LLM(str(model), **engine_kwargs(num_kv_blocks=14, max_num_batched_tokens=8))
    try:
        embeddings, texts = run_mixed(llm, [LONG, LONG + " again"], ["a b c", "hello world"], pooling)
        assert llm.get_stats().num_preemptions > 0
        for out in embeddings.values():
            assert out.error is None
            assert cosine(out.outputs.embedding, reference(hf_model, out.prompt_token_ids, pooling)) > 0.9999
        assert all(len(t) == 12 for t in texts.values())
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
