"""Model building blocks shared by every decoder: attention over the paged KV cache, norms, rope, MLP."""

from engine.layers.attention import Attention, KVLayerHooks
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rope import RotaryEmbedding, rope_params_from_config

__all__ = ["Attention", "KVLayerHooks", "GatedMLP", "RMSNorm", "RotaryEmbedding", "rope_params_from_config"]
