"""SiLU-and-mul (torch twin)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.build import cpu_ops_available

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU path: one compiled op (kernels/cpu/elementwise.cpp) where it built, else the twin."""
    if x.dtype in _COMPILED_DTYPES and cpu_ops_available():
        return torch.ops.pagedserve.silu_and_mul(x)
    return silu_and_mul_torch(x)
