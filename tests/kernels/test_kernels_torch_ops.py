"""The torch twins (the CPU path; the fallback where the compiled CPU ops cannot build) against naive
references and HF transformers. The compiled ops have their own file: test_cpu_ops.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_paged_attention, tolerance

from pagedserve import kernels
from pagedserve.kernels.torch_impl.attention import paged_decode_attention_gather, paged_decode_attention_torch
from pagedserve.kernels.torch_impl.norm import fused_add_rms_norm_torch, rms_norm_torch

# The CPU decode twin (compiled op where built) and its pure-torch path (the fallback), tested alike.
DECODE_CPU_IMPLS = pytest.mark.parametrize(
    "decode", [paged_decode_attention_torch, paged_decode_attention_gather], ids=["twin", "gather"]
)



def test_reshape_and_cache_writes_slots_and_skips_padding():
    num_blocks, block_size, hkv, d = 5, 4, 2, 8
    key_cache = torch.zeros(num_blocks, block_size, hkv, d)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    slots = torch.tensor([13, -1, 0, 7], dtype=torch.int64)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(key_cache[slot // block_size, slot % block_size], key[t])
            torch.testing.assert_close(value_cache[slot // block_size, slot % block_size], value[t])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3  # only three slots written


@DECODE_CPU_IMPLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 64, 16), (8, 2, 80, 32), (4, 1, 96, 16), (4, 2, 128, 32)],
)
def test_decode_twin_matches_naive(decode, dtype, num_heads, num_kv_heads, head_size, block_size):
    seq_lens = [1, 17, 45, 33]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=1)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    scale = head_size ** -0.5
    out = decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor(seq_lens, dtype=torch.int32), scale,
    )
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@DECODE_CPU_IMPLS
@pytest.mark.parametrize("with_cpu_lens", [True, False])
def test_decode_twin_sliding_window(decode, with_cpu_lens):
    seq_lens = [40, 70, 5]
    batch = make_paged_batch(seq_lens, 2, 64, 16, torch.float32, seed=2)
    query = torch.randn(3, 4, 64)
    out = decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor(seq_lens, dtype=torch.int32), 0.125, sliding_window=20,
        seq_lens_cpu=seq_lens if with_cpu_lens else None,
    )
    ref = naive_paged_attention(query, batch, [0, 1, 2, 3], 0.125, sliding_window=20)
    torch.testing.assert_close(out.double(), ref, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 9, 64])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_prefill_twin_matches_naive(dtype, sliding_window, pass_new_kv):
    # (context after step, new tokens): full prompt, chunk after a cached prefix, single token, prefix-cache hit,
    # and a second whole prompt (with pass_new_kv, whole prompts attend over the new K/V without a gather).
    seq_lens, q_lens = [20, 50, 7, 33, 12], [20, 18, 1, 5, 12]
    batch = make_paged_batch(seq_lens, 2, 64, 16, dtype, seed=3)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], 8, 64).to(dtype)
    new_kv = {}
    if pass_new_kv:  # the rows the step just wrote: the last q_len positions of each sequence
        from kernels_testutil import dense_context

        keys, values = [], []
        for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
            keys.append(dense_context(batch.key_cache, batch.block_tables[i], seq_len)[seq_len - q_len:])
            values.append(dense_context(batch.value_cache, batch.block_tables[i], seq_len)[seq_len - q_len:])
        new_kv = {"key": torch.cat(keys).to(dtype), "value": torch.cat(values).to(dtype)}
    out = kernels.paged_prefill_attention(
        query, batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.125,
        sliding_window=sliding_window, **new_kv,
    )
    ref = naive_paged_attention(query, batch, starts, 0.125, sliding_window)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    # The twin bit for bit; the entry point (the compiled CPU op, its own float32 order for the sum of
    # squares) up to that order.
    torch.testing.assert_close(rms_norm_torch(x, hf.weight.data, 1e-6), hf(x), atol=0, rtol=0)
    normed, summed = fused_add_rms_norm_torch(x, residual, hf.weight.data, 1e-6)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, hf(x + residual), atol=0, rtol=0)
    torch.testing.assert_close(kernels.rms_norm(x, hf.weight.data, 1e-6), hf(x))
    normed, summed = kernels.fused_add_rms_norm(x, residual, hf.weight.data, 1e-6)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, hf(x + residual))


ROPE_CASES = [
    None,
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("rope_scaling", ROPE_CASES)
def test_rope_cache_matches_hf(rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, max_pos = 32, 10000.0, 300
    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])
    cache = kernels.compute_rope_cos_sin_cache(head_dim, max_pos, theta, rope_scaling, torch.float32)
    assert cache.shape == (max_pos, head_dim)
    # Exactly HF's frequencies, angles and scale, its position x frequency product as one IEEE float32
    # multiply (HF's own float32 matmul of that product has been off by 1.5e-4 at position 300 when the CPU
    # backend picked a reduced-precision kernel: HF's output is checked more loosely below).
    angles = (torch.arange(max_pos, dtype=torch.float32)[:, None] * rotary.inv_freq.float()[None, :]).double()
    scale = float(rotary.attention_scaling)
    torch.testing.assert_close(cache[:, : head_dim // 2].double(), angles.cos() * scale, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2:].double(), angles.sin() * scale, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2], atol=5e-4, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2:], sin[0, :, : head_dim // 2], atol=5e-4, rtol=0)


def test_rope_cache_llama3_inv_freq_uses_hf_init_function():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                         rope_parameters={**scaling, "rope_theta": 500000.0})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0
    cache = kernels.compute_rope_cos_sin_cache(64, 4096, 500000.0, scaling, torch.float32)
    freqs = torch.arange(4096, dtype=torch.float)[:, None] * inv_freq[None]
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), -1), atol=0, rtol=0)


def test_rope_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="dynamic"):
        kernels.compute_rope_cos_sin_cache(16, 10, 10000.0, {"type": "dynamic", "factor": 2.0}, torch.float32)
    with pytest.raises(ValueError, match="factor"):
        kernels.compute_rope_cos_sin_cache(16, 10, 10000.0, {"rope_type": "linear"}, torch.float32)


def test_rotary_neox_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_size, num_heads, num_kv_heads, tokens = 32, 4, 2, 9
    cache = kernels.compute_rope_cos_sin_cache(head_size, 128, 10000.0, None, torch.float32)
    positions = torch.randint(0, 128, (tokens,))
    q, k = torch.randn(tokens, num_heads * head_size), torch.randn(tokens, num_kv_heads * head_size)
    q_out, k_out = kernels.rotary_embedding(positions, q, k, cache, head_size, is_neox=True)
    cos, sin = cache[positions].chunk(2, -1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # [1, T, D]
    hq = q.view(tokens, num_heads, head_size).transpose(0, 1)[None]  # [1, H, T, D]
    hk = k.view(tokens, num_kv_heads, head_size).transpose(0, 1)[None]
    ref_q, ref_k = apply_rotary_pos_emb(hq, hk, cos, sin)
    torch.testing.assert_close(q_out, ref_q[0].transpose(0, 1).reshape(q.shape), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, ref_k[0].transpose(0, 1).reshape(k.shape), atol=1e-6, rtol=0)


def rotary_reference(positions, x, cache, head_size, is_neox):
    """Pairwise rotation written out element by element: pair (a, b) -> (a cos - b sin, b cos + a sin)."""
    rot = cache.shape[1]
    heads = x.view(x.shape[0], -1, head_size).double().clone()
    for t, pos in enumerate(positions.tolist()):
        for i in range(rot // 2):
            c, s = float(cache[pos, i]), float(cache[pos, rot // 2 + i])
            ia, ib = (i, i + rot // 2) if is_neox else (2 * i, 2 * i + 1)
            a, b = heads[t, :, ia].clone(), heads[t, :, ib].clone()
            heads[t, :, ia], heads[t, :, ib] = a * c - b * s, b * c + a * s
    return heads.reshape(x.shape)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_layouts_and_partial_rotary(is_neox, rotary_dim):
    head_size = 16
    cache = kernels.compute_rope_cos_sin_cache(rotary_dim, 64, 10000.0, None, torch.float32)
    positions = torch.tensor([0, 5, 63, 7])
    q, k = torch.randn(4, 3 * head_size), torch.randn(4, head_size)
    q_out, k_out = kernels.rotary_embedding(positions, q, k, cache, head_size, is_neox=is_neox)
    torch.testing.assert_close(q_out.double(), rotary_reference(positions, q, cache, head_size, is_neox))
    torch.testing.assert_close(k_out.double(), rotary_reference(positions, k, cache, head_size, is_neox))


def test_silu_and_mul_matches_hf_mlp_activation():
    from transformers.activations import ACT2FN

    x = torch.randn(3, 5, 2 * 24)
    torch.testing.assert_close(kernels.silu_and_mul(x), ACT2FN["silu"](x[..., :24]) * x[..., 24:])
    with pytest.raises(ValueError, match="even"):
        kernels.silu_and_mul(torch.randn(2, 7))


def naive_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    """Row by row, in fp64, straight from the definitions in kernels.torch_impl.sampling."""
    out = logits.clone()
    vocab = logits.shape[1]
    for r in range(logits.shape[0]):
        row = logits[r].double()
        keep = torch.ones(vocab, dtype=torch.bool)
        k = int(top_k[r]) if top_k is not None else 0
        if 0 < k < vocab:
            keep &= row >= row.sort(descending=True).values[k - 1]
        p = float(top_p[r]) if top_p is not None else 1.0
        if p < 1.0:
            probs = torch.softmax(row.masked_fill(~keep, -math.inf), 0)
            mass_above = torch.stack([probs[probs > probs[i]].sum() for i in range(vocab)])
            keep &= mass_above < p
        mp = float(min_p[r]) if min_p is not None else 0.0
        if mp > 0:
            probs = torch.softmax(row.masked_fill(~keep, -math.inf), 0)
            keep &= probs >= mp * probs.max()
        out[r, ~keep] = -math.inf
    return out


@pytest.mark.parametrize("which", ["all", "top_k", "top_p", "min_p", "none"])
def test_top_k_top_p_min_p_matches_naive(which):
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 6, 50
    logits = torch.randn(batch, vocab, generator=gen) * 3
    top_k = torch.tensor([0, 1, 5, 50, 60, 10])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.99, 0.05])
    min_p = torch.tensor([0.0, 0.2, 0.05, 0.0, 0.5, 1.0])
    args = {
        "all": (top_k, top_p, min_p), "top_k": (top_k, None, None), "top_p": (None, top_p, None),
        "min_p": (None, None, min_p), "none": (None, None, None),
    }[which]
    out = kernels.apply_top_k_top_p_min_p(logits, *args)
    ref = naive_top_k_top_p_min_p(logits, *args)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    torch.testing.assert_close(out[~torch.isinf(out)], logits[~torch.isinf(out)], atol=0, rtol=0)
    assert bool((~torch.isinf(out)).any(-1).all())  # at least one token per row
    assert bool((out.argmax(-1) == logits.argmax(-1)).all())


def test_entry_points_reject_bad_shapes():
    with pytest.raises(ValueError, match="key_cache"):
        kernels.paged_decode_attention(torch.randn(2, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 4, 8),
                                       torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.paged_decode_attention(torch.randn(2, 4, 8), torch.randn(3, 4, 3, 8), torch.randn(3, 4, 3, 8),
                                       torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.reshape_and_cache(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.zeros(2, 4, 1, 8),
                                  torch.zeros(2, 4, 1, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="top_p"):
        kernels.apply_top_k_top_p_min_p(torch.randn(2, 5), None, torch.ones(3), None)
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.paged_decode_attention(torch.randn(1, 2, 8), torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8),
                                       torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
                                       sliding_window=0)


CPU_PATH_SCRIPT = """
import sys, torch
from pagedserve import kernels
q = torch.randn(2, 4, 16); kc = torch.randn(4, 16, 2, 16); vc = torch.randn(4, 16, 2, 16)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32); sl = torch.tensor([20, 3], dtype=torch.int32)
kernels.reshape_and_cache(torch.randn(2, 2, 16), torch.randn(2, 2, 16), kc, vc, torch.tensor([0, -1]))
kernels.paged_decode_attention(q, kc, vc, bt, sl, 0.25)
kernels.paged_prefill_attention(torch.randn(5, 4, 16), kc, vc, bt, torch.tensor([0, 4, 5], dtype=torch.int32), sl, 0.25)
kernels.rms_norm(torch.randn(3, 16), torch.ones(16), 1e-6)
kernels.fused_add_rms_norm(torch.randn(3, 16), torch.randn(3, 16), torch.ones(16), 1e-6)
cache = kernels.compute_rope_cos_sin_cache(16, 32, 10000.0, None, torch.float32)
kernels.rotary_embedding(torch.tensor([1, 2]), torch.randn(2, 64), torch.randn(2, 32), cache, 16)
kernels.silu_and_mul(torch.randn(3, 8))
kernels.apply_top_k_top_p_min_p(torch.randn(2, 9), torch.tensor([2, 0]), torch.tensor([0.9, 1.0]),
                                torch.tensor([0.1, 0.0]))
