"""Entry points: the RoPE cos/sin cache (HF-compatible scaling) and applying rotary embeddings."""

from __future__ import annotations

import math

import torch

from pagedserve.kernels._validate import check_dim
from pagedserve.kernels.torch_impl.rotary import rotary_embedding_cpu


def _inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    # Same expression as transformers.modeling_rope_utils so the fp32 values match bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim))
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _get(rope_scaling, "factor")
    if rope_type == "llama3":
        factor = _get(rope_scaling, "factor")
        low_freq_factor = _get(rope_scaling, "low_freq_factor")
        high_freq_factor = _get(rope_scaling, "high_freq_factor")
        old_context_len = _get(rope_scaling, "original_max_position_embeddings")
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_scaling rope_type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def _get(rope_scaling: dict, key: str) -> float:
    if key not in rope_scaling:
        raise ValueError(f"rope_scaling is missing {key!r}")
    return rope_scaling[key]


def compute_rope_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None, dtype: torch.dtype
) -> torch.Tensor:
    """[max_position, rotary_dim] = cat(cos, sin), each over rotary_dim // 2 frequencies, computed in fp32."""
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = _inv_freq(rotary_dim, base, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head of query [T, H*D] and key [T, Hkv*D]; returns new tensors.

    is_neox: HF rotate_half layout (halves); otherwise gpt-j layout (interleaved pairs).
    """
    check_dim("positions", positions, 1)
    check_dim("query", query, 2)
    check_dim("key", key, 2)
    check_dim("cos_sin_cache", cos_sin_cache, 2)
    if query.shape[1] % head_size or key.shape[1] % head_size:
        raise ValueError(f"query/key widths {query.shape[1]}/{key.shape[1]} are not multiples of head_size {head_size}")
    if cos_sin_cache.shape[1] > head_size:
        raise ValueError(f"cos_sin_cache rotary_dim {cos_sin_cache.shape[1]} exceeds head_size {head_size}")
    if positions.shape[0] != query.shape[0] or key.shape[0] != query.shape[0]:
        raise ValueError(f"positions/key token counts {positions.shape[0]}/{key.shape[0]} != query {query.shape[0]}")
    return rotary_embedding_unchecked(positions, query, key, cos_sin_cache, head_size, is_neox)


def rotary_embedding_unchecked(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` without the shape checks (for the model layers)."""
    if query.is_cuda:
        from pagedserve.kernels.triton.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, query, key, cos_sin_cache, head_size, is_neox)
    return rotary_embedding_cpu(positions, query, key, cos_sin_cache, head_size, is_neox)
