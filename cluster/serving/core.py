"""`OpenAIServing`: what every endpoint shares (the coordinator, tokenizer, settings, metrics),
the checks on model, key, prompt length and token budget, admission, and answering a request's
engine streams as one JSON body or as SSE."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.metrics import ServingMetrics
from pagedserve.cluster.serving.errors import APIError, bad_request, engine_error
from pagedserve.cluster.serving.formatting import sse
from pagedserve.cluster.serving.requests import ChatCompletionRequest, SamplingRequest
from pagedserve.cluster.serving.responses import ErrorResponse
from pagedserve.cluster.serving.settings import ServeArgs
from pagedserve.cluster.serving.streams import EncodedPrompt, RequestTimer, merge_streams, timed
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Shared state and checks of the OpenAI endpoints over a `DPCoordinator` (or anything with its API)."""

    def __init__(self, coordinator: Any, tokenizer: Any, args: ServeArgs, max_model_len: int) -> None:
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.args = args
        self.model_name = args.model_name
        self.max_model_len = max_model_len
        self.metrics = ServingMetrics(self.model_name, coordinator.aggregate_stats, max_model_len)
        self.num_in_flight = 0

    # ---------------------------------------------------------------- checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                           code="model_not_found")

    def check_api_key(self, authorization: str | None) -> None:
        expected = self.args.api_key_digest
        if expected is None:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        digest = hashlib.sha256(presented.encode()).hexdigest()
        if scheme != "Bearer" or not secrets.compare_digest(digest, expected):
            raise APIError(401, "Invalid or missing API key (send `Authorization: Bearer <key>`).",
                           type="authentication_error", code="invalid_api_key")

    def check_prompt_length(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {len(ids)} tokens (the prompt and at least one generated token must fit)",
                param=param, code="context_length_exceeded",
            )

    # ---------------------------------------------------------------- tokenization

    def encode_completion_prompt(self, index: int, prompt: str | list[int]) -> EncodedPrompt:
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt).input_ids)
            encoded = EncodedPrompt(index, prompt, prompt_ids)
        else:
            encoded = EncodedPrompt(index, None, list(prompt))
        self.check_prompt_length(encoded.token_ids, "prompt")
        return encoded

    def encode_chat(self, conversation: list[dict[str, str]], chat_template: str | None,
                    add_generation_prompt: bool, continue_final_message: bool = False) -> list[int]:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "chat_template: the model's tokenizer has no chat template", param="chat_template")
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True,
            )
        except Exception as exc:  # jinja errors, bad roles...
            raise APIError(400, f"messages: the chat template failed: {exc}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---------------------------------------------------------------- sampling

    def max_tokens_for(self, request: SamplingRequest, prompt_len: int, default_applies: bool) -> int:
        room = self.max_model_len - prompt_len
        requested = request.requested_max_tokens()
        if requested is None or (default_applies and requested > room):
            return room
        if requested > room:
            field_name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
            raise APIError(
                400,
                f"{field_name}: this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} for the completion)",
                param=field_name, code="context_length_exceeded",
            )
        return requested

    def sampling_params(self, request: SamplingRequest, max_tokens: int) -> dict:
        try:
            params = request.to_sampling_params(max_tokens)
        except ValueError as exc:
            raise bad_request(exc) from None
        limit = self.args.max_logprobs
        if params.logprobs is not None and params.logprobs > limit:
            name = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
            raise APIError(400, f"{name}: at most {limit} are allowed, got {params.logprobs}", param=name)
        return params.model_dump()

    # ---------------------------------------------------------------- admission and answering

    def admit(self) -> None:
        if self.num_in_flight >= self.args.max_pending_requests:
            self.metrics.observe_error(503)
            raise APIError(503, f"the server has {self.num_in_flight} requests in flight "
                                f"(limit {self.args.max_pending_requests}); retry later",
                           type="service_unavailable_error", code="overloaded", headers={"Retry-After": "1"})
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

    def _streams(self, request_id: str, prompts: list[EncodedPrompt], params: list[dict], priority: int,
                 timers: list[RequestTimer]) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [
            timed(self.coordinator.generate(f"{request_id}-{p.index}", p.token_ids, sp, priority), timer)
            for p, sp, timer in zip(prompts, params, timers)
        ]
        return merge_streams(streams)

    async def _admitted(self, stream: AsyncIterator) -> AsyncIterator:
        """Holds one admission slot until the stream is exhausted, fails or is closed (also by garbage
        collection of a started generator, e.g. when a client leaves before its SSE body starts)."""
        try:
            async for item in stream:
                yield item
        finally:
            self.release()
            await stream.aclose()  # type: ignore[attr-defined]

    async def run(self, request: SamplingRequest, request_id: str, prompts: list[EncodedPrompt],
                  params: list[dict], stream_fn: Callable, collect_fn: Callable) -> Response:
        """Admit, start the streams, and answer as SSE (after the first output, so early errors keep
        their status code) or as one JSON body."""
        self.admit()
        if request.user:
            logger.info("%s: user %r", request_id, request.user)
        timers = [RequestTimer(self.metrics, len(p.token_ids)) for p in prompts]
        outputs = self._admitted(self._streams(request_id, prompts, params, request.priority, timers))
        try:
            try:
                first = await outputs.__anext__()
            except StopAsyncIteration:
                raise APIError(500, "the engine returned no output", type="internal_server_error") from None
            if not request.stream:
                return JSONResponse((await collect_fn(first, outputs)).model_dump())
        except BaseException as exc:
            await outputs.aclose()
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                raise
            error = engine_error(exc)
            self.metrics.observe_error(error.status)
            raise error from None
        return StreamingResponse(self._sse_guard(stream_fn(first, outputs), outputs), media_type="text/event-stream")

    async def _sse_guard(self, events: AsyncIterator[str], outputs: AsyncIterator) -> AsyncIterator[str]:
        """Stream events; an error becomes an error event then [DONE]; a disconnect closes (aborts) the requests."""
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
            error = engine_error(exc)
            self.metrics.observe_error(error.status)
            yield sse(ErrorResponse(error=error.info).model_dump())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")
