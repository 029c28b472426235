"""`GET /v1/models`, `/health`, `/ping` and `/metrics`."""

from __future__ import annotations

from fastapi.responses import Response

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError
from pagedserve.cluster.serving.responses import ModelCard, ModelList


def capabilities(serving: OpenAIServing, adapter: bool) -> list[str]:
    """What a served model supports: the decoder generates (chat with `tools`: tool_choice "required",
    named and "none" on any model; "auto" only with --enable-auto-tool-choice), and the base model's pooled
    hidden states are embeddings (a LoRA adapter's are not served: `embeddings.check_embedding_model`)."""
    out = ["completions", "chat", "tools"]
    if serving.args.enable_auto_tool_choice:
        out.append("auto_tool_choice")
    if not adapter:
        out.append("embeddings")
    return out


def list_models(serving: OpenAIServing) -> ModelList:
    """The base model, then each LoRA adapter (`parent`: the base model's id, `root`: the adapter's path)."""
    base = ModelCard(id=serving.model_name, root=serving.args.model, max_model_len=serving.max_model_len,
                     description=serving.model_description, capabilities=capabilities(serving, adapter=False))
    adapters = [ModelCard(id=name, root=lora.lora_path, parent=serving.model_name, max_model_len=serving.max_model_len,
                          capabilities=capabilities(serving, adapter=True))
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
