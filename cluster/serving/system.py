"""`GET /v1/models`, `/health`, `/ping` and `/metrics`."""

from __future__ import annotations

from fastapi.responses import Response

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError
from pagedserve.cluster.serving.responses import ModelCard, ModelList


# What every served model supports: the decoder generates, and its pooled hidden states are embeddings.
CAPABILITIES = ("completions", "chat", "embeddings")


def list_models(serving: OpenAIServing) -> ModelList:
    """The base model, then each LoRA adapter (`parent`: the base model's id, `root`: the adapter's path)."""
    base = ModelCard(id=serving.model_name, root=serving.args.model, max_model_len=serving.max_model_len,
                     description=serving.model_description, capabilities=list(CAPABILITIES))
    adapters = [ModelCard(id=name, root=lora.lora_path, parent=serving.model_name, max_model_len=serving.max_model_len,
                          capabilities=list(CAPABILITIES))
                for name, lora in serving.lora.by_name.items()]
    return ModelList(data=[base, *adapters])


def health(serving: OpenAIServing) -> Response:
    if serving.client.is_healthy():
        return Response(status_code=200)
    return APIError(503, "an engine is unreachable or has stopped making progress with work waiting",
                    type="service_unavailable_error", code="unhealthy").response()


def render_metrics(serving: OpenAIServing) -> Response:
    body, content_type = serving.metrics.render()
    return Response(content=body, media_type=content_type)
