"""The Llama-family decoder, described once; Mistral and Qwen2/3 subclass it with config tweaks.

Tensor parallelism lives in the layer classes (`parallel.layers`); pipeline
parallelism in which layers this stage builds (`parallel.pipeline.layer_range`).
Module names follow the HF checkpoints except for the fused ``qkv_proj`` and
``gate_up_proj``, which `load_weights` fills shard by shard.

Within a step the decoder calls its submodules' ``forward`` directly rather than through
``nn.Module.__call__``: no hooks are registered on them anywhere, and the call machinery (about a
microsecond each, 11 calls per layer) is a measurable share of a batch-1 decode step on CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.models.fused_decode import FusedDecodeStack
from pagedserve.engine.layers import Attention, GatedMLP, KVLayerHooks, RMSNorm, RotaryEmbedding, rope_params_from_config
from pagedserve.parallel.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagedserve.parallel.pipeline import IntermediateTensors, layer_range
from pagedserve.parallel.quant import QuantConfig, qtype_of
from pagedserve.parallel.state import ParallelContext

KVCache = tuple[torch.Tensor, torch.Tensor]

# HF checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _require(hf_config: Any, field: str) -> Any:
    value = getattr(hf_config, field, None)
    if value is None:
        raise ValueError(f"hf_config.{field} is required")
    return value


@dataclass
class DecoderSpec:
    """Everything about the architecture the modules need, read once from the HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: list[int | None]  # per layer


class DecoderAttention(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        parallel: ParallelContext,
        dtype: torch.dtype,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn"
        qkv_qtype = qtype_of(quant_config, *(f"{prefix}.{p}_proj.weight" for p in "qkv"), in_features=spec.hidden_size)
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_size, spec.num_heads, spec.num_kv_heads, parallel, dtype, bias=spec.qkv_bias,
            qtype=qkv_qtype,
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_size, spec.hidden_size, parallel, dtype, bias=spec.o_bias,
            qtype=qtype_of(quant_config, f"{prefix}.o_proj.weight", in_features=spec.num_heads * spec.head_size),
        )
        self.head_size = spec.head_size
        self.q_norm = RMSNorm(spec.head_size, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_size, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin cache
        self.attn = Attention(
            self.qkv_proj.num_heads_per_rank,
            spec.head_size,
            self.qkv_proj.num_kv_heads_per_rank,
            scale=spec.head_size**-0.5,
            kv_cache_idx=layer_idx - layer_range(spec.num_layers, parallel.pp_rank, parallel.pp_size)[0],
            sliding_window=spec.sliding_windows[layer_idx],
        )

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm.forward(x.reshape(-1, self.head_size)).view(x.shape)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        kv_hooks: KVLayerHooks | None,
    ) -> torch.Tensor:
        qkv_proj = self.qkv_proj
        q, k, v = qkv_proj.split(qkv_proj.forward(hidden))
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head RMSNorm before rope
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb.forward(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata, kv_hooks)
        return self.o_proj.forward(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        parallel: ParallelContext,
        dtype: torch.dtype,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, layer_idx, rotary_emb, parallel, dtype, quant_config)
        self.mlp = GatedMLP(
            spec.hidden_size, spec.intermediate_size, spec.hidden_act, parallel, dtype, bias=spec.mlp_bias,
            quant_config=quant_config, prefix=f"model.layers.{layer_idx}.mlp",
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        kv_hooks: KVLayerHooks | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, kv_cache, attn_metadata, kv_hooks)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class DecoderModel(nn.Module):
    """Embedding (first stage), this stage's layers, final norm (last stage)."""

    def __init__(self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.start_layer, self.end_layer = layer_range(spec.num_layers, parallel.pp_rank, parallel.pp_size)
        self.embed_tokens = (
            VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, parallel, dtype,
                                   qtype=qtype_of(quant_config, "model.embed_tokens.weight"))
            if parallel.is_first_pp_stage
            else None
        )
        self.rotary_emb = RotaryEmbedding(
            spec.head_size, spec.head_size, spec.max_position, spec.rope_theta, spec.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.rotary_emb, parallel, dtype, quant_config)
            for i in range(self.start_layer, self.end_layer)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype) if parallel.is_last_pp_stage else None


