"""Rotary position embedding with a precomputed cos/sin cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve import kernels


def rope_params_from_config(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from an HF config.

    transformers 5 keeps both in ``rope_parameters`` (with ``rope_type`` "default"
    meaning no scaling); older configs use top-level ``rope_theta`` and ``rope_scaling``.
    The returned scaling dict has no ``rope_theta`` key and is None for plain RoPE.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {type(params).__name__}")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling.setdefault("rope_type", rope_type)
    return theta, scaling


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None,
        dtype: torch.dtype,
        is_neox: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.is_neox = is_neox
        cache = kernels.compute_rope_cos_sin_cache(rotary_dim, max_position, base, rope_scaling, dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate flat ``query`` [T, heads*head_size] and ``key`` [T, kv_heads*head_size]."""
        return kernels.rotary_embedding_unchecked(positions, query, key, self.cos_sin_cache, self.head_size, self.is_neox)
