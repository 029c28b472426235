"""`POST /v1/chat/completions`: chat completions over the model's chat template, whole or streamed,
with tool calls (`tools.py`) read out of each choice's text."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import Response

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import bad_request
from pagedserve.cluster.serving.formatting import chat_logprobs, prompt_logprobs, sse, usage
from pagedserve.cluster.serving.requests import ChatCompletionRequest
from pagedserve.cluster.serving.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatStreamChoice,
)
from pagedserve.cluster.serving.streams import EncodedPrompt, chain, collect
from pagedserve.cluster.serving.tools import (
    adjust_sampling_params,
    check_schemas,
    delta_tool_calls,
    finish_reason,
    plan_tools,
    whole_message,
)
from pagedserve.engine.outputs import RequestOutput


async def create_chat_completion(serving: OpenAIServing, request: ChatCompletionRequest) -> Response:
    serving.check_model(request.model)
    serving.check_limits(request)
    serving.check_prompt_count(1, request.n)
    try:
        conversation = request.conversation()
        plan = plan_tools(request, serving.args)
    except ValueError as exc:
        raise bad_request(exc) from None
    if plan.tools:  # their schemas compile (xgrammar): off the event loop
        await serving.run_blocking(check_schemas, plan)
    ids = await serving.encode_chat(conversation, request.chat_template, request.add_generation_prompt,
                                    request.continue_final_message, request.add_special_tokens,
                                    tools=plan.template_tools)
    keep = request.truncate_prompt_tokens
    if keep is not None and len(ids) > keep:
        ids = ids[-keep:]
    serving.check_prompt_length(ids, "messages")
    prompts = [EncodedPrompt(0, None, ids)]
    max_tokens = serving.max_tokens_for(request, len(ids), default_applies=False)
    if request.has_output_constraint:  # parsing the spec loads xgrammar once: off the event loop
        params = [await serving.run_blocking(serving.sampling_params, request, max_tokens)]
    else:
        params = [serving.sampling_params(request, max_tokens)]
    params = [adjust_sampling_params(plan, p) for p in params]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    num_top = request.top_logprobs or 0
    want_logprobs = request.logprobs
    tokenizer = serving.tokenizer
    model_name = serving.served_name(request.model)

    async def collect_response(first: tuple[int, RequestOutput], rest: AsyncIterator) -> ChatCompletionResponse:
        collected = await collect(first, rest, request.n)
        choices = []
        for idx, choice in sorted(collected.choices.items()):
            content, calls = whole_message(plan, choice.text)
            choices.append(ChatChoice(
                index=idx, message=ChatMessage(content=content, tool_calls=calls),
                logprobs=chat_logprobs(choice.output, num_top, tokenizer) if want_logprobs else None,
                finish_reason=finish_reason(choice.output.finish_reason, bool(calls)),
                stop_reason=choice.output.stop_reason))
        prompt_lps = collected.prompt_logprobs.get(0)
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                      usage=usage(prompts, collected.completion_tokens),
                                      prompt_logprobs=prompt_logprobs(prompt_lps) if prompt_lps else None)

    def chunk(choices: list[ChatStreamChoice], completion_tokens: int) -> str:
        body = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices)
        if request.continuous_usage:
            body.usage = usage(prompts, completion_tokens)
            return sse(body.model_dump())
        return sse(body.model_dump(exclude={"usage"}))

    async def stream(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[str]:
        for idx in range(request.n):  # the role comes first, once per choice
            yield chunk([ChatStreamChoice(index=idx, delta=ChatDelta(role="assistant", content=""))], 0)
        completion_tokens = 0
        parsers = {idx: plan.stream() for idx in range(request.n)}  # None: plain text
        called: set[int] = set()
        async for _, output in chain(first, rest):
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                delta = ChatDelta(content=c.text)
                parser = parsers[c.index]
                if parser is not None:
                    parsed = parser.feed(c.text)
                    if c.finish_reason is not None:
                        end = parser.finish()
                        parsed.content += end.content
                        parsed.tool_calls += end.tool_calls
                    if parsed.tool_calls:
                        called.add(c.index)
                    delta = ChatDelta(content=parsed.content or None, tool_calls=delta_tool_calls(parsed))
                if (not delta.content and not delta.tool_calls and c.finish_reason is None
                        and (not want_logprobs or not c.token_ids)):
                    continue
                logprobs = chat_logprobs(c, num_top, tokenizer) if want_logprobs else None
                reason = finish_reason(c.finish_reason, c.index in called)
                yield chunk([ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                              finish_reason=reason, stop_reason=c.stop_reason)],
                            completion_tokens)
        if request.include_usage:
            body = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                       usage=usage(prompts, completion_tokens))
            yield sse(body.model_dump())

    return await serving.run(request, request_id, prompts, params, stream, collect_response)
