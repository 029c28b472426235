"""GGUF block-quantized matmul: the torch twin, the compiled CPU op and the entry point against
dequantize-then-matmul, for every supported type; the `gguf` package is the oracle of the formats.

Weights are quantized by `gguf.quants.quantize` (llama.cpp's reference layout; the package cannot
quantize K-quants, so their super-blocks are random bytes with sane scales), so the twin's
dequantization must give the package's bits exactly; the kernels differ from dequantize-then-matmul
only in summation order (float32) or in rounding the dequantized weight to bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from kernels_testutil import k_quant_blocks

gguf = pytest.importorskip("gguf")

from pagedserve import kernels  # noqa: E402
from pagedserve.kernels.cpu import cpu_ops_available  # noqa: E402
from pagedserve.kernels.torch_impl import gguf_quant  # noqa: E402
from pagedserve.kernels.torch_impl.gguf_quant import (  # noqa: E402
    GGUF_QUANT_TYPES,
    dequantize_gguf,
    gguf_linear_torch,
)
from pagedserve.parallel.quant import QuantizedWeight  # noqa: E402

QTYPES = list(GGUF_QUANT_TYPES)
K_QUANTS = [q for q in QTYPES if q.endswith("_K")]


def width(qtype: str, simple: int) -> int:
    """A row width for ``qtype``: ``simple`` (a multiple of 32), or two 256-element super-blocks."""
    return 512 if qtype in K_QUANTS else simple


def quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw block rows, the gguf package's dequantization) of a random [rows, cols] matrix. Row 0 is
    constant and row 1 spans [-8, 7]: a zero range and extreme codes, beside random rows."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype in K_QUANTS:
        raw = k_quant_blocks(qtype, rows, cols, rng)
    else:
        w = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        w[0] = 0.25
        if rows > 1:
            w[1] = np.resize(np.arange(-8, 8, dtype=np.float32), cols)
        raw = gguf.quants.quantize(w, qt)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(rows, cols))


def reference(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    return (x.double() @ deq.double().t())


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.abs().max().item() + 1e-6
    err = (out.double() - ref).abs().max().item()
    assert err <= (2e-5 if dtype == torch.float32 else 2e-2) * scale, (err, scale)


@pytest.mark.parametrize("qtype", QTYPES)
def test_twin_dequantizes_to_the_gguf_package_bits(qtype):
    k = width(qtype, 96)
    raw, deq = quantized(qtype, 37, k)
    assert torch.equal(dequantize_gguf(raw, qtype), deq)
    assert dequantize_gguf(raw, qtype, torch.bfloat16).dtype == torch.bfloat16
    three_d = raw.reshape(37, 1, -1)
    assert torch.equal(dequantize_gguf(three_d, qtype), deq.reshape(37, 1, k))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_twin_matches_dequantize_then_matmul_in_tiles(qtype, m, monkeypatch):
    k = width(qtype, 64)
    monkeypatch.setattr(gguf_quant, "TILE_ELEMENTS", 7 * k)  # several row tiles, the last one short
    raw, deq = quantized(qtype, 45, k, seed=m)
    x = torch.randn(m, k)
    out = gguf_linear_torch(x, raw, qtype, k)
    assert out.shape == (m, 45) and out.dtype == torch.float32
    # Up to summation order: a tile's matmul may sum in another order than the whole one (it failed
    # assert_close's float32 tolerance now and then, with x drawn from whatever seed the tests before left).
    close(out, x.double() @ deq.double().t(), torch.float32)
    batched = gguf_linear_torch(x.reshape(1, m, k), raw, qtype, k)
    assert batched.shape == (1, m, 45)


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 15, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_op_matches_dequantize_then_matmul(qtype, m, dtype):
    n, k = 37, width(qtype, 96)  # N neither a multiple of the 4-row unroll nor of 32
    raw, deq = quantized(qtype, n, k, seed=m)
    x = torch.randn(m, k).to(dtype)
    out = torch.ops.pagedserve.gguf_linear(x, raw, GGUF_QUANT_TYPES[qtype][0], k)
    assert out.shape == (m, n) and out.dtype == dtype
    close(out, reference(x, deq), dtype)


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
@pytest.mark.parametrize("m", [1, 64])
def test_compiled_op_on_a_model_sized_matrix_in_several_tiles(m):
    # 576 columns and 4000 rows: several 16-row work chunks per thread and several 2 MiB prefill tiles
    # (4.6 MB of bf16, 9.2 MB of float32), the last one shorter.
    raw, deq = quantized("Q4_1", 4000, 576, seed=3)
    x = torch.randn(m, 576)
    close(torch.ops.pagedserve.gguf_linear(x, raw, 3, 576), reference(x, deq), torch.float32)
    xb = x.to(torch.bfloat16)
    close(torch.ops.pagedserve.gguf_linear(xb, raw, 3, 576), reference(xb, deq), torch.bfloat16)


SIMPLE_QTYPES = [q for q in QTYPES if q not in K_QUANTS]


BF16_BATCH_SHAPES = [(qtype, m, n, k) for qtype in SIMPLE_QTYPES
                     for m, n, k in [(5, 1, 32), (16, 31, 64), (31, 33, 576), (33, 100, 1536), (64, 960, 576),
                                     (200, 70, 96), (256, 64, 64), (257, 40, 64)]]
# K-quants: whole 256-element super-blocks, and from 16 rows (below, CPUs without AMX take the GEMV, which
# multiplies unrounded float32 weights)
BF16_BATCH_SHAPES += [(qtype, m, n, k) for qtype in K_QUANTS
                      for m, n, k in [(16, 1, 256), (31, 33, 512), (64, 96, 768), (256, 40, 256), (257, 17, 256)]]


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
@pytest.mark.parametrize("qtype,m,n,k", BF16_BATCH_SHAPES)
def test_compiled_op_bf16_batches_round_once_from_float32_sums(qtype, m, n, k):
    """bf16 activations at 5-256 rows (the AMX path on CPUs that have it, every type; the tile path elsewhere
    and at 257): the weight dequantized to bf16 (as the gguf package gives it, rounded), the products summed in
    float32 and rounded to bf16 once. Row counts and N off the 16/32-row tiles, K from one block to 48."""
    raw, deq = quantized(qtype, n, k, seed=m + n)
    x = torch.randn(m, k).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        with torch.inference_mode():
            out = torch.ops.pagedserve.gguf_linear(x, raw, GGUF_QUANT_TYPES[qtype][0], k)
    finally:
        torch.set_num_threads(threads)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    exact = x.double() @ deq.to(torch.bfloat16).double().t()
    scale = exact.abs().max().item()
    # One bf16 rounding of each output (2^-8 relative) plus float32 summation order over k terms.
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=scale * k * 2e-7 + 1e-6)


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
def test_amx_path_switch_gives_the_tile_path_result(tmp_path):
    """PAGEDSERVE_CPU_AMX=0 (read once per process) keeps bf16 batches on the tile path: both agree within
    their rounding. On a CPU without AMX the two runs take the same path."""
    script = (
        "import sys, torch\n"
        "from pagedserve.kernels.cpu import cpu_ops_available\n"
        "assert cpu_ops_available()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "raw = torch.randint(0, 256, (96, 18 * 20), dtype=torch.uint8, generator=g)\n"
        "raw.view(96, 18, 20)[:, :, :4] = torch.tensor([0, 0x2c, 0, 0xa8], dtype=torch.uint8)\n"  # d = 1/16, m = -1/32
        "x = torch.randn(64, 576, generator=g).to(torch.bfloat16)\n"
        "torch.save(torch.ops.pagedserve.gguf_linear(x, raw, 3, 576), sys.argv[1])\n"
    )
    outs = []
    for switch in ("1", "0"):
        path = tmp_path / f"out{switch}.pt"
        env = dict(os.environ, PAGEDSERVE_CPU_AMX=switch)
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=300)
        outs.append(torch.load(path))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_op_in_inference_mode_on_several_threads(dtype):
    """The prefill path multiplies tiles on the pool's threads: they must carry the caller's inference
    mode (the engine runs under torch.inference_mode, and writing an inference tensor outside it fails)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        raw, deq = quantized("Q4_K", 300, 512, seed=9)
        x = torch.randn(40, 512).to(dtype)
        with torch.inference_mode():
            out = torch.ops.pagedserve.gguf_linear(x, raw, GGUF_QUANT_TYPES["Q4_K"][0], 512)
        assert out.is_inference()
        close(out, reference(x, deq), dtype)
    finally:
        torch.set_num_threads(threads)


