"""pagedserve: a paged-KV-cache LLM inference and serving engine, scaled out on Ray.

The public API, as vLLM's reads::

    from pagedserve import LLM, SamplingParams

Names are re-exported lazily (PEP 562), so `import pagedserve` imports neither torch nor Ray;
`pagedserve.LLM` imports the engine on first use. The repository keeps its top-level folders
(`engine/`, `cluster/`, `kernels/`, `parallel/`, `kv_transfer/`); packaging maps them to
`pagedserve.engine`, `pagedserve.cluster`, ... (see pyproject.toml).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LLM": "pagedserve.engine.llm",
    "AsyncLLM": "pagedserve.engine.async_llm",
    "SamplingParams": "pagedserve.engine.sampling_params",
    "PoolingParams": "pagedserve.engine.pooling_params",
    "EmbeddingRequestOutput": "pagedserve.engine.outputs",
    "EmbeddingOutput": "pagedserve.engine.outputs",
    "RequestOutput": "pagedserve.engine.outputs",
    "CompletionOutput": "pagedserve.engine.outputs",
    "Logprob": "pagedserve.engine.outputs",
    "EngineConfig": "pagedserve.engine.config",
    "EngineArgs": "pagedserve.engine.config",
    "LoRARequest": "pagedserve.engine.lora.request",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.config import EngineArgs, EngineConfig
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.lora.request import LoRARequest
    from pagedserve.engine.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
    )
    from pagedserve.engine.pooling_params import PoolingParams
    from pagedserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
