"""Triton kernels on CPU tensors under TRITON_INTERPRET=1, against the torch twins and naive references."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel modules

import pytest  # noqa: E402
import torch  # noqa: E402
from kernels_testutil import make_paged_batch, naive_paged_attention, tolerance  # noqa: E402

from pagedserve.kernels.torch_impl.activation import silu_and_mul_torch  # noqa: E402
from pagedserve.kernels.torch_impl.attention import (  # noqa: E402
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
)
from pagedserve.kernels.torch_impl.norm import fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402
from pagedserve.kernels.torch_impl.rotary import rotary_embedding_torch  # noqa: E402
from pagedserve.kernels.torch_impl.sampling import apply_top_k_top_p_min_p_torch  # noqa: E402
from pagedserve.kernels.triton.activation import silu_and_mul_triton  # noqa: E402
from pagedserve.kernels.triton.cache import reshape_and_cache_triton  # noqa: E402
from pagedserve.kernels.triton.decode_attention import paged_decode_attention_triton  # noqa: E402
from pagedserve.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from pagedserve.kernels.triton.prefill_attention import paged_prefill_attention_triton  # noqa: E402
from pagedserve.kernels.triton.rotary import rotary_embedding_triton  # noqa: E402
from pagedserve.kernels.triton.sampling import apply_top_k_top_p_min_p_triton  # noqa: E402

from pagedserve import kernels  # noqa: E402


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_reshape_and_cache_triton_matches_twin(key_dtype):
    key_cache = torch.zeros(6, 16, 2, 80, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    twin_k, twin_v = key_cache.clone(), value_cache.clone()
    key, value = torch.randn(7, 2, 80).to(key_dtype), torch.randn(7, 2, 80).to(key_dtype)
    slots = torch.tensor([5, 95, -1, 17, 40, -1, 0])
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    kernels.reshape_and_cache(key, value, twin_k, twin_v, slots)
    # Same dtype: an exact copy. fp32 rows into a bf16 cache: the interpreter's cast may round differently.
    tol = {"atol": 0, "rtol": 0} if key_dtype == torch.bfloat16 else tolerance(torch.bfloat16)
    torch.testing.assert_close(key_cache, twin_k, **tol)
    torch.testing.assert_close(value_cache, twin_v, **tol)
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 5


DECODE_CASES = [  # (num_heads, num_kv_heads, head_size, block_size): GQA ratios 1, 2, 4, 8
    (4, 4, 64, 16),
    (8, 4, 128, 32),
    (8, 2, 80, 32),
    (4, 1, 96, 16),
    (16, 2, 64, 16),
]


def decode_lens(block_size: int) -> list[int]:
    """One token, a block short of full, exactly one block, many blocks (several 64-token tiles)."""
    return [1, block_size - 1, block_size, 5 * block_size + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", DECODE_CASES)
def test_decode_triton_matches_twin_and_naive(dtype, num_heads, num_kv_heads, head_size, block_size):
    seq_lens = decode_lens(block_size)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=11)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_size ** -0.5
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, lens, scale)
    out = paged_decode_attention_triton(*args, partition_size=2 * block_size)  # split-K, partial tiles
    single = paged_decode_attention_triton(*args)  # one partition, direct store
    twin = paged_decode_attention_torch(*args)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), scale)
    for result in (out, single):
        assert result.dtype == dtype
        torch.testing.assert_close(result.double(), ref, **tolerance(dtype))
        torch.testing.assert_close(result.float(), twin.float(), **tolerance(dtype))


@pytest.mark.parametrize("partition_size", [64, 512])
def test_decode_triton_is_graph_safe(partition_size):
    """A captured launch replays with the capture's host values: the same shapes (block-table width) but
    new seq_lens and block_tables contents, and stale seq_lens_cpu. Only the device tensors may matter."""
    width, block_size = 16, 16  # a 256-token table, wider than any context: trailing partitions are empty
    results = []
    for seed, seq_lens in ((1, [3, 150, 16]), (2, [191, 1, 40])):
        batch = make_paged_batch(seq_lens, 2, 64, block_size, torch.float32, seed=seed)
        tables = torch.zeros(3, width, dtype=torch.int32)
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        query = torch.randn(3, 4, 64)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        out = paged_decode_attention_triton(query, batch.key_cache, batch.value_cache, tables, lens, 0.125,
                                            seq_lens_cpu=[1, 1, 1], partition_size=partition_size)
        ref = naive_paged_attention(query, batch, [0, 1, 2, 3], 0.125)
        torch.testing.assert_close(out.double(), ref, **tolerance(torch.float32))
        results.append(out)
    assert not torch.equal(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_triton_sliding_window_split_k(dtype):
    seq_lens = [90, 20, 64]
    batch = make_paged_batch(seq_lens, 2, 64, 16, dtype, seed=12)
    query = torch.randn(3, 4, 64).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_triton(query, batch.key_cache, batch.value_cache, batch.block_tables, lens,
                                        0.125, sliding_window=25, seq_lens_cpu=seq_lens, partition_size=32)
    ref = naive_paged_attention(query, batch, [0, 1, 2, 3], 0.125, sliding_window=25)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_prefill_triton_matches_twin_and_naive(dtype, sliding_window):
    # Full prompt, chunk after a cached prefix, one token, prefix-cache hit, a chunk spanning two query tiles.
    seq_lens, q_lens = [20, 50, 7, 33, 40], [20, 18, 1, 5, 40]
    batch = make_paged_batch(seq_lens, 2, 80, 16, dtype, seed=13)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], 4, 80).to(dtype)
    qsl, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, qsl, lens, 0.11, sliding_window)
    out = paged_prefill_attention_triton(*args, block_m=16)
    twin = paged_prefill_attention_torch(*args)
    ref = naive_paged_attention(query, batch, starts, 0.11, sliding_window)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))
    torch.testing.assert_close(out.float(), twin.float(), **tolerance(dtype))
    if dtype == torch.float32 and sliding_window is None:  # offsets sliced after decode tokens: same result
        shifted = paged_prefill_attention_triton(query, batch.key_cache, batch.value_cache, batch.block_tables,
                                                 qsl + 5, lens, 0.11, block_m=16)
        torch.testing.assert_close(shifted, out, atol=0, rtol=0)


PREFILL_CASES = [  # (num_heads, num_kv_heads, head_size, block_size): GQA ratios 1, 2, 3, 4, 8
    (2, 2, 64, 16),
    (4, 2, 128, 32),
    (6, 2, 80, 16),
    (8, 2, 64, 32),
    (8, 1, 64, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", PREFILL_CASES)
def test_prefill_triton_grouped_heads(dtype, num_heads, num_kv_heads, head_size, block_size):
    """Default query tiles (64 rows of tokens x grouped heads) over one-token, block-1, one-block and
    many-block contexts, with and without a cached prefix, mixed in one batch."""
    bs = block_size
    seq_lens, q_lens = [1, bs - 1, bs, 4 * bs + 5, 3 * bs + 2], [1, bs - 1, 3, 4 * bs + 5, bs + 1]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=14)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_heads, head_size).to(dtype)
    qsl, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, qsl, lens, head_size ** -0.5)
    out = paged_prefill_attention_triton(*args)
    ref = naive_paged_attention(query, batch, starts, head_size ** -0.5)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))
    torch.testing.assert_close(out.float(), paged_prefill_attention_torch(*args).float(), **tolerance(dtype))


def close_tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: same math, maybe another summation order. Low precision: the interpreter's casts to bf16/fp16
    # do not round like torch's, so allow dtype-level differences.
    return {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_triton_matches_twin(dtype):
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5), **close_tol(dtype))
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_summed = fused_add_rms_norm_torch(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, **close_tol(dtype))
    torch.testing.assert_close(normed, ref_normed, **close_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_triton_matches_twin(dtype, is_neox, rotary_dim):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    cache = kernels.compute_rope_cos_sin_cache(rotary_dim, 200, 500000.0, scaling, torch.float32)
    positions = torch.tensor([0, 3, 199, 57, 8])
    q, k = torch.randn(5, 6 * 32).to(dtype), torch.randn(5, 2 * 32).to(dtype)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache, 32, is_neox)
    q_ref, k_ref = rotary_embedding_torch(positions, q, k, cache, 32, is_neox)
    torch.testing.assert_close(q_out, q_ref, **close_tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **close_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_triton_matches_twin(dtype):
    x = torch.randn(3, 4, 2 * 40).to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), **close_tol(dtype))


@pytest.mark.parametrize("which", ["all", "top_k", "top_p", "min_p", "none"])
def test_top_k_top_p_min_p_triton_matches_twin(which):
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 300, generator=gen) * 4
    logits[2, 10:20] = float("-inf")  # already-banned tokens stay banned
    top_k = torch.tensor([0, 1, 5, 300, 400, 50], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.99, 0.05])
    min_p = torch.tensor([0.0, 0.2, 0.05, 0.0, 0.5, 1.0])
    args = {
        "all": (top_k, top_p, min_p), "top_k": (top_k, None, None), "top_p": (None, top_p, None),
        "min_p": (None, None, min_p), "none": (None, None, None),
    }[which]
    out = apply_top_k_top_p_min_p_triton(logits, *args, block=128)  # several tiles per row
    twin = apply_top_k_top_p_min_p_torch(logits, *args)
    assert torch.equal(out, twin)


def test_top_k_top_p_min_p_triton_edge_rows(monkeypatch):
    """Ties at every threshold, -inf entries, a row with one finite token, an all -inf row, vocab 301
    (not a power of two), k past the topk candidate limit (those rows take the full sort), and top-p
    rows with and without top-k in one batch."""
    import pagedserve.kernels.triton.sampling as sampling_mod

    monkeypatch.setattr(sampling_mod, "TOPK_CANDIDATES", 8)  # k = 20 and k = 9 rows then sort whole rows
    gen = torch.Generator().manual_seed(22)
    vocab = 301
    logits = (torch.randn(9, vocab, generator=gen) * 3).round()  # integers: many ties
    logits[0, 0], logits[0, 1:200] = 10.0, 5.0  # ties at the k-th past the candidates carry top-p mass
    logits[1, :] = float("-inf")
    logits[1, 7] = 2.0  # everything but one token masked
    logits[2, ::2] = float("-inf")
    logits[3, :] = float("-inf")  # nothing finite: the twin keeps the row as it is
    logits[4, :] = 1.0  # all tied
    logits[5, :40] = 9.0  # 40-way tie at the top: top-k 3 keeps all 40
    top_k = torch.tensor([3, 2, 5, 4, 1, 3, 0, 20, 9], dtype=torch.int32)
    top_p = torch.tensor([0.7, 0.5, 0.3, 0.9, 0.5, 0.2, 0.6, 0.8, 1.0])
    min_p = torch.tensor([0.1, 0.0, 0.3, 0.5, 0.9, 0.0, 0.05, 0.2, 0.0])
    for args in ((top_k, top_p, min_p), (top_k, None, None), (None, top_p, None), (top_k, top_p, None),
                 (None, None, min_p)):
        out = apply_top_k_top_p_min_p_triton(logits, *args, block=64)
        assert torch.equal(out, apply_top_k_top_p_min_p_torch(logits, *args)), args
    assert int(torch.isfinite(apply_top_k_top_p_min_p_triton(logits, top_k, None, None)[5]).sum()) == 40


def test_top_k_top_p_min_p_triton_large_vocab():
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(3, 32000, generator=gen) * 5
    top_k = torch.tensor([50, 0, 1000], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.95, 0.5])
    min_p = torch.tensor([0.0, 0.01, 0.1])
    out = apply_top_k_top_p_min_p_triton(logits, top_k, top_p, min_p)
    assert torch.equal(out, apply_top_k_top_p_min_p_torch(logits, top_k, top_p, min_p))
    assert 0 < int(torch.isfinite(out[1]).sum()) < 32000  # the top-p-only row was cut


def test_dispatch_picks_triton_for_cuda_tensors(monkeypatch):
    """Entry points route CUDA tensors to the Triton launchers (spied here: no GPU on CI) and CPU to the twin."""
    import pagedserve.kernels.triton.decode_attention as decode_mod
    import pagedserve.kernels.triton.norm as norm_mod

    calls = []
    monkeypatch.setattr(decode_mod, "paged_decode_attention_triton", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(norm_mod, "rms_norm_triton", lambda *a, **k: calls.append("rms"))
    query = torch.randn(1, 2, 16)
    key_cache = torch.randn(2, 16, 2, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    kernels.paged_decode_attention(query, key_cache, key_cache, table, lens, 1.0)
    kernels.rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6)
    assert calls == ["decode", "rms"]
    monkeypatch.undo()
    assert kernels.rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6).shape == (2, 16)
    assert calls == ["decode", "rms"]
