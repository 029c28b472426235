"""`POST /tokenize` and `POST /detokenize` (vLLM's extensions); the work runs in the thread pool."""

from __future__ import annotations

from pydantic import Field, model_validator

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError, bad_request
from pagedserve.cluster.serving.requests import ChatMessageParam, OpenAIRequest, TokenId
from pagedserve.cluster.serving.responses import DetokenizeResponse, TokenizeResponse


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)



async def tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(request.model)
    if request.prompt is not None:
        prompt, add_special = request.prompt, request.add_special_tokens
        ids = await serving.run_blocking(lambda: list(serving.tokenizer(prompt, add_special_tokens=add_special).input_ids))
    else:
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in request.messages or []]
        except ValueError as exc:
            raise bad_request(exc) from None
        ids = await serving.encode_chat(conversation, None, request.add_generation_prompt)
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)


async def detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(request.model)
    vocab = len(serving.tokenizer)
    bad = [t for t in request.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await serving.run_blocking(serving.tokenizer.decode, request.tokens))
