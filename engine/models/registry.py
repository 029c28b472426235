"""Map an HF config's ``architectures`` to our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.engine.models.llama import LlamaForCausalLM
from pagedserve.engine.models.mistral import MistralForCausalLM
from pagedserve.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first supported entry of ``hf_config.architectures``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none: hf_config.architectures is empty)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
