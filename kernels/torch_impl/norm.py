"""RMSNorm and fused residual-add RMSNorm (torch twins, HF LlamaRMSNorm semantics)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF: normalise in fp32, round to the input dtype, then scale by the weight.
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual  # in the model dtype, like HF's `residual + hidden_states`
    return rms_norm_torch(summed, weight, eps), summed


def _compiled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in _COMPILED_DTYPES and weight.dtype == x.dtype and cpu_ops_available()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU path: one compiled op (kernels/cpu/elementwise.cpp) where it built, else the twin."""
    if _compiled(x, weight):
        return torch.ops.pagedserve.rms_norm(x, weight, float(eps))
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _compiled(x, weight) and residual.dtype == x.dtype:
        return torch.ops.pagedserve.fused_add_rms_norm(x, residual, weight, float(eps))
    return fused_add_rms_norm_torch(x, residual, weight, eps)
