"""Entry points: matmul and embedding lookup with GGUF block-quantized weights (weight-only quantization).

The weight stays quantized in memory (uint8 rows of llama.cpp blocks, kernels/torch_impl/gguf_quant.py);
activations and results are in the engine's float dtype. Triton dequant-GEMM on CUDA; on CPU the compiled
op where it built, else the torch twin (row tiles dequantized, then multiplied).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available
from pagedserve.kernels.torch_impl.gguf_quant import (
    COMPILED_DTYPES,
    GGUF_QUANT_TYPES,
    dequantize_gguf,
    gguf_linear_cpu,
    row_bytes,
)


def _check(weight: torch.Tensor, qtype: str, in_features: int) -> None:
    if qtype not in GGUF_QUANT_TYPES:
        raise ValueError(f"qtype: {qtype!r} is not a supported GGUF quant type; supported: {', '.join(GGUF_QUANT_TYPES)}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes(qtype, in_features):
        raise ValueError(f"weight: expected uint8 [N, {row_bytes(qtype, in_features)}] ({qtype} rows of {in_features} "
                         f"elements), got {weight.dtype} {tuple(weight.shape)}")


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """x [..., in_features] @ W.T -> [..., N] in x.dtype, W [N, in_features] given as ``qtype`` blocks."""
    _check(weight, qtype, in_features)
    if x.shape[-1] != in_features:
        raise ValueError(f"x: last dim {x.shape[-1]} != in_features {in_features}")
    if x.is_cuda:
        from pagedserve.kernels.triton.gguf_linear import gguf_linear_triton

        return gguf_linear_triton(x, weight, qtype, in_features)
    return gguf_linear_cpu(x, weight, qtype, in_features)


def gguf_embedding(ids: torch.Tensor, weight: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of W [vocab, dim] (``qtype`` blocks) dequantized to ``dtype``: [*ids.shape, dim]. On CPU
    the compiled op where it built (the same values; the twin's ~10 tensor ops cost more than a decode
    step's lookup itself), else the twin."""
    _check(weight, qtype, dim)
    if weight.device.type == "cpu" and dtype in COMPILED_DTYPES and cpu_ops_available():
        return torch.ops.pagedserve.gguf_embedding(ids, weight, GGUF_QUANT_TYPES[qtype][0], dim, dtype)
    return dequantize_gguf(weight[ids], qtype, dtype)
