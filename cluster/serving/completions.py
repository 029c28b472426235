"""`POST /v1/completions`: text completions, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import Response

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.formatting import completion_logprobs, prompt_logprobs, sse, usage
from pagedserve.cluster.serving.requests import CompletionRequest
from pagedserve.cluster.serving.responses import CompletionChoice, CompletionResponse
from pagedserve.cluster.serving.streams import EncodedPrompt, chain, collect
from pagedserve.engine.outputs import RequestOutput


async def create_completion(serving: OpenAIServing, request: CompletionRequest) -> Response:
    serving.check_model(request.model)
    serving.check_limits(request)
    raw_prompts = request.prompts()
    serving.check_prompt_count(len(raw_prompts), request.n)  # before any prompt is tokenized
    prompts = [await serving.encode_completion_prompt(i, p, request) for i, p in enumerate(raw_prompts)]
    default_applies = "max_tokens" not in request.model_fields_set
    params = []
    for p in prompts:
        max_tokens = serving.max_tokens_for(request, len(p.token_ids), default_applies)
        if request.has_output_constraint:  # parsing the spec loads xgrammar once: off the event loop
            params.append(await serving.run_blocking(serving.sampling_params, request, max_tokens))
        else:
            params.append(serving.sampling_params(request, max_tokens))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = request.n
    num_logprobs = request.logprobs
    tokenizer = serving.tokenizer
    model_name = serving.served_name(request.model)

    echoed: dict[int, str] = {}
    if request.echo:
        for p in prompts:
            echoed[p.index] = p.text if p.text is not None else await serving.run_blocking(tokenizer.decode, p.token_ids)

    def echo_prefix(p: EncodedPrompt) -> str:
        return echoed.get(p.index, "")

    async def collect_response(first: tuple[int, RequestOutput], rest: AsyncIterator) -> CompletionResponse:
        collected = await collect(first, rest, n)
        choices = []
        for idx in sorted(collected.choices):
            choice = collected.choices[idx]
            acc = choice.output
            logprobs = completion_logprobs(acc, num_logprobs, 0, tokenizer) if num_logprobs is not None else None
            prompt_lps = collected.prompt_logprobs.get(choice.prompt_index)
            choices.append(CompletionChoice(index=idx, text=echo_prefix(prompts[choice.prompt_index]) + choice.text,
                                            logprobs=logprobs, finish_reason=acc.finish_reason,
                                            stop_reason=acc.stop_reason,
                                            prompt_logprobs=prompt_logprobs(prompt_lps) if prompt_lps else None))
        return CompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                  usage=usage(prompts, collected.completion_tokens))

    async def stream(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        completion_tokens = 0
        async for i, output in chain(first, rest):
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
                    logprobs = completion_logprobs(c, num_logprobs, offsets[idx], tokenizer)
                offsets[idx] += len(text)
                choice = CompletionChoice(index=idx, text=text, logprobs=logprobs,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                chunk = CompletionResponse(id=request_id, created=created, model=model_name, choices=[choice])
                if request.continuous_usage:
                    chunk.usage = usage(prompts, completion_tokens)
                    yield sse(chunk.model_dump())
                else:
                    yield sse(chunk.model_dump(exclude={"usage"}))
        if request.include_usage:
            chunk = CompletionResponse(id=request_id, created=created, model=model_name, choices=[],
                                       usage=usage(prompts, completion_tokens))
            yield sse(chunk.model_dump())

    return await serving.run(request, request_id, prompts, params, stream, collect_response)
