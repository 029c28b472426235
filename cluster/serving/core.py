"""`OpenAIServing`: what every endpoint shares (the engine client, tokenizer, settings, metrics),
the checks on model, key, server limits, prompt length and token budget, tokenization and chat
templates off the event loop, admission, and answering a request's engine streams as one JSON body
or as SSE."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serving.overhead import OverheadMetrics
from pagedserve.cluster.serving.request_stages import current_stages, mark
from pagedserve.cluster.serving.tracing import Tracing
from pagedserve.cluster.engine_client import EngineClient
from pagedserve.cluster.serving.context import current_request_id
from pagedserve.cluster.serving.errors import APIError, bad_request, engine_error
from pagedserve.cluster.serving.formatting import sse
from pagedserve.cluster.serving.lora import LoRAAdapters, with_adapter
from pagedserve.cluster.serving.requests import SamplingRequest
from pagedserve.cluster.settings import ServeArgs
from pagedserve.cluster.serving.streams import EncodedPrompt, RequestTimer, timed
from pagedserve.cluster.stream_merge import merge_streams
from pagedserve.engine.models.default_model import describe_model
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class OpenAIServing:
    """Shared state and checks of the OpenAI endpoints over a `DPCoordinator` (or anything with its API)."""

    def __init__(self, client: EngineClient, tokenizer: Any, args: ServeArgs, max_model_len: int) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.args = args
        self.model_name = args.model_name
        self.model_description = describe_model(args.model)  # type: ignore[arg-type]
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.metrics = ServingMetrics(self.model_name, client.aggregate_stats, max_model_len)
        self.overhead = OverheadMetrics(self.metrics.registry, self.model_name)
        self.tracing: Tracing | None = Tracing.from_args(args)  # None: tracing off, OpenTelemetry never imported
        self.lora = LoRAAdapters(args, self.model_name)
        self.num_in_flight = 0
        self._limiter: anyio.CapacityLimiter | None = None

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-bound work (tokenizing, detokenizing, rendering a chat template) in the bounded
        thread pool, so that the event loop keeps answering (health probes, streams) meanwhile."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.args.tokenizer_pool_size)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._limiter)

    # ---------------------------------------------------------------- checks

    def served_name(self, model: str | None) -> str:
        """The `model` a response names: the LoRA adapter the request picked, else the base model."""
        lora = self.lora.resolve(model)
        return self.model_name if lora is None else lora.lora_name

    def check_model(self, model: str | None) -> None:
        """The base model or a LoRA adapter served by that name, else 404."""
        self.lora.resolve(model)

    def check_api_key(self, authorization: str | None) -> None:
        expected = self.args.api_key_digest
        if expected is None:
            return
        scheme, _, presented = (authorization or "").strip().partition(" ")
        digest = hashlib.sha256(presented.strip().encode("utf-8", "surrogateescape")).hexdigest()
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        if scheme.lower() != "bearer" or not secrets.compare_digest(digest, expected):
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

    def check_prompt_count(self, num_prompts: int, n: int) -> None:
        """The server's limit on prompts per request, and on the engine requests one HTTP request makes
        (prompts x n: more than `max_pending_requests` could never be admitted). Before any tokenization."""
        limit = self.args.max_prompts_per_request
        if num_prompts > limit:
            raise APIError(400, f"prompt: at most {limit} prompts per request are allowed, got {num_prompts}",
                           param="prompt")
        slots = num_prompts * n
        if slots > self.args.max_pending_requests:
            param = "prompt" if num_prompts > 1 else "n"
            raise APIError(400, f"{param}: {num_prompts} prompt(s) x n={n} make {slots} completions, more than the "
                                f"server queues at once ({self.args.max_pending_requests})", param=param)

    def check_limits(self, request: SamplingRequest) -> None:
        """The server's limits on n / best_of / logprobs, and logit_bias keys inside the vocabulary."""
        max_n = self.args.max_n
        for name in ("n", "best_of"):
            value = getattr(request, name, None)
            if value is not None and value > max_n:
                raise APIError(400, f"{name}: at most {max_n} are allowed, got {value}", param=name)
        max_logprobs = self.args.max_logprobs
        for name, value in ((request.logprobs_field(), request.requested_logprobs()),
                            ("prompt_logprobs", request.prompt_logprobs)):
            if value is not None and value > max_logprobs:
                raise APIError(400, f"{name}: at most {max_logprobs} are allowed, got {value}", param=name)
        outside = [k for k in request.logit_bias or {} if int(k) >= self.vocab_size]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary "
                                f"(size {self.vocab_size})", param="logit_bias")

    # ---------------------------------------------------------------- tokenization

    def _truncate(self, ids: list[int], request: SamplingRequest) -> list[int]:
        keep = request.truncate_prompt_tokens
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    async def encode_completion_prompt(self, index: int, prompt: str | list[int],
                                       request: SamplingRequest) -> EncodedPrompt:
        if isinstance(prompt, str):
            add_special = getattr(request, "add_special_tokens", True)
            mark("tokenize_start", first=True)  # (a batch of prompts: from the first one's start)
            ids = await self.run_blocking(lambda: list(self.tokenizer(prompt, add_special_tokens=add_special).input_ids))
            mark("tokenize_end")
            truncated = self._truncate(ids, request)
            encoded = EncodedPrompt(index, prompt if truncated is ids else None, truncated)
        else:
            encoded = EncodedPrompt(index, None, self._truncate(list(prompt), request))
        self.check_prompt_length(encoded.token_ids, "prompt")
        return encoded

    def check_chat_template(self, chat_template: str | None) -> None:
        if chat_template is not None and not self.args.trust_request_chat_template:
            raise APIError(400, "chat_template: a chat template in the request is not accepted by this server "
                                "(start it with --trust-request-chat-template to allow it)", param="chat_template")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "chat_template: the model's tokenizer has no chat template", param="chat_template")

    async def encode_chat(self, conversation: list[dict[str, Any]], chat_template: str | None,
                          add_generation_prompt: bool, continue_final_message: bool = False,
                          add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Render the conversation (and the tools, if any) with the chat template and tokenize it, in the
        thread pool; a rendered prompt over the size limit (`max_request_body_bytes` characters) is refused."""
        self.check_chat_template(chat_template)
        limit = self.args.max_request_body_bytes

        def render() -> list[int] | int:
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, tools=tools,
            )
            if len(text) > limit:
                return len(text)
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

        try:
            mark("tokenize_start")
            ids = await self.run_blocking(render)
            mark("tokenize_end")
        except Exception as exc:  # jinja errors, bad roles, a template that recurses...
            message = str(exc)[:500]
            raise APIError(400, f"messages: the chat template failed: {message}", param="messages") from None
        if isinstance(ids, int):
            raise APIError(400, f"messages: the rendered prompt has {ids} characters, more than the server's "
                                f"limit of {limit}", param="messages")
        return ids

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
            params = request.to_sampling_params(max_tokens, self.vocab_size)
        except ValueError as exc:
            raise bad_request(exc) from None
        return params.model_dump()

    # ---------------------------------------------------------------- admission and answering

    def admit(self, slots: int = 1) -> None:
        """Take `slots` of the `max_pending_requests` in flight (one per completion: prompts x n), or 503."""
        if self.num_in_flight + slots > self.args.max_pending_requests:
            raise APIError(503, f"the server has {self.num_in_flight} completions in flight and this request "
                                f"adds {slots} (limit {self.args.max_pending_requests}); retry later",
                           type="service_unavailable_error", code="overloaded", headers={"Retry-After": "1"})
        self.num_in_flight += slots

    def release(self, slots: int = 1) -> None:
        self.num_in_flight -= slots

    def _streams(self, request_id: str, prompts: list[EncodedPrompt], params: list[dict], priority: int,
                 timers: list[RequestTimer], final_only: bool,
                 cache_salt: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [
            timed(self.client.generate(f"{request_id}-{p.index}", p.token_ids, sp, priority,
                                            final_only=final_only, cache_salt=cache_salt), timer)
            for p, sp, timer in zip(prompts, params, timers)
        ]
        for p, timer in zip(prompts, timers):
            timer.on_finish = functools.partial(self._observe_overhead, f"{request_id}-{p.index}")
        return merge_streams(streams)

    def _observe_overhead(self, engine_request_id: str, timer: RequestTimer) -> None:
        """A finished engine request: its routing decisions (to its trace) and its overhead histograms."""
        take = getattr(self.client, "routing_records", None)
        routes = take(engine_request_id) if take is not None else []
        if timer.stages is not None:
            timer.stages.routes.extend(routes)
        ttft = None if timer.first is None else timer.first - timer.start
        decode = None if timer.first is None or timer.last is None else timer.last - timer.first
        self.overhead.observe(timer.stages, timer.ordered_legs(), routes, ttft, decode, timer.generated)

    async def _admitted(self, stream: AsyncIterator, slots: int) -> AsyncIterator:
        """Holds `slots` admission slots until the stream is exhausted, fails or is closed (also by garbage
        collection of a started generator, e.g. when a client leaves before its SSE body starts)."""
        try:
            async for item in stream:
                yield item
        finally:
            self.release(slots)
            await stream.aclose()  # type: ignore[attr-defined]

    async def run(self, request: SamplingRequest, request_id: str, prompts: list[EncodedPrompt],
                  params: list[dict], stream_fn: Callable, collect_fn: Callable) -> Response:
        """Admit, start the streams, and answer as SSE (after the first output, so early errors keep
        their status code) or as one JSON body. A JSON body is built from the finished outputs alone, so
        its engines are asked for only those (`final_only`: no per-step detokenization or transport)."""
        lora = self.lora.resolve(getattr(request, "model", None))
        params = with_adapter(params, lora)
        slots = len(prompts) * request.n
        self.admit(slots)
        if lora is not None:
            self.metrics.observe_adapter_request(lora.lora_name)
        logger.info("request %s: %s%s", current_request_id(), request_id,
                    f" (user {request.user!r})" if request.user else "")
        final_only = not request.stream
        stages = current_stages()
        if stages is not None:
            stages.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
            stages.streamed = bool(request.stream)
            stages.mark("dispatched")
        timers = [RequestTimer(self.metrics, len(p.token_ids), final_only=final_only, stages=stages) for p in prompts]
        outputs = self._admitted(self._streams(request_id, prompts, params, request.priority, timers, final_only,
                                               request.cache_salt), slots)
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
            raise engine_error(exc) from None
        return StreamingResponse(self._sse_guard(stream_fn(first, outputs), outputs), media_type="text/event-stream")

    async def _sse_guard(self, events: AsyncIterator[str], outputs: AsyncIterator) -> AsyncIterator[str]:
        """Stream events; an error becomes an error event then [DONE]; a disconnect closes (aborts) the requests."""
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
            error = engine_error(exc)
            self.metrics.observe_error(error.status)
            yield sse(error.body())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")
