"""pagedserve kernels: one entry point per op, Triton on CUDA tensors, the torch twin on CPU.

The Triton modules (kernels.triton.*) are imported lazily inside the CUDA branches,
so the CPU path never imports triton.
"""

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.attention import paged_decode_attention, paged_prefill_attention
from pagedserve.kernels.cache import reshape_and_cache
from pagedserve.kernels.lora import LoRASegments, lora_segment_matmul
from pagedserve.kernels.norm import fused_add_rms_norm, rms_norm
from pagedserve.kernels.quantized import gguf_embedding, gguf_linear
from pagedserve.kernels.rotary import compute_rope_cos_sin_cache, rotary_embedding
from pagedserve.kernels.sampling import apply_top_k_top_p_min_p

__all__ = [
    "apply_top_k_top_p_min_p",
    "compute_rope_cos_sin_cache",
    "fused_add_rms_norm",
    "gguf_embedding",
    "gguf_linear",
    "LoRASegments",
    "lora_segment_matmul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
