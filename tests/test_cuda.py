"""What only a GPU can show: seeded sampling on CUDA generators, KV sizing from the device's memory, and
greedy parity with HF in float32 on the Triton kernels. Skipped where CUDA is absent (this repository's CI
machine); run them on a GPU with `python -m pytest tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (5, 17, 40)]


def _llm(path, **overrides) -> LLM:
    return LLM(**{"model": str(path), "device": "cuda", "dtype": "float32", **overrides})


def test_seeded_requests_sample_on_cuda_and_do_not_depend_on_the_batch(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory="256MiB")
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = llm.generate(PROMPTS, [seeded, noisy, noisy], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_kv_cache_is_sized_from_gpu_memory(tiny_llama):
    import gc

    free, total = torch.cuda.mem_get_info()
    blocks = []
    for share in (0.05, 0.10):
        llm = _llm(tiny_llama, gpu_memory_utilization=share + (total - free) / total)
        blocks.append(llm.llm_engine.engine_core.num_blocks)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 0 < blocks[0] < blocks[1]


def test_greedy_matches_hf_on_cuda(tiny_llama):
    from tests.test_engine_parity import _hf_model, hf_greedy

    llm = _llm(tiny_llama, kv_cache_memory="256MiB")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = _hf_model(tiny_llama)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt["prompt_token_ids"], 10)


def test_decode_cuda_graphs_replay_what_the_eager_forward_computes(tiny_model_factory, monkeypatch):
    """Captured decode graphs (split-K over 4 partitions at max_model_len 2048) give the eager run's greedy
    tokens when the engine's decode steps replay them, and its hidden states for a padded batch."""
    from pagedserve.engine.layers.attention_metadata import AttentionMetadata
    from pagedserve.engine.worker.cuda_graphs import CUDAGraphRunner
    from tests.test_cuda_graphs import route_through_runner_graphs

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    llm = _llm(model, kv_cache_memory="256MiB", max_model_len=2048, max_num_seqs=8, enforce_eager=True,
               enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    config = runner.config.model_copy(update={"enforce_eager": False, "cuda_graph_sizes": [1, 2, 4, 8]})
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, config, runner.device)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    routed = route_through_runner_graphs(runner, graphs, monkeypatch)
    graphed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert graphed == eager
    assert 3 in routed

    # One padded batch (3 -> 4 rows) against the eager forward; slot -1 keeps the cache as it is.
    device, bs = runner.device, runner.block_size
    seq_lens = [20, 600, 7]
    width = -(-max(seq_lens) // bs)
    tables = torch.stack([torch.arange(1 + i * width, 1 + (i + 1) * width) for i in range(3)]).int().to(device)
    md = AttentionMetadata(
        slot_mapping=torch.full((3,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(4, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables,
        num_decodes=3, num_decode_tokens=3, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=[0, 1, 2, 3], seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor([11, 12, 13], device=device)
    pos = torch.tensor(seq_lens, device=device) - 1
    with torch.inference_mode():
        expected = runner.model.forward(ids, pos, runner.kv_caches, md).clone()
        replayed = graphs.run(ids, pos, md).clone()
    torch.testing.assert_close(replayed, expected, rtol=1e-4, atol=1e-4)
    llm.shutdown()


@pytest.mark.parametrize("qtypes", [{"*": "Q4_1"}, {"*": "Q8_0"}, {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}],
                         ids=["Q4_1", "Q8_0", "Q4_K_M-like"])
def test_quantized_gguf_greedy_matches_hf_on_cuda(tmp_path, tokenizer_dir, qtypes):
    """A GGUF model held quantized on the GPU (uint8 blocks through the Triton dequant-GEMM, CUDA graphs
    on) decodes what HF decodes on the same file dequantized, in float32 (the near-tie rule of the CPU
    tests), with chunked prefill beside decodes."""
    pytest.importorskip("gguf")
    from tests.test_gguf_loader import VOCAB, hf_weights, write_gguf
    from tests.test_gguf_quantized import assert_greedy_matches_hf, write_k_quant_gguf

    path = tmp_path / "m.gguf"
    if qtypes["*"].endswith("_K"):
        write_k_quant_gguf(path, qtypes)
    else:
        write_gguf(path, "llama", hf_weights("llama", tied=True, seed=3), qtypes["*"])
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), device="cuda", dtype="float32",
              max_num_batched_tokens=8, kv_cache_memory="64MiB")
    try:
        assert llm.llm_engine.config.quantization == "gguf"
        down = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers[0].mlp.down_proj
        assert down.weight.is_cuda and down.weight.dtype == torch.uint8
        assert down.qtype == qtypes.get("ffn_down", qtypes["*"])
        rng = torch.Generator().manual_seed(7)
        prompts = [torch.randint(8, VOCAB, (n,), generator=rng).tolist() for n in (3, 11, 17)]
        assert_greedy_matches_hf(llm, path, prompts)
    finally:
        llm.shutdown()