class LlamaForCausalLM(nn.Module):
    """Llama / Llama-3 decoder; the base class of the other Llama-family models."""

    qk_norm: ClassVar[bool] = False

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        """(qkv_bias, o_bias, mlp_bias) as the HF implementation builds them."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))

    @classmethod
    def sliding_windows(cls, hf_config: Any, num_layers: int) -> list[int | None]:
        """Per-layer window: from ``layer_types`` when the config has them, else ``sliding_window`` for all."""
        window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is None:
            return [window] * num_layers
        if len(layer_types) != num_layers:
            raise ValueError(f"hf_config.layer_types has {len(layer_types)} entries, expected {num_layers}")
        return [window if t == "sliding_attention" else None for t in layer_types]

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        hidden = int(_require(hf_config, "hidden_size"))
        num_heads = int(_require(hf_config, "num_attention_heads"))
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        num_layers = int(_require(hf_config, "num_hidden_layers"))
        head_size = getattr(hf_config, "head_dim", None) or hidden // num_heads
        theta, scaling = rope_params_from_config(hf_config)
        qkv_bias, o_bias, mlp_bias = cls.biases(hf_config)
        return DecoderSpec(
            vocab_size=int(_require(hf_config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_require(hf_config, "intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=int(head_size),
            hidden_act=str(getattr(hf_config, "hidden_act", "silu")),
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(_require(hf_config, "max_position_embeddings")),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=cls.qk_norm,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_windows=cls.sliding_windows(hf_config, num_layers),
        )

    def __init__(
        self, hf_config: Any, dtype: torch.dtype, parallel: ParallelContext, max_position: int | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        """max_position: positions the RoPE cache must cover (max_model_len) when above the config's.
        quant_config: which checkpoint weights (by HF name) layers keep quantized; None: float weights."""
        super().__init__()
        self.config = hf_config
        spec = self.spec_from_config(hf_config)
        if max_position is not None and max_position > spec.max_position:
            spec = replace(spec, max_position=max_position)
        self.spec = spec
        self.parallel = parallel
        self.dtype = dtype
        self.model = DecoderModel(spec, parallel, dtype, quant_config)
        # Decode-only steps through one compiled CPU op where the model allows it (engine/models/fused_decode.py);
        # the stack is packed at the first decode step, after the weights (and any LoRA wrappers) are in place.
        self.fused_decode = True
        self._fused_stack: FusedDecodeStack | None = None
        self._fused_stack_built = False
        self.lm_head: ParallelLMHead | None = None
        if parallel.is_last_pp_stage:
            head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype,
                                          qtype=qtype_of(quant_config, head_name))
            if spec.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    def kv_cache_shape_per_layer(self) -> tuple[int, int, int]:
        """(num_local_layers, num_kv_heads_on_this_rank, head_size)."""
        num_local = self.end_layer - self.start_layer
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads_per_rank
        return num_local, kv_heads, self.spec.head_size

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        kv_hooks: KVLayerHooks | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """One forward pass of this stage over a flat batch of tokens.

        ``kv_caches`` is indexed by local layer index. Non-last stages return
        `IntermediateTensors`; the last stage returns final-normed hidden states [T, hidden].
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries, this stage has {len(self.model.layers)} layers")
        residual: torch.Tensor | None
        if self.model.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("input_ids is required on the first pipeline stage")
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("intermediate is required on pipeline stages after the first")
            hidden, residual = intermediate.hidden_states, intermediate.residual
        stack = self._decode_stack() if self.fused_decode else None
        if stack is not None and stack.can_run(hidden, kv_caches, attn_metadata, kv_hooks):
            hidden, residual = stack.run(positions, hidden, residual, kv_caches, attn_metadata)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                hidden, residual = layer.forward(positions, hidden, residual, kv_cache, attn_metadata, kv_hooks)
        assert residual is not None  # every stage has at least one layer
        if self.model.norm is None:
            return IntermediateTensors(hidden_states=hidden, residual=residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _decode_stack(self) -> FusedDecodeStack | None:
        if not self._fused_stack_built:
            self._fused_stack = FusedDecodeStack.for_model(self)
            self._fused_stack_built = True
        return self._fused_stack

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] logits over the full vocabulary: float32, or with `upcast=False`
        in the LM head's own dtype (for the sampler, which widens only what it needs: a plain greedy batch
        takes its argmax as is, and widening a [64, 49k] bf16 batch costs about as much as that argmax)."""
        if self.lm_head is None:
            raise ValueError("compute_logits is only available on the last pipeline stage")
        logits = self.lm_head.compute_logits(hidden)
        return logits.float() if upcast else logits

    # ---- weights -------------------------------------------------------------

    def weight_on_stage(self, name: str) -> bool:
        """False for checkpoint weights that belong to another pipeline stage (skip without reading)."""
        m = _LAYER_RE.match(name)
        if m:
            return self.start_layer <= int(m.group(1)) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or (self.spec.tie_word_embeddings and self.lm_head is not None)
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return self.parallel.is_last_pp_stage
        return True

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HF-named checkpoint weights (tensors or lazy slices); returns the parameter names filled.

        Weights of other pipeline stages are skipped; unknown names raise ValueError.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, weight in weights:
            if "rotary_emb.inv_freq" in hf_name or not self.weight_on_stage(hf_name):
                continue
            name = hf_name
            if self.spec.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the LM head
            if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
                name = "lm_head.weight"  # tied, last stage without the embedding
            m = _LAYER_RE.match(name)
            if m:
                name = f"model.layers.{int(m.group(1)) - self.start_layer}." + name[m.end() :]
            shard_id: Any = None
            for hf_part, our_part, sid in _STACKED:
                if hf_part in name:
                    name, shard_id = name.replace(hf_part, our_part), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint for {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, weight)
            else:
                loader(param, weight, shard_id)
            loaded.add(name)
        return loaded
