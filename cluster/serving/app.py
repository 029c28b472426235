"""The FastAPI app: routes of every endpoint family around one `OpenAIServing`, with the error
handlers and the ASGI middleware (request ids, API key, body size limit, unexpected errors)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI
from fastapi.responses import Response

from pagedserve.cluster.serving import chat, completions, embeddings, system, tokenization
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import install_error_handlers
from pagedserve.cluster.serving.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedserve.cluster.serving.middleware import ServingMiddleware
from pagedserve.cluster.serving.requests import ChatCompletionRequest, CompletionRequest
from pagedserve.cluster.serving.tokenization import DetokenizeRequest, TokenizeRequest

# Paths that answer without an API key (probes; the scraper too unless --metrics-require-auth).
PROBE_PATHS = frozenset({"/health", "/ping"})


def open_paths(serving: OpenAIServing) -> frozenset[str]:
    return PROBE_PATHS if serving.args.metrics_require_auth else PROBE_PATHS | {"/metrics"}


def build_fastapi_app(serving: OpenAIServing, behind_serve_proxy: bool = False) -> FastAPI:
    """Routes, error handlers and middleware around one `OpenAIServing`. `behind_serve_proxy`: Ray Serve's
    HTTP proxy sets X-Request-Id on every response, so the app leaves the header to it."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if serving.tracing is not None:  # the traces still batched go out before the app stops
            await anyio.to_thread.run_sync(serving.tracing.flush)

    app = FastAPI(title="pagedserve", description="OpenAI-compatible LLM serving", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(ServingMiddleware, serving=serving, open_paths=open_paths(serving),
                       set_request_id_header=not behind_serve_proxy)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest):
        return await completions.create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest):
        return await chat.create_chat_completion(serving, request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: embeddings.EmbeddingRequest) -> dict:
        return await embeddings.create_embedding(serving, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return system.list_models(serving).model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> dict:
        lora = await serving.run_blocking(serving.lora.load, request.lora_name, request.lora_path)
        return {"object": "lora_adapter", "id": lora.lora_name, "root": lora.lora_path, "parent": serving.model_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> dict:
        serving.lora.unload(request.lora_name)
        return {"object": "lora_adapter", "id": request.lora_name, "deleted": True}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return (await tokenization.tokenize(serving, request)).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return (await tokenization.detokenize(serving, request)).model_dump()

    # Probes and the scraper read what the engine client last polled: no RPC per call.
    @app.get("/health")
    async def health() -> Response:
        return system.health(serving)

    @app.get("/ping")
    async def ping() -> Response:
        return system.health(serving)

    @app.get("/metrics")
    async def metrics() -> Response:
        return system.render_metrics(serving)

    return app
