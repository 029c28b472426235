"""The LoRA segment matmul: the Triton kernel (under TRITON_INTERPRET=1) against its torch twin, and the twin
against a per-row reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel modules

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.engine.lora.batch import build_lora_batch  # noqa: E402
from pagedserve.kernels.torch_impl.lora import lora_segment_matmul_torch  # noqa: E402
from pagedserve.kernels.triton.lora import lora_segment_matmul_triton  # noqa: E402


def _case(seed: int, request_slots: list[int], query_lens: list[int], n: int, k: int, num_slots: int = 4):
    gen = torch.Generator().manual_seed(seed)
    batch = build_lora_batch(np.array(request_slots), np.array(query_lens), np.ones(num_slots), torch.device("cpu"),
                             torch.float32)
    assert batch is not None
    x = torch.randn(len(batch.token_index), k, generator=gen)
    weights = torch.randn(num_slots, n, k, generator=gen)
    return batch, x, weights


@pytest.mark.parametrize("request_slots,query_lens,n,k", [
    ([0, -1, 2, 0, 3], [1, 5, 17, 3, 70], 16, 64),  # shrink: decodes and prefills, base rows left out
    ([1, 1, 1], [2, 1, 33], 96, 24),  # expand: one adapter, N and K not powers of two
    ([3, 2, 1, 0, -1, 2], [1, 1, 1, 1, 1, 1], 8, 128),  # a decode batch, one row per group
])
def test_triton_segment_matmul_matches_the_twin_and_per_row_reference(request_slots, query_lens, n, k):
    batch, x, weights = _case(3, request_slots, query_lens, n, k)
    seg = batch.segments
    twin = lora_segment_matmul_torch(x, weights, seg.starts, seg.slots)
    out = lora_segment_matmul_triton(x, weights, seg.starts_t, seg.slots_t, seg.max_len)
    torch.testing.assert_close(out, twin, atol=1e-5, rtol=1e-5)
    # Per row: the slot its request has (rows are grouped by slot, base-model rows absent).
    token_slots = np.repeat(request_slots, query_lens)
    for row, flat in enumerate(batch.token_index.tolist()):
        ref = weights[int(token_slots[flat])] @ x[row]
        torch.testing.assert_close(twin[row], ref, atol=1e-5, rtol=1e-5)


def test_no_adapted_token_is_no_batch():
    assert build_lora_batch(np.array([-1, -1]), np.array([3, 1]), np.ones(2), torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("request_slots,query_lens,in_order", [
    ([2, 2, 2], [4, 1, 1], True),  # one adapter for the whole step: the rows as they are
    ([0, 1, 1], [2, 1, 3], True),  # already grouped by slot
    ([1, 0], [2, 1], False),  # grouping reorders the rows
    ([0, -1, 0], [1, 1, 1], False),  # a base-model row is left out
])
def test_a_batch_whose_rows_are_all_adapted_and_grouped_is_used_in_place(request_slots, query_lens, in_order):
    batch = build_lora_batch(np.array(request_slots), np.array(query_lens), np.ones(3), torch.device("cpu"),
                             torch.float32)
    assert batch.all_rows_in_order is in_order
    if in_order:
        assert batch.token_index.tolist() == list(range(sum(query_lens)))


def test_the_twin_leaves_rows_outside_every_segment_zero():
    x, weights = torch.randn(7, 8), torch.randn(2, 3, 8)
    out = lora_segment_matmul_torch(x, weights, [2, 4, 5], [1, 0])
    assert out[[0, 1, 5, 6]].abs().sum() == 0
    torch.testing.assert_close(out[2:4], x[2:4] @ weights[1].t())
    torch.testing.assert_close(out[4:5], x[4:5] @ weights[0].t())


def test_the_segment_matmul_compiles_for_cuda(tmp_path):
    """The GPU path (bf16 tensor-core dots, fp32 "ieee" dots; no interpreter) is valid Triton: compiled to an sm_80
    cubin with the real compiler, no GPU needed (as tests/kernels/compile_for_cuda.py does for the other kernels)."""
    import subprocess
    import sys

    script = (
        "from tests.kernels.compile_for_cuda import compile_kernel\n"
        "from pagedserve.kernels.triton.lora import _segment_matmul_kernel\n"
        "for dtype, precision in (('bf16', 'tf32'), ('fp16', 'tf32'), ('fp32', 'ieee')):\n"
        "    compile_kernel(_segment_matmul_kernel, {'x_ptr': '*' + dtype, 'w_ptr': '*' + dtype, 'out_ptr': '*' + dtype,\n"
        "                   'starts_ptr': '*i32', 'slots_ptr': '*i32'}, set(),\n"
        "                   dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, PRECISION=precision))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled _segment_matmul_kernel") == 3, result.stdout