def test_compiled_op_refuses_mismatched_shapes():
    if not cpu_ops_available():
        pytest.skip("compiled CPU ops did not build")
    raw, _ = quantized("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.pagedserve.gguf_linear(torch.randn(1, 64), raw, 8, 60)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.pagedserve.gguf_linear(torch.randn(1, 64), raw, 3, 64)  # Q8_0 rows read as Q4_1


@pytest.mark.parametrize("qtype", QTYPES)
def test_entry_point_uses_the_op_or_the_twin(qtype, monkeypatch):
    k = width(qtype, 64)
    raw, deq = quantized(qtype, 33, k)
    x = torch.randn(2, 3, k)
    out = kernels.gguf_linear(x, raw, qtype, k)
    assert out.shape == (2, 3, 33)
    close(out.reshape(6, 33), reference(x.reshape(6, k), deq), torch.float32)
    monkeypatch.setattr(gguf_quant, "cpu_ops_available", lambda: False)
    torch.testing.assert_close(kernels.gguf_linear(x, raw, qtype, k), x @ deq.t())


def test_entry_point_validates_by_field():
    raw, _ = quantized("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="qtype"):
        kernels.gguf_linear(torch.randn(1, 64), raw, "Q2_K", 64)
    with pytest.raises(ValueError, match="weight"):
        kernels.gguf_linear(torch.randn(1, 64), raw.float(), "Q4_0", 64)
    with pytest.raises(ValueError, match="x: last dim"):
        kernels.gguf_linear(torch.randn(1, 32), raw, "Q4_0", 64)
    with pytest.raises(ValueError, match="in_features"):
        kernels.gguf_linear(torch.randn(1, 48), raw[:, :18], "Q4_0", 48)


@pytest.mark.parametrize("qtype", QTYPES)
def test_embedding_rows_dequantize_to_the_reference(qtype):
    k = width(qtype, 64)
    raw, deq = quantized(qtype, 50, k)
    ids = torch.tensor([[3, 0, 49], [1, 1, 7]])
    out = kernels.gguf_embedding(ids, raw, qtype, k, torch.float32)
    assert torch.equal(out, deq[ids])
    assert kernels.gguf_embedding(ids, raw, qtype, k, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", QTYPES)
def test_tensor_parallel_slices_of_a_quantized_weight(qtype):
    """Rows (column-parallel) and whole blocks of the input (row-parallel: 32 elements, 256 for K-quants)
    stay quantized and equal the slices of the dequantized matrix; a column range inside a block comes
    back dequantized."""
    k = 4 * width(qtype, 32)
    raw, deq = quantized(qtype, 12, k)
    weight = QuantizedWeight(raw.numpy(), qtype, (12, k))
    for tp in (2, 4):
        for rank in range(tp):
            rows = weight[rank * 12 // tp : (rank + 1) * 12 // tp, :]
            assert isinstance(rows, QuantizedWeight) and torch.equal(rows.dequantize(torch.float32),
                                                                      deq[rank * 12 // tp : (rank + 1) * 12 // tp])
            cols = weight[:, rank * k // tp : (rank + 1) * k // tp]
            assert isinstance(cols, QuantizedWeight) and cols.shape == (12, k // tp)
            x = torch.randn(3, k // tp)
            close(kernels.gguf_linear(x, cols.tensor(), qtype, k // tp),
                  reference(x, deq[:, rank * k // tp : (rank + 1) * k // tp]), torch.float32)
    split = weight[:, 16:80]
    assert isinstance(split, torch.Tensor) and torch.equal(split, deq[:, 16:80])
    order = np.array([3, 1, 2, 0] + list(range(4, 12)))
    assert torch.equal(weight.take_rows(order).dequantize(torch.float32), deq[order])


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_embedding_lookup_gives_the_twins_rows(qtype, dtype):
    """The compiled lookup returns, bit for bit, the rows the torch twin dequantizes, for any ids shape and
    integer dtype, repeated ids included, and `kernels.gguf_embedding` takes it on the CPU. Bit for bit on
    every path: a scale times a block's integer is exact in float32 (an f16 scale's 11 significant bits,
    times a K-quant sub-scale's at most 7 and an integer's at most 6: at most 24), so whether a
    path fuses it with the min's add (the vector paths do) or not (the twin), the one rounding is the add's."""
    dim = width(qtype, 96)
    raw, deq = quantized(qtype, 23, dim, seed=5)
    code = GGUF_QUANT_TYPES[qtype][0]
    for ids in (torch.tensor([0, 1, 22, 7, 7]), torch.tensor([[3, 0, 1], [22, 22, 5]], dtype=torch.int32),
                torch.tensor(11)):
        out = torch.ops.pagedserve.gguf_embedding(ids, raw, code, dim, dtype)
        twin = gguf_quant.dequantize_gguf(raw[ids.long()], qtype, dtype)
        assert out.shape == (*ids.shape, dim) and out.dtype == dtype
        assert torch.equal(kernels.gguf_embedding(ids, raw, qtype, dim, dtype), out)
        assert torch.equal(out, twin)
        if dtype == torch.float32:
            assert torch.equal(out, deq[ids.long()])  # the gguf package's dequantization
    none = torch.tensor([], dtype=torch.long)
    empty = torch.ops.pagedserve.gguf_embedding(none, raw, code, dim, dtype)
    assert empty.shape == gguf_quant.dequantize_gguf(raw[none], qtype, dtype).shape == (0, dim)


@pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops did not build")
def test_compiled_embedding_lookup_refuses_ids_out_of_range():
    raw, _ = quantized("Q8_0", 4, 64)
    for bad in ([0, 4], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            kernels.gguf_embedding(torch.tensor(bad), raw, "Q8_0", 64, torch.float32)
