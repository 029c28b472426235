"""Entry points: RMSNorm and fused residual-add RMSNorm."""

from __future__ import annotations

import torch

from pagedserve.kernels.torch_impl.norm import fused_add_rms_norm_cpu, rms_norm_cpu


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x hidden size {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: fp32 statistics, result in x.dtype."""
    _check(x, weight)
    return rms_norm_unchecked(x, weight, eps)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` without the shape check (for the model layers)."""
    if x.is_cuda:
        from pagedserve.kernels.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    return fused_add_rms_norm_unchecked(x, residual, weight, eps)


def fused_add_rms_norm_unchecked(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` without the shape checks (for the model layers)."""
    if x.is_cuda:
        from pagedserve.kernels.triton.norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_cpu(x, residual, weight, eps)
