"""Entry point: SiLU-and-mul (the gated MLP activation)."""

from __future__ import annotations

import torch

from pagedserve.kernels.torch_impl.activation import silu_and_mul_cpu


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*d] -> silu(x[..., :d]) * x[..., d:]."""
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x last dim must be even, got shape {tuple(x.shape)}")
    return silu_and_mul_unchecked(x)


def silu_and_mul_unchecked(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` without the shape check (for the model layers)."""
    if x.is_cuda:
        from pagedserve.kernels.triton.activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_cpu(x)