print(sorted(m for m in sys.modules if m == "triton" or m.startswith(("triton.", "pagedserve.kernels.triton"))))
"""


def test_cpu_path_never_imports_triton(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CPU_PATH_SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_decode_twin_grouping_is_invisible(sliding_window):
    """Tiny gather budgets split the batch into many groups; the result must not change."""
    seq_lens = [3, 64, 17, 100, 1, 48]
    batch = make_paged_batch(seq_lens, 2, 64, 16, torch.float32, seed=4)
    query = torch.randn(len(seq_lens), 4, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), 0.125, sliding_window)
    for budget in (1, 40_000, 200_000, 1 << 30):
        out = paged_decode_attention_gather(query, batch.key_cache, batch.value_cache, batch.block_tables, lens,
                                           0.125, sliding_window, seq_lens, gather_budget_bytes=budget)
        torch.testing.assert_close(out.double(), ref, **tolerance(torch.float32))


def test_prefill_accepts_offsets_sliced_after_decodes():
    """The runner may pass query_start_loc[num_decodes:] un-rebased with query[num_decode_tokens:]."""
    seq_lens = [30, 12]  # query lengths 6 and 12
    batch = make_paged_batch(seq_lens, 1, 64, 16, torch.float32, seed=6)
    query = torch.randn(18, 2, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables)
    rebased = kernels.paged_prefill_attention(*args, torch.tensor([0, 6, 18], dtype=torch.int32), lens, 0.125)
    offset = kernels.paged_prefill_attention(*args, torch.tensor([3, 9, 21], dtype=torch.int32), lens, 0.125,
                                             query_start_loc_cpu=[3, 9, 21])
    torch.testing.assert_close(offset, rebased, atol=0, rtol=0)
    torch.testing.assert_close(rebased.double(), naive_paged_attention(query, batch, [0, 6, 18], 0.125),
                               **tolerance(torch.float32))
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.paged_prefill_attention(*args, torch.tensor([0, 6, 17], dtype=torch.int32), lens, 0.125,
                                        query_start_loc_cpu=[0, 6, 17])
