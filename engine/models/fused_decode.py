"""Decode steps of a Llama-family model through one compiled CPU op (`kernels.decode_layers`).

On a CPU a batch-1 decode step of a small model is mostly the Python between its ops: a 30-layer model
calls about 330 of them per step, a few microseconds each before any arithmetic. `FusedDecodeStack`
packs a model's layer tensors once and runs a decode-only step through all of them in C++, with the same
ops in the same order, so its output is the layer-by-layer path's bit for bit (tests/test_fused_decode.py).

A model uses it when it can: CPU tensors in a float dtype the ops take, the compiled ops built, tensor
parallel size 1, the plain layer classes (LoRA wraps the projections: those models keep the module path),
every quantized weight of a type the op multiplies. A step uses it when every row is a decode sequence and
no KV connector waits on layer loads. `enforce_eager` turns it off (ModelRunner), as it does CUDA graphs.
"""

from __future__ import annotations

import logging
import torch
from torch import nn

from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.kernels.decode_layers import (
    DTYPES,
    LAYER_PARAMS,
    LAYER_PROJECTIONS,
    decode_layers,
    decode_layers_available,
    qtype_code,
)
from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES
from pagedserve.parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Each projection's built class (a LoRA wrapper or any other replacement keeps the layer path).
_PROJECTION_CLASSES = {"qkv": QKVParallelLinear, "o": RowParallelLinear, "gate_up": MergedColumnParallelLinear,
                       "down": RowParallelLinear}


def _projections(layer: nn.Module) -> dict[str, nn.Module]:
    """One layer's projections by their kernels.decode_layers.LAYER_PROJECTIONS names, in that order."""
    attn, mlp = layer.self_attn, layer.mlp
    named = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    return {name: named[name] for name in LAYER_PROJECTIONS}


def _ineligible_reason(model: nn.Module) -> str | None:
    """Why a Llama-family model's (engine/models/llama.py) layers cannot run through the fused op (None: they can)."""
    if any(p.device.type != "cpu" for p in model.parameters()):  # first: a CUDA model never builds the CPU ops
        return "weights not on the CPU"
    if model.dtype not in DTYPES:
        return f"dtype {model.dtype}"
    if model.parallel.tp_size != 1:
        return "tensor parallel"
    if not decode_layers_available():
        return "the compiled CPU ops are not available"
    if model.model.rotary_emb.cos_sin_cache.dtype not in DTYPES:
        return "rotary cache dtype"
    for layer in model.model.layers:
        attn = layer.self_attn
        for name, module in _projections(layer).items():
            if type(module) is not _PROJECTION_CLASSES[name]:  # e.g. a LoRA wrapper
                return f"{type(module).__name__} projections"
            if module.qtype is None and module.weight.dtype != model.dtype:
                return f"a {module.weight.dtype} weight in a {model.dtype} model"
            if module.qtype is not None and module.qtype not in GGUF_QUANT_TYPES:
                return f"{module.qtype} weights"
            if module.bias is not None and module.bias.dtype != model.dtype:
                return "bias dtype"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        if any(n is not None and n.weight.dtype != model.dtype for n in norms):
            return "norm weight dtype"
    return None


def _layer_params(layer: nn.Module) -> list[torch.Tensor | None]:
    """One layer's tensors in the order of kernels.decode_layers.LAYER_PARAMS (None: absent)."""
    attn = layer.self_attn
    proj = _projections(layer)
    named = {
        "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
        "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
        "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
        **{name: module.weight for name, module in proj.items()},
        **{f"{name}_bias": module.bias for name, module in proj.items()},
    }
    return [named[name] for name in LAYER_PARAMS]


class FusedDecodeStack:
    """A model's layers packed for `kernels.decode_layers`: build with `for_model` (None when it cannot run)."""

    def __init__(self, model: nn.Module) -> None:
        layers = list(model.model.layers)
        first = layers[0].self_attn
        self.params: list[torch.Tensor | None] = [p for layer in layers for p in _layer_params(layer)]
        self.qtypes: list[int] = []
        self.in_features: list[int] = []
        for layer in layers:
            for proj in _projections(layer).values():
                self.qtypes.append(qtype_code(proj.qtype))
                self.in_features.append(proj.input_size_per_rank if isinstance(proj, RowParallelLinear)
                                        else proj.input_size)
        self.sliding_windows = [layer.self_attn.attn.sliding_window or 0 for layer in layers]
        self.num_heads = first.attn.num_heads
        self.num_kv_heads = first.attn.num_kv_heads
        self.head_size = first.attn.head_size
        self.scale = first.attn.scale
        self.eps = layers[0].input_layernorm.eps
        self.rotary = model.model.rotary_emb
        self.dtype = model.dtype
        self._checked_caches: list[KVCache] | None = None
        self._caches_ok = False
        self._key_caches: list[torch.Tensor] = []
        self._value_caches: list[torch.Tensor] = []

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedDecodeStack | None:
        reason = _ineligible_reason(model)
        if reason is not None:
            logger.debug("decode steps run layer by layer: %s", reason)
            return None
        return cls(model)

    def _caches_fit(self, kv_caches: list[KVCache]) -> bool:
        """The caches' layout is what the op reads (checked once per list of caches: they live as long as the engine)."""
        if kv_caches is not self._checked_caches:
            self._checked_caches = kv_caches
            self._caches_ok = all(
                k.dtype == v.dtype == self.dtype and k.stride(-1) == 1 and k.stride() == v.stride()
                for k, v in kv_caches
            )
            self._key_caches = [k for k, _ in kv_caches]
            self._value_caches = [v for _, v in kv_caches]
        return self._caches_ok

    def can_run(self, hidden: torch.Tensor, kv_caches: list[KVCache], md: AttentionMetadata,
                kv_hooks: object | None) -> bool:
        """Whether this step can take the fused op: a decode-only batch, no layer-load hooks, CPU tensors."""
        num_tokens = hidden.shape[0]
        return (
            kv_hooks is None
            and num_tokens > 0
            and md.num_decode_tokens == num_tokens
            and md.query_start_loc_cpu[-1] == num_tokens
            and hidden.device.type == "cpu"
            and hidden.dtype == self.dtype
            and self._caches_fit(kv_caches)
        )

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
            kv_caches: list[KVCache], md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._caches_fit(kv_caches):  # (an identity check after can_run: it also splits K from V once)
            raise ValueError("kv_caches: not in the layout the fused decode op reads (call can_run first)")
        return decode_layers(
            hidden, residual, positions, self.params, self.qtypes, self.in_features,
            self._key_caches, self._value_caches, md.slot_mapping, md.block_tables, md.seq_lens,
            self.rotary.cos_sin_cache, self.num_heads, self.num_kv_heads, self.head_size, self.rotary.is_neox,
            self.scale, self.sliding_windows, self.eps,
        )

