"""OpenAI request logic, independent of Ray Serve: validate and tokenize requests, route them
through the `DPCoordinator`, and shape OpenAI responses and SSE streams (`OpenAIServing`), plus the
OpenAI-style error bodies and logprob formatting it uses. `cluster.serve_app` wires it to HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedserve.cluster.metrics import ServingMetrics
from pagedserve.cluster.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    ServeArgs,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)

# Paths that answer without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})
# JSON has no -inf: clamp logprobs as vLLM does.
MIN_LOGPROB = -9999.0


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):")


def _loc_param(loc: tuple) -> str | None:
    names = [str(part) for part in loc if isinstance(part, str) and part != "body"]
    return ".".join(names) if names else None


def _msg(error: dict) -> str:
    return str(error.get("msg", "")).removeprefix("Value error, ")


def error_param(error: dict) -> str | None:
    """A pydantic error's field: its location, else (model-level checks) the message's 'field:' prefix."""
    param = _loc_param(tuple(error.get("loc", ())))
    if param is not None:
        param = param.split(".")[0]  # the top-level request field
    else:
        match = _FIELD_PREFIX.match(_msg(error))
        param = match.group(1) if match else None
    return param


def errors_message(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = _loc_param(tuple(e.get("loc", ())))
        parts.append(f"{loc}: {_msg(e)}" if loc else _msg(e))
    return "; ".join(parts) or "invalid request"


def bad_request(exc: Exception) -> APIError:
    """400 from a ValueError: the field comes from a pydantic error's location or a 'field: ...' message."""
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        return APIError(400, errors_message(errors), param=error_param(errors[0]) if errors else None)
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    return APIError(400, message, param=match.group(1) if match else None)


