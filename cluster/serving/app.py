"""The FastAPI app: routes of every endpoint family, error handlers and the API key check around one
`OpenAIServing`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from pagedserve.cluster.serving import chat, completions, system, tokenization
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError, error_param, errors_message
from pagedserve.cluster.serving.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

# Paths that answer without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})


def build_fastapi_app(serving: OpenAIServing) -> FastAPI:
    """Routes, error handlers and the API key check around one `OpenAIServing`."""
    app = FastAPI(title="pagedserve", description="OpenAI-compatible LLM serving", docs_url=None, redoc_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        serving.metrics.observe_error(400)
        return APIError(400, errors_message(errors), param=error_param(errors[0]) if errors else None).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if serving.args.api_key_digest is not None and request.url.path not in OPEN_PATHS:
            try:
                serving.check_api_key(request.headers.get("authorization"))
            except APIError as exc:
                return exc.response()
        return await call_next(request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest):
        return await completions.create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest):
        return await chat.create_chat_completion(serving, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return system.list_models(serving).model_dump()

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return tokenization.tokenize(serving, request).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return tokenization.detokenize(serving, request).model_dump()

    @app.get("/health")
    async def health() -> Response:
        await serving.coordinator.refresh_stats()
        return system.health(serving)

    @app.get("/ping")
    async def ping() -> Response:
        await serving.coordinator.refresh_stats()
        return system.health(serving)

    @app.get("/metrics")
    async def metrics() -> Response:
        await serving.coordinator.refresh_stats()  # exact counters at scrape time
        return system.render_metrics(serving)

    return app
