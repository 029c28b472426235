"""RMSNorm and fused residual-add RMSNorm (torch twins, HF LlamaRMSNorm semantics)."""

from __future__ import annotations

import torch


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