def engine_error(exc: BaseException) -> APIError:
    """Map an engine/coordinator exception to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="service_unavailable_error", code="overloaded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(exc)
    logger.exception("request failed", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", type="internal_server_error")


# --------------------------------------------------------------------------- output shaping


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _token_text(entry: Logprob | None, token_id: int, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _top_entries(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The top `num` alternatives at one position, by rank (the sampled token is listed only if it ranks)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:num]


def completion_logprobs(output: CompletionOutput, num: int, text_offset: int, tokenizer) -> CompletionLogprobs:
    """OpenAI completions `logprobs` for the tokens of `output` (a delta or a whole output)."""
    result = CompletionLogprobs()
    for token_id, position in zip(output.token_ids, output.logprobs or []):
        sampled = position.get(token_id)
        token = _token_text(sampled, token_id, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB)
        top: dict[str, float] = {}
        for tid, lp in _top_entries(position, num):  # by rank: tokens that decode alike keep the best logprob
            top.setdefault(_token_text(lp, tid, tokenizer), _clamp(lp.logprob))
        result.top_logprobs.append(top if num > 0 else None)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(output: CompletionOutput, num: int, tokenizer) -> ChatLogprobs:
    """OpenAI chat `logprobs.content` for the tokens of `output`."""
    content: list[ChatLogprobToken] = []
    for token_id, position in zip(output.token_ids, output.logprobs or []):
        sampled = position.get(token_id)
        token = _token_text(sampled, token_id, tokenizer)
        top = [
            TopLogprob(token=(t := _token_text(lp, tid, tokenizer)), logprob=_clamp(lp.logprob),
                       bytes=list(t.encode("utf-8", errors="replace")))
            for tid, lp in _top_entries(position, num)
        ]
        content.append(ChatLogprobToken(
            token=token,
            logprob=_clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
            bytes=list(token.encode("utf-8", errors="replace")),
            top_logprobs=top,
        ))
    return ChatLogprobs(content=content)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# --------------------------------------------------------------------------- request plumbing


@dataclass
class EncodedPrompt:
    index: int
    text: str | None
    token_ids: list[int]


@dataclass
class RequestTimer:
    """Per-request latency bookkeeping for the metrics (TTFT, inter-token, e2e)."""

    metrics: ServingMetrics
    prompt_tokens: int
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    generated: int = 0
    finish_reason: str | None = None

    def on_output(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens:
            if self.first is None:
                self.first = now
                self.metrics.observe_first_token(now - self.start)
            else:
                self.metrics.observe_inter_token(now - self.last)  # type: ignore[operator]
            self.last = now
            self.generated += num_tokens
        for c in output.outputs:
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
        if output.finished:
            self.metrics.observe_finished(now - self.start, self.prompt_tokens, self.generated, self.finish_reason)


_END = object()


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output); closing this closes them all (aborts)."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for output in stream:
                yield 0, output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # closes each stream inside its task: the coordinator aborts unfinished requests
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    """Request handling of the OpenAI endpoints over a `DPCoordinator` (or anything with its API)."""

    def __init__(self, coordinator: Any, tokenizer: Any, args: ServeArgs, max_model_len: int) -> None:
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.args = args
        self.model_name = args.model_name
        self.max_model_len = max_model_len
        self.metrics = ServingMetrics(self.model_name, coordinator.aggregate_stats, max_model_len)
        self.num_in_flight = 0

    # ---------------------------------------------------------------- validation helpers

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

    def _check_prompt_length(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {len(ids)} tokens (the prompt and at least one generated token must fit)",
                param=param, code="context_length_exceeded",
            )

    def encode_completion_prompt(self, index: int, prompt: str | list[int]) -> EncodedPrompt:
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt).input_ids)
            encoded = EncodedPrompt(index, prompt, prompt_ids)
        else:
            encoded = EncodedPrompt(index, None, list(prompt))
        self._check_prompt_length(encoded.token_ids, "prompt")
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

    # ---------------------------------------------------------------- admission

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
            self._timed(self.coordinator.generate(f"{request_id}-{p.index}", p.token_ids, sp, priority), timer)
            for p, sp, timer in zip(prompts, params, timers)
        ]
        return merge_streams(streams)

    @staticmethod
    async def _timed(stream: AsyncIterator[RequestOutput], timer: RequestTimer) -> AsyncIterator[RequestOutput]:
        try:
            async for output in stream:
                timer.on_output(output)
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _admitted(self, stream: AsyncIterator) -> AsyncIterator:
        """Holds one admission slot until the stream is exhausted, fails or is closed (also by garbage
        collection of a started generator, e.g. when a client leaves before its SSE body starts)."""
        try:
            async for item in stream:
                yield item
        finally:
            self.release()
            await stream.aclose()  # type: ignore[attr-defined]

    async def _run(self, request: SamplingRequest, request_id: str, prompts: list[EncodedPrompt],
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

    # ---------------------------------------------------------------- completions

    async def create_completion(self, request: CompletionRequest) -> Response:
        self.check_model(request.model)
        prompts = [self.encode_completion_prompt(i, p) for i, p in enumerate(request.prompts())]
        default_applies = "max_tokens" not in request.model_fields_set
        params = [self.sampling_params(request, self.max_tokens_for(request, len(p.token_ids), default_applies))
                  for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = request.n
        num_logprobs = request.logprobs

        def echo_prefix(p: EncodedPrompt) -> str:
            if not request.echo:
                return ""
            return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

        async def collect(first: tuple[int, RequestOutput], rest: AsyncIterator) -> CompletionResponse:
            texts: dict[int, list[str]] = {}
            whole: dict[int, CompletionOutput] = {}
            async for i, output in _chain(first, rest):
                for c in output.outputs:
                    idx = i * n + c.index
                    if idx not in whole:
                        whole[idx] = CompletionOutput(idx, "", [], None, [] if c.logprobs is not None else None)
                        texts[idx] = [echo_prefix(prompts[i])]
                    acc = whole[idx]
                    texts[idx].append(c.text)
                    acc.token_ids.extend(c.token_ids)
                    if c.logprobs is not None and acc.logprobs is not None:
                        acc.logprobs.extend(c.logprobs)
                    if c.finish_reason is not None:
                        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
            choices = []
            for idx in sorted(whole):
                acc = whole[idx]
                logprobs = (completion_logprobs(acc, num_logprobs, 0, self.tokenizer)
                            if num_logprobs is not None else None)
                choices.append(CompletionChoice(index=idx, text="".join(texts[idx]), logprobs=logprobs,
                                                finish_reason=acc.finish_reason, stop_reason=acc.stop_reason))
            completion_tokens = sum(len(acc.token_ids) for acc in whole.values())
            return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=_usage(prompts, completion_tokens))

        async def stream(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[str]:
            offsets: dict[int, int] = {}
            completion_tokens = 0
            async for i, output in _chain(first, rest):
                for c in output.outputs:
                    idx = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    if idx not in offsets:
                        prefix = echo_prefix(prompts[i])
                        text = prefix + text
                        offsets[idx] = len(prefix)
                    if not text and c.finish_reason is None and (num_logprobs is None or not c.token_ids):
                        continue  # text held back (a partial character or stop string) and nothing else to say
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs = completion_logprobs(c, num_logprobs, offsets[idx], self.tokenizer)
                    offsets[idx] += len(text)
                    choice = CompletionChoice(index=idx, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    chunk = CompletionResponse(id=request_id, created=created, model=self.model_name,
                                               choices=[choice])
                    if request.continuous_usage:
                        chunk.usage = _usage(prompts, completion_tokens)
                        yield sse(chunk.model_dump())
                    else:
                        yield sse(chunk.model_dump(exclude={"usage"}))
            if request.include_usage:
                chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                           usage=_usage(prompts, completion_tokens))
                yield sse(chunk.model_dump())

        return await self._run(request, request_id, prompts, params, stream, collect)

    # ---------------------------------------------------------------- chat

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        self.check_model(request.model)
        try:
            conversation = request.conversation()
        except ValueError as exc:
            raise bad_request(exc) from None
        ids = self.encode_chat(conversation, request.chat_template, request.add_generation_prompt,
                               request.continue_final_message)
        self._check_prompt_length(ids, "messages")
        prompts = [EncodedPrompt(0, None, ids)]
        params = [self.sampling_params(request, self.max_tokens_for(request, len(ids), default_applies=False))]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        num_top = request.top_logprobs or 0
        want_logprobs = request.logprobs

        async def collect(first: tuple[int, RequestOutput], rest: AsyncIterator) -> ChatCompletionResponse:
            whole: dict[int, CompletionOutput] = {}
            texts: dict[int, list[str]] = {}
            async for _, output in _chain(first, rest):
                for c in output.outputs:
                    acc = whole.setdefault(c.index, CompletionOutput(c.index, "", [], None, []))
                    texts.setdefault(c.index, []).append(c.text)
                    acc.token_ids.extend(c.token_ids)
                    acc.logprobs.extend(c.logprobs or [])  # type: ignore[union-attr]
                    if c.finish_reason is not None:
                        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
            choices = [
                ChatChoice(index=idx, message=ChatMessage(content="".join(texts[idx])),
                           logprobs=chat_logprobs(whole[idx], num_top, self.tokenizer) if want_logprobs else None,
                           finish_reason=whole[idx].finish_reason, stop_reason=whole[idx].stop_reason)
                for idx in sorted(whole)
            ]
            completion_tokens = sum(len(acc.token_ids) for acc in whole.values())
            return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                          usage=_usage(prompts, completion_tokens))

        def chunk(choices: list[ChatStreamChoice], completion_tokens: int) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices)
            if request.continuous_usage:
                body.usage = _usage(prompts, completion_tokens)
                return sse(body.model_dump())
            return sse(body.model_dump(exclude={"usage"}))

        async def stream(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[str]:
            for idx in range(request.n):  # the role comes first, once per choice
                yield chunk([ChatStreamChoice(index=idx, delta=ChatDelta(role="assistant", content=""))], 0)
            completion_tokens = 0
            async for _, output in _chain(first, rest):
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and (not want_logprobs or not c.token_ids):
                        continue
                    logprobs = chat_logprobs(c, num_top, self.tokenizer) if want_logprobs else None
                    yield chunk([ChatStreamChoice(index=c.index, delta=ChatDelta(content=c.text), logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                                completion_tokens)
            if request.include_usage:
                body = ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                           usage=_usage(prompts, completion_tokens))
                yield sse(body.model_dump())

        return await self._run(request, request_id, prompts, params, stream, collect)

    # ---------------------------------------------------------------- the rest

    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.args.model, max_model_len=self.max_model_len)])

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if request.prompt is not None:
            ids = list(self.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        else:
            try:
                conversation = [{"role": m.role, "content": m.text()} for m in request.messages or []]
            except ValueError as exc:
                raise bad_request(exc) from None
            ids = self.encode_chat(conversation, None, request.add_generation_prompt)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if t < 0 or t >= vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def health(self) -> Response:
        if self.coordinator.is_healthy():
            return Response(status_code=200)
        return APIError(503, "an engine is unreachable or has stopped making progress with work waiting",
                        type="service_unavailable_error", code="unhealthy").response()

    def render_metrics(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(content=body, media_type=content_type)


async def _chain(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[tuple[int, RequestOutput]]:
    yield first
    async for item in rest:
        yield item


def _usage(prompts: list[EncodedPrompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
