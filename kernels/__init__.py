"""pagedserve kernels: one entry point per op, Triton on CUDA tensors, the torch twin on CPU.

The Triton modules (kernels.triton.*) are imported lazily inside the CUDA branches,
so the CPU path never imports triton.

An entry point checks its input (bad input: ValueError naming the field), then dispatches. The ops a model
layer runs in every step also come as ``*_unchecked``: the same dispatch without the checks, for the layers,
whose shapes are right by construction and whose per-step metadata `AttentionMetadata` checks once per step
(a batch-1 decode step of a 30-layer model would otherwise check each of them 30 times). The compiled CPU
ops still check what they need to stay in bounds (TORCH_CHECK).
"""

from pagedserve.kernels.activation import silu_and_mul, silu_and_mul_unchecked
from pagedserve.kernels.attention import (
    paged_decode_attention,
    paged_decode_attention_unchecked,
    paged_prefill_attention,
    paged_prefill_attention_unchecked,
)
from pagedserve.kernels.cache import reshape_and_cache, reshape_and_cache_unchecked
from pagedserve.kernels.lora import LoRASegments, lora_segment_matmul
from pagedserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_unchecked, rms_norm, rms_norm_unchecked
from pagedserve.kernels.quantized import gguf_embedding, gguf_linear
from pagedserve.kernels.rotary import compute_rope_cos_sin_cache, rotary_embedding, rotary_embedding_unchecked
from pagedserve.kernels.sampling import apply_top_k_top_p_min_p, greedy_argmax

__all__ = [
    "apply_top_k_top_p_min_p",
    "greedy_argmax",
    "compute_rope_cos_sin_cache",
    "fused_add_rms_norm",
    "fused_add_rms_norm_unchecked",
    "gguf_embedding",
    "gguf_linear",
    "LoRASegments",
    "lora_segment_matmul",
    "paged_decode_attention",
    "paged_decode_attention_unchecked",
    "paged_prefill_attention",
    "paged_prefill_attention_unchecked",
    "reshape_and_cache",
    "reshape_and_cache_unchecked",
    "rms_norm",
    "rms_norm_unchecked",
    "rotary_embedding",
    "rotary_embedding_unchecked",
    "silu_and_mul",
    "silu_and_mul_unchecked",
]
