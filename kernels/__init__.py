"""pagedserve kernels: one entry point per op, Triton on CUDA tensors, the torch twin on CPU.

The Triton modules (kernels.triton.*) are imported lazily inside the CUDA branches,
so the CPU path never imports triton. OpenMP's wait policy is chosen first, before torch is imported
(kernels.openmp_env).
"""

from pagedserve.kernels.openmp_env import prefer_passive_openmp_wait

prefer_passive_openmp_wait()

from pagedserve.kernels.activation import silu_and_mul  # noqa: E402
from pagedserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from pagedserve.kernels.cache import reshape_and_cache  # noqa: E402
from pagedserve.kernels.lora import LoRASegments, lora_segment_matmul  # noqa: E402
from pagedserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from pagedserve.kernels.quantized import gguf_embedding, gguf_linear  # noqa: E402
from pagedserve.kernels.rotary import compute_rope_cos_sin_cache, rotary_embedding  # noqa: E402
from pagedserve.kernels.sampling import apply_top_k_top_p_min_p  # noqa: E402

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
