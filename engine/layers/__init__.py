"""Model building blocks shared by every decoder: attention over the paged KV cache, norms, rope, MLP."""

from pagedserve.engine.layers.attention import Attention, KVLayerHooks
from pagedserve.engine.layers.mlp import GatedMLP
from pagedserve.engine.layers.norm import RMSNorm
from pagedserve.engine.layers.rope import RotaryEmbedding, rope_params_from_config

__all__ = ["Attention", "KVLayerHooks", "GatedMLP", "RMSNorm", "RotaryEmbedding", "rope_params_from_config"]
