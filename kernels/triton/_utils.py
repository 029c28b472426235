"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels then run as numpy on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 dots ("ieee"), since Triton's default TF32 would not match fp32 torch/HF results."""
    return "ieee" if dtype == torch.float32 else "tf32"
