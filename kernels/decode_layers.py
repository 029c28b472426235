"""Entry point: one decode step through a stack of Llama-family decoder layers in one compiled CPU op.

The op (kernels/cpu/decode_layers.cpp) runs what the model's layers run on a decode-only batch, op for
op, without returning to Python between them. The caller (engine/models/fused_decode.py) decides when a
step qualifies and packs the layers' tensors once; this module names the layout they are packed in.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available
from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES

# One layer's tensors in `params`, in this order (an absent bias or head norm is None).
LAYER_PARAMS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm",
                "gate_up", "gate_up_bias", "down", "down_bias")
# One layer's projections in `qtypes` / `in_features`, in this order.
LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")
FLOAT_WEIGHT = -1  # the qtype of a projection whose weight is float
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qtype_code(qtype: str | None) -> int:
    """A projection's entry in `qtypes`: the GGML type number of a GGUF weight, FLOAT_WEIGHT for a float one."""
    return FLOAT_WEIGHT if qtype is None else GGUF_QUANT_TYPES[qtype][0]


def decode_layers_available() -> bool:
    return cpu_ops_available()


def decode_layers(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    params: list[torch.Tensor | None],
    qtypes: list[int],
    in_features: list[int],
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    is_neox: bool,
    scale: float,
    sliding_windows: list[int],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after the layers, for hidden [T, hidden_size] of T decode sequences (one token each).

    Writes each layer's new K/V into its caches at ``slot_mapping``. ``residual`` None: the stack starts at the
    model's first layer. ``sliding_windows``: per layer, 0 for full attention.
    """
    return torch.ops.pagedserve.decode_layers(
        hidden, residual, positions, params, qtypes, in_features, key_caches, value_caches, slot_mapping,
        block_tables, seq_lens, cos_sin_cache, num_heads, num_kv_heads, head_size, is_neox, float(scale),
        sliding_windows, float(eps),
    )
