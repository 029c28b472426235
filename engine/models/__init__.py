"""Model definitions (Llama family) and the architecture registry."""

from pagedserve.engine.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
