"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return kernels.rms_norm_unchecked(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm_unchecked(x, residual, self.weight, self.eps)
