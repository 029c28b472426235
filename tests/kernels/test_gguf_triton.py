"""The Triton GGUF dequant-GEMM under TRITON_INTERPRET=1 on CPU tensors, against the torch twin."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel modules

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("gguf")

from test_gguf_quant import QTYPES, close, quantized, reference, width  # noqa: E402

from pagedserve.kernels.torch_impl.gguf_quant import gguf_linear_torch  # noqa: E402
from pagedserve.kernels.triton.gguf_linear import gguf_linear_triton  # noqa: E402


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_triton_gguf_linear_matches_twin(qtype, m):
    n, k = 70, width(qtype, 64)  # two BLOCK_N tiles, the second mostly masked; M=17 spans two BLOCK_M tiles
    raw, deq = quantized(qtype, n, k, seed=m)
    x = torch.randn(m, k)
    out = gguf_linear_triton(x, raw, qtype, k)
    assert out.shape == (m, n) and out.dtype == torch.float32
    close(out, reference(x, deq), torch.float32)
    torch.testing.assert_close(out, gguf_linear_torch(x, raw, qtype, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0", "Q5_K", "Q6_K"])
def test_triton_gguf_linear_bf16(qtype):
    k = width(qtype, 96)
    raw, deq = quantized(qtype, 33, k)
    x = torch.randn(2, 2, k).to(torch.bfloat16)
    out = gguf_linear_triton(x, raw, qtype, k)
    assert out.shape == (2, 2, 33) and out.dtype == torch.bfloat16
    close(out.reshape(4, 33), reference(x.reshape(4, k), deq), torch.bfloat16)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 40, 70])
def test_triton_gguf_linear_split_k_and_sliced_weight(qtype, m):
    """A long K over few output tiles is split across programs (float32 partials summed in order), and a
    row-parallel shard (a block-aligned column slice of the weight's bytes) is read in place."""
    from pagedserve.kernels.torch_impl.gguf_quant import row_bytes
    from pagedserve.kernels.triton import gguf_linear as kernel

    k = 768 if qtype.endswith("_K") else 576  # several K steps: 5 of 128 (the last half full), or 3 super-blocks
    raw, deq = quantized(qtype, 70, 2 * k, seed=m)
    shard = raw[:, row_bytes(qtype, k):]
    assert not shard.is_contiguous()
    launches = []
    real = kernel._gguf_linear_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    x = torch.randn(m, k)
    try:
        kernel._gguf_linear_kernel = Spy()
        out = gguf_linear_triton(x, shard, qtype, k)
    finally:
        kernel._gguf_linear_kernel = real
    assert launches[0][2] > 1  # split over K
    close(out, reference(x, deq[:, k:]), torch.float32)
    torch.testing.assert_close(out, gguf_linear_torch(x, shard.contiguous(), qtype, k), rtol=1e-4, atol=1e-4)


def test_a_tile_too_large_for_shared_memory_is_retried_with_fewer_rows(monkeypatch):
    """On an H100 a float32 K-quant call of 300 rows asked for 288 KiB of shared memory in 128-row tiles
    (227 KiB fit): Triton refuses such a launch before queuing any work. The launch is retried with half
    the rows per tile until one fits, and the fitting size is remembered for the next call."""
    from triton.runtime.errors import OutOfResources

    from pagedserve.kernels.triton import gguf_linear as kernel

    real = kernel._gguf_linear_kernel
    tried: list[int] = []
    fits = 32

    class SharedMemoryOf32Rows:
        def __getitem__(self, grid):
            def launch(*args, **constants):
                tried.append(constants["BLOCK_M"])
                if constants["BLOCK_M"] > fits:
                    raise OutOfResources(294912, 232448, "shared memory")
                assert grid[0] == -(-args[3] // constants["BLOCK_M"])  # the grid follows the smaller tile
                return real[grid](*args, **constants)

            return launch

    monkeypatch.setattr(kernel, "_gguf_linear_kernel", SharedMemoryOf32Rows())
    monkeypatch.setattr(kernel, "_FITTED_BLOCK_M", {})
    raw, deq = quantized("Q4_K", 40, 256)
    x = torch.randn(100, 256)
    close(gguf_linear_triton(x, raw, "Q4_K", 256), reference(x, deq), torch.float32)
    assert tried == [128, 64, 32]
    tried.clear()
    close(gguf_linear_triton(x[:70], raw, "Q4_K", 256), reference(x[:70], deq), torch.float32)
    assert tried == [32]  # remembered: no failed launch the second time
    tried.clear()
    gguf_linear_triton(x[:5], raw, "Q4_K", 256)
    assert tried == [16]  # other launch shapes are their own

    fits = 8  # not even the smallest tile fits: the device's error reaches the caller
    with pytest.raises(OutOfResources):
        gguf_linear_triton(x[:20], raw, "Q4_K", 256)
