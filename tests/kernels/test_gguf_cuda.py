"""The Triton GGUF dequant-GEMM compiled for a real GPU (no interpreter), against the torch twin on CPU
and the gguf package's dequantization, for every supported type. Skipped where CUDA is absent (this
repository's CI machine); run on a GPU with `python -m pytest tests/kernels/test_gguf_cuda.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("gguf")

from test_gguf_quant import K_QUANTS, QTYPES, close, quantized, reference  # noqa: E402

from pagedserve.kernels.quantized import gguf_linear  # noqa: E402
from pagedserve.kernels.torch_impl.gguf_quant import gguf_linear_torch, row_bytes  # noqa: E402
from pagedserve.kernels.triton._utils import interpreting  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled():
    if interpreting():  # a module collected with this one turned the interpreter on: not a GPU run
        pytest.skip("TRITON_INTERPRET is set")


def row_width(qtype: str) -> int:
    """The default model's width (576) for the 32-element types; three super-blocks for the K-quants."""
    return 768 if qtype in K_QUANTS else 576


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,n", [(1, 70), (5, 1000), (33, 130), (300, 64)])
def test_cuda_gguf_linear_matches_twin_in_float32(qtype, m, n):
    k = row_width(qtype)
    raw, deq = quantized(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    out = gguf_linear(x.cuda(), raw.cuda(), qtype, k)
    assert out.is_cuda and out.shape == (m, n) and out.dtype == torch.float32
    close(out.cpu(), reference(x, deq), torch.float32)
    torch.testing.assert_close(out.cpu(), gguf_linear_torch(x, raw, qtype, k), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gguf_linear_half_precision(qtype, dtype):
    k = row_width(qtype)
    raw, deq = quantized(qtype, 257, k)
    x = torch.randn(3, 7, k).to(dtype)  # [..., K]: the entry point flattens the leading dims
    out = gguf_linear(x.cuda(), raw.cuda(), qtype, k)
    assert out.shape == (3, 7, 257) and out.dtype == dtype
    close(out.cpu().reshape(21, 257), reference(x.reshape(21, k), deq), dtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_cuda_gguf_linear_on_views(qtype):
    """A strided activation (a column slice) and a row-parallel TP shard (a block-aligned column slice of
    the weight's bytes, not contiguous) give what the same data gives contiguous."""
    k = row_width(qtype)
    raw, deq = quantized(qtype, 96, 2 * k)
    wide = torch.randn(9, 3 * k)
    x = wide[:, k:2 * k]  # stride(0) = 3k
    shard = raw[:, row_bytes(qtype, k):]  # the second half of every row: input features k..2k
    on_gpu_x = wide.cuda()[:, k:2 * k]
    on_gpu_shard = raw.cuda()[:, row_bytes(qtype, k):]
    assert not on_gpu_x.is_contiguous() and not on_gpu_shard.is_contiguous()
    out = gguf_linear(on_gpu_x, on_gpu_shard, qtype, k)
    close(out.cpu(), reference(x, deq[:, k:]), torch.float32)
    torch.testing.assert_close(out.cpu(), gguf_linear_torch(x.contiguous(), shard.contiguous(), qtype, k),
                               rtol=1e-4, atol=1e-4)
